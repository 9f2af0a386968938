"""Tests of the torch-patch tool (apply / revert / status / export / dev) on stand-in targets.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tp_helpers import (NEW_FILE, REAL_SERIES_DIR, RELEASE, REPO, RUNNING_VERSION, TEST_FILES, git, run_cli,
                        standin_checkout, tree_digest)

import torch_patch
from torch_patch import core


def series_names(series_dir: Path):
    return (series_dir / "series").read_text().split()


# ------------------------------------------------------------------------------------------
# apply / revert / status


def test_apply_revert_roundtrip(target, test_series):
    before = tree_digest(target)
    mtimes = {rel: os.stat(target / rel).st_mtime_ns for rel in TEST_FILES}
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout.strip()) == (1, "not applied")

    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "checking 2 patches" in r.stdout
    names = series_names(test_series)
    assert f"ok {names[0]} (1 file)" in r.stdout and f"ok {names[1]} (3 files)" in r.stdout
    assert "# torch-patch test: first patch" in (target / TEST_FILES[0]).read_text()
    assert "# torch-patch test: near tree_flatten" in (target / TEST_FILES[0]).read_text()
    assert "# torch-patch test: second patch" in (target / TEST_FILES[1]).read_text()
    assert (target / NEW_FILE).read_text() == "PROBE = 'patched'\n"
    for rel in TEST_FILES:
        assert os.stat(target / rel).st_mtime_ns != mtimes[rel]

    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout.strip()) == (0, f"applied ({', '.join(names)})")
    state = json.loads((target / ".torch-patch" / "state.json").read_text())
    assert state["torch_version"].startswith(RELEASE)
    assert set(state["files"]) == {*TEST_FILES, NEW_FILE}
    assert state["files"][NEW_FILE]["before"] is None
    for rel in TEST_FILES:
        assert state["files"][rel]["before"] == before[rel]
        assert state["files"][rel]["after"] == core.sha256_file(target / rel)

    r = run_cli("revert", target)
    assert r.returncode == 0, r.stderr
    assert tree_digest(target) == before  # byte-identical, and no state dir left behind
    assert not (target / ".torch-patch").exists()
    r = run_cli("status", target)
    assert (r.returncode, r.stdout.strip()) == (1, "not applied")
    r = run_cli("revert", target)
    assert r.returncode == 0 and "nothing to revert" in r.stdout


def test_python_api(target, test_series):
    before = tree_digest(target)
    logs = []
    state = torch_patch.apply(target, series_dir=test_series, log=logs.append)
    assert state["patches"] == series_names(test_series)
    st = torch_patch.status(target, series_dir=test_series)
    assert (st.code, st.state, st.series_current) == (0, "applied", True)
    torch_patch.revert(target, log=logs.append)
    assert tree_digest(target) == before
    assert torch_patch.status(target).code == torch_patch.EXIT_NOT_APPLIED


def test_apply_twice_is_noop(target, test_series):
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    applied = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "already applied" in r.stdout and "nothing to do" in r.stdout
    assert tree_digest(target) == applied


def test_different_series_refused_then_reapply(target, test_series, first_patch_only):
    before = tree_digest(target)
    assert run_cli("apply", target, "--series", first_patch_only).returncode == 0
    one = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 5
    assert "different series is already applied" in r.stderr and "revert" in r.stderr
    assert "--reapply" in r.stderr
    assert tree_digest(target) == one
    r = run_cli("apply", target, "--series", test_series, "--reapply")
    assert r.returncode == 0, r.stderr
    r = run_cli("status", target, "--series", test_series, "--json")
    data = json.loads(r.stdout)
    assert (r.returncode, data["state"], data["patches"]) == (0, "applied", series_names(test_series))
    assert run_cli("revert", target).returncode == 0
    assert tree_digest(target) == before


def test_status_reports_older_series(target, test_series, first_patch_only):
    assert run_cli("apply", target, "--series", first_patch_only).returncode == 0
    r = run_cli("status", target, "--series", test_series)
    assert r.returncode == 0 and "different series" in r.stdout


def test_wrong_base_version(target, test_series):
    vp = target / "torch" / "version.py"
    vp.write_text(vp.read_text().replace(f"'{RELEASE}", "'2.12.1"))
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 3
    assert "found torch 2.12.1" in r.stderr and "expected torch 2.13 (2.13.0), 2.14 (2.14.1) or 2.15 (2.15.0)" in r.stderr
    assert tree_digest(target) == before
    r = run_cli("status", target)
    assert r.returncode == 3
    suffix = RUNNING_VERSION[len(RELEASE):]  # "+cpu", "+cu130"
    assert r.stdout.strip() == (f"base mismatch: found torch 2.12.1{suffix}, "
                                "expected torch 2.13 (2.13.0), 2.14 (2.14.1) or 2.15 (2.15.0)")
    assert run_cli("revert", target).returncode == 3


def test_not_a_target(tmp_path, test_series):
    r = run_cli("apply", tmp_path, "--series", test_series)
    assert r.returncode == 5 and "neither a PyTorch checkout" in r.stderr
    r = run_cli("status", tmp_path / "missing")
    assert r.returncode == 5 and "does not exist" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_package_dir_as_target(target, test_series):
    r = run_cli("apply", target / "torch", "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert (target / ".torch-patch" / "state.json").exists()


def test_read_only_target(target, test_series):
    """The target cannot be written: clear error, nothing changed.

    Tests usually run as root, and root ignores permission bits, so chmod alone proves nothing
    there.  As root we make the target a real read-only filesystem instead: a read-only bind
    mount in a private mount namespace (`unshare -m`), which stops root as well (EROFS).
    As a normal user, `chmod -w` is enough."""
    before = tree_digest(target)
    if os.geteuid() == 0:
        cmd = [sys.executable, "-m", "torch_patch", "apply", str(target), "--series", str(test_series)]
        script = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"')
        env = dict(os.environ, PYTHONPATH=str(REPO))
        r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(target), *cmd],
                           capture_output=True, text=True, env=env)
        assert "Read-only file system" in r.stderr, r.stderr
    else:
        modes = {}
        for d in [target, *(p for p in target.rglob("*") if p.is_dir())]:
            modes[d] = d.stat().st_mode
            d.chmod(modes[d] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            r = run_cli("apply", target, "--series", test_series)
        finally:
            for d, m in modes.items():
                d.chmod(m)
    assert r.returncode == 5
    assert "target not writable" in r.stderr and str(target) in r.stderr
    assert tree_digest(target) == before


def test_revert_refuses_hand_edited_file(target, test_series):
    before = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    edited = target / TEST_FILES[1]
    edited.write_text(edited.read_text() + "# my local edit\n")
    r = run_cli("status", target)
    assert (r.returncode, r.stdout.strip()) == (2, f"modified after apply ({TEST_FILES[1]})")
    r = run_cli("revert", target)
    assert r.returncode == 2
    assert TEST_FILES[1] in r.stderr and "--force" in r.stderr
    assert edited.read_text().endswith("# my local edit\n")
    r = run_cli("revert", target, "--force")
    assert r.returncode == 0, r.stderr
    assert tree_digest(target) == before


@pytest.mark.parametrize("after_files", [1, 2])
def test_kill_during_apply_then_apply_finishes(target, test_series, tmp_path, after_files):
    reference = tmp_path / "reference"
    shutil.copytree(target, reference)
    assert run_cli("apply", reference, "--series", test_series).returncode == 0

    r = run_cli("apply", target, "--series", test_series, env_extra={core.FAULT_ENV: str(after_files)})
    assert r.returncode == core.FAULT_EXIT_CODE
    r = run_cli("status", target)
    assert r.returncode == 4
    assert r.stdout.startswith(f"interrupted (apply of ") and f"{after_files} of 3 files" in r.stdout
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "finishing interrupted apply" in r.stdout
    assert run_cli("status", target).returncode == 0
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith(".torch-patch/")}
    assert strip(tree_digest(target)) == strip(tree_digest(reference))


def test_kill_before_journal_leaves_target_untouched(target, test_series):
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, env_extra={core.FAULT_ENV: "0"})
    assert r.returncode == core.FAULT_EXIT_CODE
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith(".torch-patch/")}
    assert strip(tree_digest(target)) == before  # only leftovers in the state dir
    assert (run_cli("status", target).returncode, run_cli("status", target).stdout) == (1, "not applied\n")
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    assert sorted(p.name for p in (target / ".torch-patch").iterdir()) == ["orig", "state.json"]
    assert run_cli("revert", target).returncode == 0
    assert tree_digest(target) == before


def test_kill_during_apply_then_revert_rolls_back(target, test_series):
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, env_extra={core.FAULT_ENV: "2"})
    assert r.returncode == core.FAULT_EXIT_CODE
    assert tree_digest(target) != before
    r = run_cli("revert", target)
    assert r.returncode == 0, r.stderr
    assert "rolling back interrupted apply" in r.stdout
    assert tree_digest(target) == before
    assert run_cli("status", target).returncode == 1


def test_kill_during_revert_then_revert_finishes(target, test_series):
    before = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    r = run_cli("revert", target, env_extra={core.FAULT_ENV: "1"})
    assert r.returncode == core.FAULT_EXIT_CODE
    r = run_cli("status", target)
    assert r.returncode == 4 and "interrupted (revert" in r.stdout
    assert run_cli("revert", target).returncode == 0
    assert tree_digest(target) == before


def test_git_missing(target, test_series):
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, env_extra={"PATH": "/nonexistent"})
    assert r.returncode == 5
    assert "git not found on PATH" in r.stderr
    assert tree_digest(target) == before


def test_patch_does_not_apply_names_file_and_hunk(target, test_series):
    f = target / TEST_FILES[0]
    f.write_text(f.read_text().replace("\ndef tree_flatten(", "\ndef tree_flatten_renamed(", 1))
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 5
    second = series_names(test_series)[1]
    assert f"patch {second} does not apply" in r.stderr
    assert f"{TEST_FILES[0]}, hunk #1 of 1 (@@ -" in r.stderr
    assert "nothing was changed" in r.stderr
    assert tree_digest(target) == before  # also: no .torch-patch dir left


def test_default_target_is_this_interpreters_torch(target, test_series):
    r = run_cli("apply", "--series", test_series, env_extra={"PYTHONPATH": str(target)})
    assert r.returncode == 0, r.stderr
    assert str(target) in r.stdout
    r = run_cli("status", env_extra={"PYTHONPATH": str(target)})
    assert r.returncode == 0


def test_default_target_outside_venv_refused(target, test_series):
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    probe = subprocess.run([base_python, "-c", "import sys; print(sys.prefix == sys.base_prefix)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "True", "the tests must run in a venv"
    before = tree_digest(target)
    env = {"PYTHONPATH": str(target)}
    r = run_cli("apply", "--series", test_series, env_extra=env, python=base_python)
    assert r.returncode == 5
    assert "not running in a virtual environment" in r.stderr and "--allow-system" in r.stderr
    assert tree_digest(target) == before
    r = run_cli("apply", "--series", test_series, "--allow-system", env_extra=env, python=base_python)
    assert r.returncode == 0, r.stderr
    assert "# torch-patch test: first patch" in (target / TEST_FILES[0]).read_text()


def test_target_inside_enclosing_git_repo(tmp_path, template, test_series):
    """A venv inside a clone (.venv, .nox): git must not treat paths relative to the clone."""
    outer = tmp_path / "clone"
    outer.mkdir()
    git("init", "-q", cwd=outer)
    (outer / "README").write_text("x\n")
    git("add", "README", cwd=outer)
    git("commit", "-q", "-m", "init", cwd=outer)
    target = outer / ".venv" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(template, target)
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, cwd=target)
    assert r.returncode == 0, r.stderr
    assert "# torch-patch test: first patch" in (target / TEST_FILES[0]).read_text()
    assert "# torch-patch test: second patch" in (target / TEST_FILES[1]).read_text()
    assert (target / NEW_FILE).exists()
    assert run_cli("revert", target).returncode == 0
    assert tree_digest(target) == before


def test_checkout_target(tmp_path, template, test_series):
    co = standin_checkout(tmp_path / "pytorch", template)
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "(checkout)" in r.stdout
    assert (co / ".git" / "torch-patch" / "state.json").exists()
    assert git("diff", "--cached", "--name-only", cwd=co).stdout == ""  # index untouched
    assert git("diff", "--name-only", cwd=co).stdout.split() == sorted(TEST_FILES)
    assert git("status", "--porcelain", cwd=co).stdout.split()[-1] == NEW_FILE
    assert run_cli("status", co).returncode == 0
    assert run_cli("revert", co).returncode == 0
    assert git("status", "--porcelain", cwd=co).stdout == ""
    assert not (co / ".git" / "torch-patch").exists()


def test_checkout_with_series_committed(tmp_path, template, test_series):
    """After `git am` of the series, apply recognises the files as already patched."""
    co = standin_checkout(tmp_path / "pytorch", template)
    names = series_names(test_series)
    assert git("am", *[str(test_series / n) for n in names], cwd=co, check=False).returncode == 0
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "already contained" in r.stdout
    assert git("status", "--porcelain", cwd=co).stdout == ""
    assert not (co / ".git" / "torch-patch").exists()


# ------------------------------------------------------------------------------------------
# dev / export


def test_dev_export_is_byte_stable_and_prunes(tmp_path, template, test_series, dev_tree):
    out = tmp_path / "patches"
    torch_patch.dev_export(dev_tree, patches_dir=out, log=lambda s: None)
    first = tree_digest(out)
    assert first == tree_digest(test_series)  # same commits -> same bytes
    text = (out / series_names(out)[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
    assert "Subject: [PATCH] Test patch one" in text and not text.rstrip().endswith("2.39.5")
    (out / "0099-stale.patch").write_text("stale")
    torch_patch.dev_export(dev_tree, patches_dir=out, log=lambda s: None)
    assert tree_digest(out) == first


def test_dev_export_refuses_dirty_tree_and_bad_paths(tmp_path, template, empty_series):
    dev = tmp_path / "dev"
    torch_patch.dev_create(dev, source=template, series_dir=empty_series, log=lambda s: None)
    f = dev / TEST_FILES[0]
    f.write_text(f.read_text() + "# uncommitted\n")
    r = run_cli("dev", "--export", dev, "--patches-dir", tmp_path / "out")
    assert r.returncode == 5 and "uncommitted changes" in r.stderr and TEST_FILES[0] in r.stderr
    git("commit", "-q", "-am", "edit", cwd=dev)
    (dev / "test").mkdir()
    (dev / "test" / "test_x.py").write_text("pass\n")
    git("add", "-f", "test/test_x.py", cwd=dev)
    git("commit", "-q", "-m", "a test", cwd=dev)
    r = run_cli("dev", "--export", dev, "--patches-dir", tmp_path / "out")
    assert r.returncode == 5 and "test/test_x.py, outside torch/" in r.stderr
    r = run_cli("dev", "--export", env_extra={"TORCH_PATCH_DEV": ""})
    assert r.returncode == 5 and "TORCH_PATCH_DEV" in r.stderr


def test_dev_create_from_patched_target(tmp_path, target, test_series, dev_tree):
    """dev takes the stock originals even if the source torch is patched; hashes reproducible."""
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    dev = tmp_path / "dev"
    r = run_cli("dev", dev, "--from", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "PYTHONPATH=" in r.stdout
    assert (dev / ".gitignore").read_text() == "*\n!*/\n!*.py\n!.gitignore\n"
    log = git("log", "--format=%s", cwd=dev).stdout.splitlines()
    assert log == ["Test patch two", "Test patch one",
                   f"PyTorch v{RELEASE} (python sources of the torch=={RELEASE} wheel)"]
    for rel in TEST_FILES:
        stock = git("show", f"v{RELEASE}:{rel}", cwd=dev).stdout
        assert stock == (target / ".torch-patch" / "orig" / rel).read_text()
        assert (dev / rel).read_bytes() == (target / rel).read_bytes()
    assert git("rev-parse", f"v{RELEASE}", cwd=dev).stdout == git("rev-parse", f"v{RELEASE}", cwd=dev_tree).stdout
    dev2 = tmp_path / "dev2"
    assert run_cli("dev", dev2, "--from", target, "--series", test_series).returncode == 0
    assert git("rev-parse", "HEAD", cwd=dev).stdout == git("rev-parse", "HEAD", cwd=dev2).stdout
    r = run_cli("dev", dev2, "--from", target, "--series", test_series)
    assert r.returncode == 5 and "not empty" in r.stderr


def test_dev_create_refuses_non_stock_source(tmp_path, target, empty_series):
    f = target / TEST_FILES[1]
    f.write_text(f.read_text() + "# not stock\n")
    r = run_cli("dev", tmp_path / "dev", "--from", target, "--series", empty_series)
    assert r.returncode == 5 and f"not stock torch {RELEASE}" in r.stderr and TEST_FILES[1] in r.stderr
    assert not (tmp_path / "dev").exists()


def _fake_repo(path: Path) -> Path:
    (path / "torch_patch").mkdir(parents=True)
    (path / "setup.py").write_text("")
    (path / "test" / "torch_patch").mkdir(parents=True)
    (path / "test" / "torch_patch" / "test_tool.py").write_text("raise AssertionError('tool test')\n")
    (path / "test" / "test_fake_family.py").write_text("def test_ok():\n    assert True\n")
    (path / "test" / "data" ).mkdir()
    (path / "test" / "data" / "expected.txt").write_text("data\n")
    (path / "test" / "__pycache__").mkdir()
    (path / "test" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (path / "benchmarks" / "pytree").mkdir(parents=True)
    (path / "benchmarks" / "pytree" / "bench_family.py").write_text("print('bench')\n")
    return path


def test_export_git_am_and_byte_stable(tmp_path, template, test_series):
    repo = _fake_repo(tmp_path / "repo")
    out = tmp_path / "out"
    r = run_cli("export", out, "--repo", repo, "--from", template, "--series", test_series)
    assert r.returncode == 0, r.stderr
    names = series_names(out)
    assert len(names) == 4 and names[:2] == series_names(test_series)
    for lib in names[:2]:  # library patches are the very same bytes as the series
        assert (out / lib).read_bytes() == (test_series / lib).read_bytes()
    tests_patch = (out / names[2]).read_text()
    assert "Subject: [PATCH] [pytree] Add the pytree tests that no commit's Test Plan" in tests_patch
    assert "Test Plan:" in tests_patch and "python test/test_fake_family.py" in tests_patch
    assert "test/data/expected.txt" in tests_patch
    assert "test/torch_patch" not in tests_patch and "__pycache__" not in tests_patch
    assert "python benchmarks/pytree/bench_family.py" in (out / names[3]).read_text()

    co = standin_checkout(tmp_path / "pytorch", template)
    am = git("am", "--keep-non-patch", *[str(out / n) for n in names], cwd=co, check=False)
    assert am.returncode == 0, am.stderr
    subjects = git("log", "--format=%s", "-2", cwd=co).stdout.splitlines()
    assert all(subject.startswith("[pytree] ") for subject in subjects), subjects
    assert (co / "test" / "test_fake_family.py").exists()
    assert (co / "benchmarks" / "pytree" / "bench_family.py").exists()
    assert not (co / "test" / "torch_patch").exists()
    assert "# torch-patch test: second patch" in (co / TEST_FILES[1]).read_text()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(co / "test" / "test_fake_family.py")], capture_output=True, text=True, cwd=co)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr

    out2 = tmp_path / "out2"
    assert run_cli("export", out2, "--repo", repo, "--from", template, "--series", test_series).returncode == 0
    assert tree_digest(out2) == tree_digest(out)

    r = run_cli("export", out, "--repo", repo, "--from", template, "--series", test_series)
    assert r.returncode == 5 and "not empty" in r.stderr
    r = run_cli("export", out, "--force", "--repo", repo, "--from", template, "--series", test_series)
    assert r.returncode == 0 and tree_digest(out) == tree_digest(out2)


def test_export_puts_tests_in_the_commit_whose_test_plan_names_them(tmp_path, template, test_series):
    # The second patch's Test Plan names a test (which imports a helper module next to it) and a
    # benchmark: they go into that commit, the benchmark with its whole directory; what no Test
    # Plan names follows in the trailing tests commit; no benchmarks commit is left.
    repo = _fake_repo(tmp_path / "repo")
    (repo / "test" / "fake_helpers.py").write_text("HELPER = 1\n")
    (repo / "test" / "test_fake_family.py").write_text(
        "from fake_helpers import HELPER\n\n\ndef test_ok():\n    assert HELPER == 1\n")
    (repo / "benchmarks" / "pytree" / "_shared.py").write_text("X = 1\n")
    series = tmp_path / "series"
    shutil.copytree(test_series, series)
    second = series_names(series)[1]
    text = (series / second).read_text()
    plan = ("\n\nTest Plan:\npython test/test_fake_family.py\n"
            "python benchmarks/pytree/bench_family.py --quick\npython test/test_pytree.py\n")
    assert "Touches two files and adds one." in text
    (series / second).write_text(text.replace("Touches two files and adds one.",
                                              "Touches two files and adds one." + plan, 1))
    out = tmp_path / "out"
    r = run_cli("export", out, "--repo", repo, "--from", template, "--series", series)
    assert r.returncode == 0, r.stderr
    names = series_names(out)
    assert len(names) == 3, names  # two library commits and the tests no Test Plan names

    def added(name: str) -> list:
        return sorted(re.findall(r"^diff --git a/(\S+) ", (out / name).read_text(), re.M))

    assert [f for f in added(names[1]) if not f.startswith("torch/")] == [
        "benchmarks/pytree/_shared.py", "benchmarks/pytree/bench_family.py",
        "test/fake_helpers.py", "test/test_fake_family.py"]
    assert not [f for f in added(names[0]) if not f.startswith("torch/")]
    assert added(names[2]) == ["test/data/expected.txt"]
    co = standin_checkout(tmp_path / "pytorch", template)
    am = git("am", "--keep-non-patch", *[str(out / n) for n in names[:2]], cwd=co, check=False)
    assert am.returncode == 0, am.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(co / "test" / "test_fake_family.py")], capture_output=True, text=True, cwd=co)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    out2 = tmp_path / "out2"
    assert run_cli("export", out2, "--repo", repo, "--from", template, "--series", series).returncode == 0
    assert tree_digest(out2) == tree_digest(out)


def test_export_generic_cut_of_the_real_series(tmp_path, template):
    # `--cut generic`: the library patches up to the first HuggingFace-specific one, byte for
    # byte, with the tests their Test Plans name, and none of the HuggingFace tests; it applies.
    series = core.load_series(REAL_SERIES_DIR)
    full, generic = tmp_path / "full", tmp_path / "generic"
    assert run_cli("export", full, "--from", template).returncode == 0
    r = run_cli("export", generic, "--cut", "generic", "--from", template)
    assert r.returncode == 0, r.stderr
    assert "generic cut:" in r.stdout
    names = [n for n in series_names(generic) if n in series.names]  # the library patches
    hf = re.compile(r"\b(?:transformers|diffusers|HuggingFace)\b", re.I)

    def added_library_lines(patch: Path) -> str:
        diff = patch.read_text().split("\n---\n", 1)[1]
        files = re.split(r"^diff --git ", diff, flags=re.M)[1:]
        return "\n".join(line for f in files if f.startswith("a/torch/")
                         for line in f.splitlines() if line.startswith("+"))

    assert 0 < len(names) < len(series.patches)
    assert names == series_names(full)[: len(names)]
    for name in names:
        assert (generic / name).read_bytes() == (full / name).read_bytes()
        assert not hf.search(added_library_lines(generic / name)), name
    assert hf.search(added_library_lines(full / series_names(full)[len(names)]))
    text = "".join((generic / n).read_text() for n in names)
    assert "diff --git a/test/export/test_export_pytree_family.py" in text
    assert "diff --git a/test/export/test_export_hf_model_output.py" not in text
    assert "diff --git a/torch/utils/_pytree_hf_cache.py" not in text
    co = standin_checkout(tmp_path / "pytorch", template)
    am = git("am", "--keep-non-patch", *[str(generic / n) for n in names], cwd=co, check=False)
    assert am.returncode == 0, am.stderr
    r = run_cli("export", tmp_path / "bad", "--cut", "nope", "--from", template)
    assert r.returncode == 5 and "invalid choice" in r.stderr


# ------------------------------------------------------------------------------------------
# the real series and the CLI surface


def test_real_series_apply_revert(target):
    try:
        series = core.load_series(REAL_SERIES_DIR)
    except core.TorchPatchError:
        series = None
    if series is None or not series.patches:
        pytest.skip("torch_patch/patches/series is empty or missing")
    before = tree_digest(target)
    r = run_cli("apply", target)
    assert r.returncode == 0, r.stderr
    for rel in series.files:
        assert core.sha256_file(target / rel) != before.get(rel)
    r = run_cli("status", target)
    assert (r.returncode, r.stdout.strip()) == (0, f"applied ({', '.join(series.names)})")
    assert run_cli("revert", target).returncode == 0
    assert tree_digest(target) == before


@pytest.mark.parametrize("verb", [None, "apply", "revert", "status", "stock-file", "export", "dev"])
def test_help(verb):
    r = run_cli(*([verb] if verb else []), "--help")
    assert r.returncode == 0 and "usage: torch-patch" in r.stdout
    assert "exit codes" in r.stdout


# ------------------------------------------------------------------------------------------
# release lines: one series per line, picked by the target's torch version


def test_release_line_of_a_version():
    assert core.release_line("2.14.1+cu130") == "2.14"
    assert core.release_line("2.14.0") == "2.14"  # another patch release of a supported line
    assert core.release_line("2.13.0a0") == "2.13"  # version.txt of an unbuilt checkout
    assert core.release_line("2.15.0+cpu") == "2.15"
    for version in ("2.12.1", "2.16.0", "2.1.0", "3.13.0", "", None, "nightly"):
        assert core.release_line(version) is None, version
    assert core.series_dir_for("2.14") == core.PATCHES_DIR / "2.14"
    assert core.series_dir_for(None) == core.PATCHES_DIR / "2.13"


@pytest.mark.parametrize("version,release", [("2.14.1+cu130", "2.14.1"), ("2.13.0a0", "2.13.0"),
                                             ("2.15.0", "2.15.0"), ("2.16.0", "2.13.0")])
def test_target_release_for_messages(tmp_path, version, release):
    # what messages name (`pip install torch==X`, `git reset --hard vX`): x.y.z of a supported
    # target, the default line's release otherwise
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(f"__version__ = '{version}'\n")
    t = core.Target(tmp_path, "checkout", tmp_path / ".torch-patch")
    assert core.target_release(t) == release
    assert core.release_of(version) == version.split("+")[0].replace("a0", "")


def test_shipped_series_of_every_line():
    # Every supported line ships a series of the same concerns in the same order; an entry of
    # another line's directory names a file of an earlier line, never an entry that is shared.
    subjects = {}
    for i, line in enumerate(core.RELEASE_LINES):
        series = core.load_series(line=line)
        assert series.dir == core.PATCHES_DIR / line and len(series.patches) == 9, line
        for entry, patch in zip(series_names(series.dir), series.patches):
            if "/" in entry:
                other = entry.split("/")[1]
                assert entry == f"../{other}/{patch.name}", entry
                assert other in list(core.RELEASE_LINES)[:i], entry
                assert patch.path.resolve().parent == core.PATCHES_DIR / other
                assert patch.name in series_names(core.PATCHES_DIR / other)
            else:
                assert patch.path.parent == series.dir and patch.path.is_file()
        subjects[line] = [re.search(r"^Subject: (.*)$", p.text, re.M).group(1) for p in series.patches]
    names = [[p.split("]", 1)[-1] for p in s] for s in subjects.values()]
    for line, got in zip(core.RELEASE_LINES, names):
        # patch 4 fixes 2.14's and 2.15's own member_descriptor.__set__ instead of adding it
        assert [n for k, n in enumerate(got) if k != 3] == [n for k, n in enumerate(names[0]) if k != 3], line
    assert sorted(p.name for p in (core.PATCHES_DIR).iterdir()) == sorted(core.RELEASE_LINES)


def test_target_of_another_line_gets_that_lines_series(target):
    # The version picks the series: a target that says it is another release is checked against
    # that line's series, which does not fit these files; the refusal names the patch and the
    # release, and nothing changes.
    other = "2.15.0" if core.release_line(RELEASE) != "2.15" else "2.14.1"
    vp = target / "torch" / "version.py"
    vp.write_text(vp.read_text().replace(f"'{RELEASE}", f"'{other}"))
    before = tree_digest(target)
    r = run_cli("apply", target)
    names = core.load_series(line=core.release_line(other)).names
    assert r.returncode == 5, r.stdout + r.stderr
    failing = re.search(r"error: patch (\S+) does not apply", r.stderr)
    assert failing and failing.group(1) in names and f"does not fit torch {other}" in r.stderr, r.stderr
    assert tree_digest(target) == before
    data = json.loads(run_cli("status", target, "--json").stdout)
    assert (data["release_line"], data["expected_torch_version"]) == (
        core.release_line(other), core.RELEASE_LINES[core.release_line(other)])
    assert data["supported_releases"] == ["2.13.0", "2.14.1", "2.15.0"]


def test_same_change_ignores_blob_hashes_and_line_numbers():
    a = (b"Subject: [PATCH] x\n\ndiff --git a/f.py b/f.py\nindex 1111111..2222222 100644\n--- a/f.py\n"
         b"+++ b/f.py\n@@ -10,3 +10,4 @@ def f():\n ctx\n+new\n ctx\n")
    b = a.replace(b"1111111..2222222", b"3333333..4444444").replace(b"-10,3 +10,4 @@ def f", b"-52,3 +52,4 @@ def g")
    assert torch_patch.dev.same_change(a, b)
    assert not torch_patch.dev.same_change(a, a.replace(b"+new", b"+other"))
    assert not torch_patch.dev.same_change(a, a.replace(b" ctx\n+new", b" context\n+new"))


def test_dev_export_shares_a_patch_of_an_earlier_line(tmp_path, dev_tree):
    # Exported into patches/2.14/ next to a 2.13/ that holds the same changes, the series names
    # 2.13's files and writes none; a changed patch is written; the bytes are stable.
    root = tmp_path / "patches"
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.13", log=lambda s: None)
    names = series_names(root / "2.13")
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.14", log=lambda s: None)
    assert series_names(root / "2.14") == [f"../2.13/{n}" for n in names]
    assert sorted(p.name for p in (root / "2.14").iterdir()) == ["series"]
    shared = core.load_series(root / "2.14")
    assert (shared.names, shared.id) == (names, core.load_series(root / "2.13").id)
    # the 2.13 file of the first patch changes: 2.14 gets its own copy of that one again
    first = root / "2.13" / names[0]
    first.write_text(first.read_text().replace("Adds a comment", "Adds one comment"))
    before = tree_digest(root / "2.14")
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.14", log=lambda s: None)
    assert series_names(root / "2.14") == [names[0], f"../2.13/{names[1]}"]
    assert "Adds a comment" in (root / "2.14" / names[0]).read_text()
    again = tree_digest(root / "2.14")
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.14", log=lambda s: None)
    assert tree_digest(root / "2.14") == again != before
