"""torch-patch tells the truth (issue #15): the state comes from the files, not from records.

Reinstalled torch, `git checkout .` / `git stash -u`, a series committed with `git am` or
applied with plain `git apply`, concurrent applies, `pip uninstall torch` after apply, Ctrl-C,
the CLI's small print, and the documented benchmark commands run as pasted.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tp_helpers import (NEW_FILE, RELEASE, REAL_SERIES_DIR, REPO, TEST_FILES, doc_commands, git, make_venv, run_cli, run_until,
                        simulate_pip_reinstall, standin_checkout, stock_torch_farm, tree_digest)

from torch_patch import core

REAL_SERIES = core.load_series(REAL_SERIES_DIR)


def names(series_dir: Path):
    return (series_dir / "series").read_text().split()


def no_state(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith(".torch-patch/")}


# ------------------------------------------------------------------------------------------
# 1. a reinstalled torch is not applied, and apply really applies again


@pytest.mark.parametrize("which", ["test series", "real series"])
def test_reinstall_then_apply_applies_again(target, template, test_series, which):
    series_args = ["--series", test_series] if which == "test series" else []
    stock = tree_digest(target)
    r = run_cli("apply", target, *series_args)
    assert r.returncode == 0, r.stderr
    patched = tree_digest(target)
    assert no_state(patched) != stock

    simulate_pip_reinstall(target, template)
    created = [rel for rel in no_state(patched) if rel not in stock]  # a reinstall leaves them behind
    r = run_cli("status", target, *series_args)
    assert r.returncode == 1, r.stdout + r.stderr
    if created:
        assert r.stdout.startswith("not applied — left over from an earlier apply: ")
        assert all(rel in r.stdout for rel in created)
    assert r.stdout.startswith("not applied") and "stale" in r.stdout
    assert "modified after apply" not in r.stdout

    r = run_cli("apply", target, *series_args)
    assert r.returncode == 0, r.stderr
    assert "already applied" not in r.stdout and "nothing to do" not in r.stdout
    assert ("left over from an earlier apply" in r.stdout) == bool(created)
    assert no_state(tree_digest(target)) == no_state(patched)  # patched again, the same bytes
    r = run_cli("status", target, *series_args)
    assert r.returncode == 0 and r.stdout.startswith("applied ("), r.stdout
    r = run_cli("revert", target)
    assert r.returncode == 0, r.stderr
    assert tree_digest(target) == stock  # byte-identical, leftovers and records gone


def test_reinstall_then_revert_removes_leftovers(target, template, test_series):
    stock = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    simulate_pip_reinstall(target, template)
    assert (target / NEW_FILE).exists() and (target / ".torch-patch").exists()
    r = run_cli("revert", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert tree_digest(target) == stock
    assert not (target / ".torch-patch").exists()
    assert (run_cli("status", target).returncode, run_cli("status", target).stdout) == (1, "not applied\n")


def test_stale_records_do_not_fake_an_applied_state(target, test_series):
    """The records say 'applied', the files say 'stock' (bytes identical to the originals)."""
    stock = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    for rel in TEST_FILES:
        shutil.copyfile(target / ".torch-patch" / "orig" / rel, target / rel)
    (target / NEW_FILE).unlink()
    r = run_cli("status", target, "--series", test_series, "--json")
    data = json.loads(r.stdout)
    assert (r.returncode, data["state"], data["modified_files"]) == (1, "not applied", [])
    assert "stale" in data["message"]
    r = run_cli("revert", target)
    assert r.returncode == 0 and "nothing to revert" in r.stdout and "stale" in r.stdout
    assert tree_digest(target) == stock


def test_partly_applied_is_reported_and_completed(target, test_series):
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    applied = tree_digest(target)
    shutil.copyfile(target / ".torch-patch" / "orig" / TEST_FILES[1], target / TEST_FILES[1])
    r = run_cli("status", target, "--series", test_series)
    assert r.returncode == 2 and r.stdout.startswith("partly applied (") and TEST_FILES[1] in r.stdout
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert tree_digest(target) == applied


# ------------------------------------------------------------------------------------------
# checkouts: git checkout . / git stash -u, git am, plain git apply


@pytest.mark.parametrize("undo", [["checkout", "."], ["stash", "-u"]])
def test_checkout_undone_with_git_is_not_applied(tmp_path, template, test_series, undo):
    co = standin_checkout(tmp_path / "pytorch", template)
    assert run_cli("apply", co, "--series", test_series).returncode == 0
    assert git(*undo, cwd=co).returncode == 0
    r = run_cli("status", co, "--series", test_series)
    assert r.returncode == 1 and r.stdout.startswith("not applied"), r.stdout
    if undo[0] == "checkout":  # the file the series adds is untracked: git checkout keeps it
        assert NEW_FILE in r.stdout
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0 and "already applied" not in r.stdout, r.stdout + r.stderr
    assert "# torch-patch test: second patch" in (co / TEST_FILES[1]).read_text()
    assert run_cli("status", co, "--series", test_series).returncode == 0
    assert run_cli("revert", co).returncode == 0
    assert git("status", "--porcelain", cwd=co).stdout == ""
    assert not (co / ".git" / "torch-patch").exists()


def test_checkout_with_series_committed_status_agrees_with_apply(tmp_path, template, test_series):
    co = standin_checkout(tmp_path / "pytorch", template)
    am = git("am", *[str(test_series / n) for n in names(test_series)], cwd=co, check=False)
    assert am.returncode == 0, am.stderr
    r = run_cli("status", co, "--series", test_series, "--json")
    data = json.loads(r.stdout)
    assert (r.returncode, data["state"], data["patches"]) == (0, "applied", names(test_series))
    assert data["applied_by"] == "other" and "committed" in data["message"]
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0 and "already contained" in r.stdout
    head = git("rev-parse", "HEAD", cwd=co).stdout
    r = run_cli("revert", co, "--series", test_series)
    assert r.returncode == 5 and "committed" in r.stderr and "git revert" in r.stderr
    assert git("status", "--porcelain", cwd=co).stdout == "" and git("rev-parse", "HEAD", cwd=co).stdout == head
    assert not (co / ".git" / "torch-patch").exists()


def test_checkout_with_plain_git_apply(tmp_path, template, test_series):
    co = standin_checkout(tmp_path / "pytorch", template)
    ga = git("apply", *[str(test_series / n) for n in names(test_series)], cwd=co, check=False)
    assert ga.returncode == 0, ga.stderr
    r = run_cli("status", co, "--series", test_series)
    assert r.returncode == 0 and r.stdout.startswith(f"applied ({', '.join(names(test_series))})"), r.stdout
    assert "git apply" in r.stdout
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0 and "already contained" in r.stdout
    r = run_cli("stock-file", TEST_FILES[0], co, "--series", test_series)
    assert r.returncode == 5 and "no stock copy" in r.stderr
    r = run_cli("revert", co, "--series", test_series)  # git apply -R, in a staging copy
    assert r.returncode == 0, r.stderr
    assert git("status", "--porcelain", "--untracked-files=all", cwd=co).stdout == ""
    assert run_cli("status", co, "--series", test_series).stdout == "not applied\n"


# ------------------------------------------------------------------------------------------
# 2. concurrent applies


def test_concurrent_applies(tmp_path, template, test_series):
    """Two `apply` in two processes at once, 20 rounds (with a `status` alongside): the target
    always ends up applied, one process applies, the other waits and finds it applied, and
    `status` never sees a half-done switch."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(core.FAULT_ENV, None)
    cmd = [sys.executable, "-m", "torch_patch"]
    for i in range(20):
        t = tmp_path / f"round{i}"
        shutil.copytree(template, t)
        procs = [subprocess.Popen([*cmd, "apply", str(t), "--series", str(test_series)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        st = subprocess.Popen([*cmd, "status", str(t), "--series", str(test_series)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=120) for p in procs]
        st_out, st_err = st.communicate(timeout=120)
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, f"round {i}: {out}{err}"
        assert sorted("applied 2 patches" in out for out, _ in outs) == [False, True], outs
        assert any("already applied" in out for out, _ in outs), outs
        assert st.returncode in (0, 1) and st_out.startswith(("applied (", "not applied")), st_out + st_err
        r = run_cli("status", t, "--series", test_series)
        assert r.returncode == 0, f"round {i}: {r.stdout}"
        assert sorted(p.name for p in (t / ".torch-patch").iterdir()) == ["orig", "state.json"]


def test_waiting_apply_reports_that_it_waits(target, test_series):
    """A second apply waits for the lock (and says so) instead of failing or breaking the first."""
    import fcntl
    fd = os.open(target, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = run_cli("apply", target, "--series", test_series, env_extra={core.LOCK_TIMEOUT_ENV: "0.5"})
    finally:
        os.close(fd)
    assert r.returncode == 5
    assert "waiting for another torch-patch" in r.stdout
    assert "another torch-patch has been working on" in r.stderr and core.LOCK_TIMEOUT_ENV in r.stderr
    assert not (target / ".torch-patch").exists()


# ------------------------------------------------------------------------------------------
# 4. pip uninstall torch after apply (a real pip, on the stand-in torch in a venv)


def test_pip_uninstall_after_apply_leaves_nothing_after_revert(tmp_path, template):
    venv = tmp_path / "venv"
    site = make_venv(venv)
    shutil.copytree(template, site, dirs_exist_ok=True)  # pip uninstalls what its RECORD lists
    py = venv / "bin" / "python"
    r = run_cli("apply", site)
    assert r.returncode == 0, r.stderr
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "uninstall", "-y", "torch"],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    probe = "import torch; print(torch.__file__, list(torch.__path__))"
    ns = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    assert ns.returncode == 0 and ns.stdout.startswith("None "), ns  # an empty namespace package

    created = [rel for rel in REAL_SERIES.files if REAL_SERIES.creates(rel)]
    env = {"PYTHONPATH": str(REPO)}
    for args in (["status"], ["status", site]):  # the default target (the venv's python) and TARGET
        r = run_cli(*args, python=py, env_extra=env)
        assert r.returncode == 3, r.stdout + r.stderr
        assert r.stdout.startswith(f"not installed: torch is not installed in {site}")
        assert all(rel in r.stdout for rel in created) and ".torch-patch/" in r.stdout
        assert "torch-patch revert" in r.stdout
    r = run_cli("status", site, "--json")
    assert json.loads(r.stdout)["state"] == "not installed"
    r = run_cli("apply", site)
    assert r.returncode == 3 and "torch is not installed" in r.stderr

    r = run_cli("revert", python=py, env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "removed what torch-patch had left" in r.stdout
    assert not (site / "torch").exists() and not (site / ".torch-patch").exists()
    gone = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True)
    assert gone.returncode == 1 and "ModuleNotFoundError" in gone.stderr


def test_uninstall_debris_keeps_files_torch_patch_did_not_write(target, template, test_series):
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    for rel in core.load_record(target):
        (target / rel).unlink(missing_ok=True)
    shutil.rmtree(core.find_dist_info(target))
    mine = target / "torch" / "my_notes.txt"
    mine.write_text("mine\n")
    r = run_cli("revert", target, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert "left alone" in r.stdout and "torch/my_notes.txt" in r.stdout
    assert not (target / NEW_FILE).exists() and not (target / ".torch-patch").exists()
    assert mine.read_text() == "mine\n"


# ------------------------------------------------------------------------------------------
# 5. stock-file and status --json stock_files


def test_stock_file_verb_and_status_json(target, template, test_series):
    rel = TEST_FILES[0]
    r = run_cli("stock-file", rel, target)
    assert (r.returncode, r.stdout.strip()) == (0, str(target / rel))
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    r = run_cli("stock-file", rel, target)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.is_absolute() and path.read_bytes() == (template / rel).read_bytes()
    assert run_cli("stock-file", target / rel, target).stdout == r.stdout  # absolute path form
    data = json.loads(run_cli("status", target, "--series", test_series, "--json").stdout)
    assert data["stock_files"][rel] == str(path) and NEW_FILE not in data["stock_files"]
    assert Path(data["stock_files"][TEST_FILES[1]]).read_bytes() == (template / TEST_FILES[1]).read_bytes()
    r = run_cli("stock-file", NEW_FILE, target)
    assert r.returncode == 5 and f"has no {NEW_FILE}" in r.stderr
    r = run_cli("stock-file", "utils/_pytree.py", target)
    assert r.returncode == 5 and "relative to the" in r.stderr
    (target / "torch" / "version.py").write_text(f"__version__ = '{RELEASE}+cpu'\n# edited\n")
    r = run_cli("stock-file", "torch/version.py", target)
    assert r.returncode == 5 and "not the stock torch" in r.stderr and "RECORD" in r.stderr


# ------------------------------------------------------------------------------------------
# 7. Ctrl-C, --help of the demo, small print


def test_ctrl_c_while_staging_changes_nothing(target, test_series):
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, env_extra={core.SIGINT_ENV: "0"})
    assert r.returncode == 130
    assert "stopped by Ctrl-C" in r.stderr and "is now: not applied" in r.stderr and "torch-patch status" in r.stderr
    assert tree_digest(target) == before


@pytest.mark.parametrize("after_files", [1, 3])
def test_ctrl_c_during_the_switch_is_held_until_it_is_done(target, test_series, after_files):
    r = run_cli("apply", target, "--series", test_series, env_extra={core.SIGINT_ENV: str(after_files)})
    assert r.returncode == 130, r.stdout + r.stderr
    assert f"is now: applied ({', '.join(names(test_series))})" in r.stderr
    assert "interrupted (" not in r.stderr
    assert run_cli("status", target, "--series", test_series).returncode == 0
    assert not (target / ".torch-patch" / "journal.json").exists()


def test_exit_code_130_is_documented():
    r = run_cli("--help")
    assert "130" in r.stdout and "Ctrl-C" in r.stdout


def test_demo_help_does_not_run_the_demo():
    r = subprocess.run([sys.executable, "-m", "torch_patch.demo", "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m torch_patch.demo")
    assert "torch-patch apply" in r.stdout and "export" in r.stdout


def test_revert_outside_a_venv_says_revert(target):
    r = run_cli("revert", python=getattr(sys, "_base_executable", sys.executable),
                env_extra={"PYTHONPATH": f"{REPO}{os.pathsep}{target}"})
    assert r.returncode == 5
    assert "refusing to revert" in r.stderr and "refusing to patch" not in r.stderr and "--allow-system" in r.stderr


def test_venv_directory_as_target_points_at_site_packages(tmp_path, template, test_series):
    venv = tmp_path / "venv"
    site = make_venv(venv)
    shutil.copytree(template, site, dirs_exist_ok=True)
    for verb in ("apply", "status", "revert"):
        r = run_cli(verb, venv)
        assert r.returncode == 5, r.stderr
        assert "is a virtual environment" in r.stderr and str(site) in r.stderr
    assert not (site / ".torch-patch").exists()


def test_force_without_reapply_is_refused(target, test_series):
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, "--force")
    assert r.returncode == 5 and "--force only takes effect together with --reapply" in r.stderr
    assert tree_digest(target) == before


def test_reapply_force_discards_edits_and_applies(target, test_series):
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    applied = tree_digest(target)
    f = target / TEST_FILES[0]
    f.write_text(f.read_text().replace("# torch-patch test: first patch", "# my edit", 1))
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 2 and "edited after apply" in r.stderr and "--reapply --force" in r.stderr
    r = run_cli("apply", target, "--series", test_series, "--reapply", "--force")
    assert r.returncode == 0, r.stderr
    assert no_state(tree_digest(target)) == no_state(applied)


# ------------------------------------------------------------------------------------------
# 5 and 6. the documented benchmark commands, pasted into a shell


@pytest.fixture(scope="module")
def docs_sandbox(tmp_path_factory):
    """A directory laid out like the repo root after README command 1: `.venv` (a venv whose
    stock torch farm the real series was applied to with `.venv/bin/torch-patch apply`, and
    which sees this venv's other packages and this checkout's torch_patch), `.venv-stock` (the
    same, left stock), and `benchmarks/` (this checkout's)."""
    root = tmp_path_factory.mktemp("docs") / "repo"
    root.mkdir()
    purelib = sysconfig.get_paths()["purelib"]
    for name in (".venv", ".venv-stock"):
        site = stock_torch_farm(make_venv(root / name))
        (site / "zz_sandbox.pth").write_text(f"{REPO}\nimport site; site.addsitedir({purelib!r})\n")
        script = root / name / "bin" / "torch-patch"
        script.write_text(f"#!{root / name / 'bin' / 'python'}\nimport sys\nfrom torch_patch.cli import main\n"
                          f"sys.exit(main())\n")
        script.chmod(0o755)
    (root / "benchmarks").symlink_to(REPO / "benchmarks")
    r = subprocess.run([".venv/bin/torch-patch", "apply"], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def _sandbox_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", core.FAULT_ENV)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _is_setup(cmd: str) -> bool:
    """Install steps of a block: the sandbox fixture has done them (no network in tests)."""
    return "pip install" in cmd or cmd.startswith("python3 -m venv")


def _stock_sha(rel: str) -> str:
    src = core.resolve_target(core.installed_torch_root(), require_venv=False)
    return core.load_record(src.root, [rel])[rel]


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/pytree/README.md"])
def test_documented_pytree_bench_command_finds_the_stock_file(docs_sandbox, doc):
    """Each documented pytree_bench command that takes its baseline from torch-patch runs as
    pasted: the real script starts, loads the stock file that `torch-patch stock-file` printed
    (sha256 of the wheel's RECORD entry) and compares it with the patched one; it is stopped
    once its header is printed (the timing takes minutes)."""
    cmds = [c for c in doc_commands(REPO / doc, "torch-patch stock-file")
            if not _is_setup(c) and "/pytree_bench.py" in c]
    assert cmds, doc
    for cmd in cmds:
        code, out = run_until(cmd, docs_sandbox, "- patched_source_identical_to_baseline:", env=_sandbox_env())
        assert code is None, f"{cmd}\nexited {code}:\n{out}"
        assert f"- baseline_sha256: {_stock_sha('torch/utils/_pytree.py')}" in out, out
        assert "- patched_source_identical_to_baseline: False" in out
        assert "- patched_has_register_pytree_family: True" in out
        assert str(docs_sandbox / ".venv") in out and ".venv-stock" not in out


def test_documented_cxx_pytree_bench_command_finds_the_stock_file(docs_sandbox):
    """README's cxx_pytree_bench command runs as pasted and compares the stock
    _cxx_pytree.py that `torch-patch stock-file` printed with the patched one; it is stopped
    once its header is printed."""
    cmds = [c for c in doc_commands(REPO / "README.md", "cxx_pytree_bench.py") if not _is_setup(c)]
    assert len(cmds) == 1 and "torch-patch stock-file torch/utils/_cxx_pytree.py" in cmds[0], cmds
    code, out = run_until(cmds[0], docs_sandbox, f"- torch {RELEASE}", env=_sandbox_env())
    assert code is None, f"{cmds[0]}\nexited {code}:\n{out}"
    header = next(line for line in out.splitlines() if line.startswith("# _cxx_pytree: stock ("))
    stock_path = Path(header.split("stock (", 1)[1].split(") vs patched", 1)[0])
    sha = hashlib.sha256(stock_path.read_bytes()).hexdigest()
    assert sha == _stock_sha("torch/utils/_cxx_pytree.py"), header
    assert str(docs_sandbox / ".venv") in header


def test_documented_compile_time_command_compares_two_builds(docs_sandbox):
    cmds = [c for c in doc_commands(REPO / "benchmarks/pytree/README.md", "compile_time_bench.py")
            if not _is_setup(c)]
    assert len(cmds) == 1 and ".venv-stock" in cmds[0], cmds
    code, out = run_until(cmds[0], docs_sandbox, "round 1/", env=_sandbox_env())
    assert code is None, f"{cmds[0]}\nexited {code}:\n{out}"
    assert "register_pytree_family: no" in out and "register_pytree_family: yes" in out
    assert "error" not in out and "warning" not in out


def test_compile_time_bench_refuses_the_same_build_twice(docs_sandbox):
    """The old documented command after README command 1: both --impl are the patched venv."""
    cmd = [sys.executable, "benchmarks/pytree/compile_time_bench.py", "--rounds", "8",
           "--impl", "stock=.venv/bin/python", "--impl", "patched=.venv/bin/python"]
    r = subprocess.run(cmd, cwd=docs_sandbox, capture_output=True, text=True, env=_sandbox_env(),
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--impl stock and --impl patched run identical" in r.stderr and "--allow-same" in r.stderr
    assert "round 1/" not in r.stderr and r.stdout == ""


def test_import_torch_uses_the_bytecode_apply_wrote(docs_sandbox):
    """After `.venv/bin/torch-patch apply` (the fixture), a process that may not write bytecode
    imports the patched modules from the .pyc files apply wrote (`-v`: "<pyc> matches <py>"),
    instead of compiling them on every import."""
    site = next((docs_sandbox / ".venv").glob("lib/python3*/site-packages"))
    env = dict(_sandbox_env(), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([".venv/bin/python", "-v", "-c", "import torch.utils._pytree"], cwd=docs_sandbox,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rel in ("torch/utils/_pytree.py", "torch/utils/_pytree_hf_cache.py"):
        if rel in REAL_SERIES.files:
            src = site / rel
            pyc = Path(importlib.util.cache_from_source(str(src)))
            assert not pyc.is_symlink() and f"{pyc} matches {src}" in r.stderr, rel


def test_documented_status_and_revert_commands(docs_sandbox):
    """README "Revert and status", pasted (last: it reverts the sandbox)."""
    cmds = doc_commands(REPO / "README.md", ".venv/bin/torch-patch revert")
    assert [c.split("#")[0].split() for c in cmds] == [[".venv/bin/torch-patch", "status"],
                                                       [".venv/bin/torch-patch", "revert"]], cmds
    r = subprocess.run(["bash", "-c", cmds[0]], cwd=docs_sandbox, capture_output=True, text=True, env=_sandbox_env())
    assert r.returncode == 0 and r.stdout.startswith(f"applied ({', '.join(REAL_SERIES.names)})"), r.stdout
    r = subprocess.run(["bash", "-c", cmds[1]], cwd=docs_sandbox, capture_output=True, text=True, env=_sandbox_env())
    assert r.returncode == 0, r.stderr
    site = next((docs_sandbox / ".venv").glob("lib/python3*/site-packages"))
    record = core.load_record(site, REAL_SERIES.files)
    for rel in REAL_SERIES.files:
        assert core.sha256_file(site / rel) == record.get(rel), rel  # None: stock has no such file
    assert not (site / ".torch-patch").exists()
    r = subprocess.run([".venv/bin/torch-patch", "apply"], cwd=docs_sandbox, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr  # as the fixture had it, for any test after this one
