"""apply, revert and status on stand-in targets: the state comes from the files, and every interruption
(an OSError at any file, a kill) is finished by the next apply or revert.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tp_helpers import (NEW_FILE, RELEASE, REPO, RUNNING, TEST_FILES, git, run_cli, series_names, standin_checkout,
                        tree_digest, without_state)

import torch_patch


def head(target: Path, series: Path, n: int = 2, label: str = "") -> str:
    """What every status line says after the state."""
    return f"{n} patch{'es' * (n != 1)} ({label or f'series {series}'}) on torch {RUNNING.version} at {target}"


def test_round_trip(target, test_series):
    stock = tree_digest(target)
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (1, f"not applied: {head(target, test_series)}\n")
    r = run_cli("apply", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"applied: {head(target, test_series)}\n"), r.stderr
    assert "# torch-patch test: first patch" in (target / TEST_FILES[0]).read_text()
    assert "# torch-patch test: near tree_flatten" in (target / TEST_FILES[0]).read_text()
    assert "# torch-patch test: second patch" in (target / TEST_FILES[1]).read_text()
    assert (target / NEW_FILE).read_text() == "PROBE = 'patched'\n"
    saved = target / ".torch-patch" / "saved"  # the stock files and the series, nothing else
    assert sorted(tree_digest(saved)) == sorted([*(f"orig/{rel}" for rel in TEST_FILES), "patches/series",
                                                 *(f"patches/{name}" for name in series_names(test_series))])
    assert {rel: tree_digest(saved)[f"orig/{rel}"] for rel in TEST_FILES} == {rel: stock[rel] for rel in TEST_FILES}
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"applied: {head(target, test_series)}\n")
    r = run_cli("apply", target, "--series", test_series)
    assert r.stdout == f"already applied: {head(target, test_series)}\nNothing to do.\n"
    r = run_cli("revert", target, "--series", test_series)
    assert r.returncode == 0 and r.stdout.startswith("reverted: 2 patches"), r.stderr
    assert tree_digest(target) == stock and not (target / ".torch-patch").exists()
    r = run_cli("revert", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"not applied: {head(target, test_series)}\nNothing to revert.\n")


def test_python_api(target, test_series):
    stock, logs = tree_digest(target), []
    torch_patch.apply(target, series_dir=test_series, log=logs.append)
    st = torch_patch.status(target, series_dir=test_series)
    assert (st.code, st.state, st.patches) == (0, "applied", series_names(test_series))
    assert st.files == {TEST_FILES[1]: "patched", TEST_FILES[0]: "patched", NEW_FILE: "patched"}
    assert st.stock_files == {rel: str(target / ".torch-patch" / "saved" / "orig" / rel) for rel in TEST_FILES}
    torch_patch.revert(target, series_dir=test_series, log=logs.append)
    assert tree_digest(target) == stock
    assert torch_patch.status(target, series_dir=test_series).code == torch_patch.EXIT_NOT_APPLIED
    assert [line.split(":")[0] for line in logs] == ["applied", "reverted"]


def _inject(monkeypatch, target: Path, where: str, after: int, err: int) -> None:
    """An OSError ``err`` at the file switched after ``after`` others: when writing its copy next to it
    (``write``) or when renaming that copy over it (``replace``)."""
    done, real_replace, real_write = [], os.replace, Path.write_bytes

    def hit(path) -> None:
        if len(done) == after:
            raise OSError(err, os.strerror(err), str(path))
        done.append(path)

    def replace(src, dst, **kw):
        if where == "replace" and Path(dst).is_relative_to(target):
            hit(dst)
        return real_replace(src, dst, **kw)

    def write_bytes(self, data):
        if where == "write" and self.name.endswith(".torch-patch-tmp"):
            hit(self)
        return real_write(self, data)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)


def _ready(target: Path, series: Path, verb: str):
    """The stock and patched digests of the target, which is left stock before an apply, patched before a revert."""
    stock = tree_digest(target)
    torch_patch.apply(target, series_dir=series, log=lambda s: None)
    patched = without_state(tree_digest(target))
    if verb == "apply":
        torch_patch.revert(target, series_dir=series, log=lambda s: None)
    return stock, patched


def _finished_both_ways(tmp_path: Path, target: Path, series: Path, stock: dict, patched: dict) -> None:
    """The next apply of the interrupted target patches it; the next revert (of a copy) makes it stock."""
    shutil.copytree(target, tmp_path / "copy")
    assert run_cli("apply", target, "--series", series).returncode == 0
    assert without_state(tree_digest(target)) == patched
    assert run_cli("revert", tmp_path / "copy", "--series", series).returncode == 0
    assert tree_digest(tmp_path / "copy") == stock


CASES = [("apply", "replace", k, errno.EXDEV) for k in range(3)] + [("apply", "write", k, errno.ENOSPC)
                                                                    for k in range(3)]
CASES += [("revert", "replace", k, errno.EIO) for k in range(2)]


@pytest.mark.parametrize("verb,where,after,err", CASES)
def test_oserror_at_any_file_is_finished_by_apply_or_revert(monkeypatch, tmp_path, target, test_series, verb,
                                                            where, after, err):
    stock, patched = _ready(target, test_series, verb)
    with monkeypatch.context() as m:
        _inject(m, target, where, after, err)
        with pytest.raises(torch_patch.TorchPatchError) as e:
            getattr(torch_patch, verb)(target, series_dir=test_series, log=lambda s: None)
    switched = after + (verb == "revert")  # revert removes the added file first (no rename)
    state = "not applied" if verb == "apply" and switched == 0 else "partly applied"
    assert str(e.value).startswith(f"{verb} failed: {os.strerror(err)} (")
    assert f"then run `torch-patch {verb} {target}` again.\nThe target is now:\n{state}: " in str(e.value)
    assert ("Free some space there" in str(e.value)) == (err == errno.ENOSPC)
    st = torch_patch.status(target, series_dir=test_series)
    assert (st.state, st.code) == (state, 1 if state == "not applied" else 4)
    if state == "partly applied":
        assert f"{switched if verb == 'apply' else 3 - switched} of 3 files patched.\n`torch-patch apply {target}` " \
               f"finishes it.\n`torch-patch revert {target}` undoes it." in st.message
    assert not [p for p in target.rglob("*.torch-patch-tmp")]
    _finished_both_ways(tmp_path, target, test_series, stock, patched)


KILL = """
import os, sys
import torch_patch
real, done = os.replace, []
def replace(src, dst):
    real(src, dst)
    done.append(dst)
    if len(done) == int(sys.argv[2]):
        os._exit(9)
os.replace = replace
getattr(torch_patch, sys.argv[1])(sys.argv[3], series_dir=sys.argv[4])
"""


@pytest.mark.parametrize("verb,after", [("apply", 1), ("apply", 2), ("revert", 1)])
def test_kill_is_finished_by_apply_or_revert(tmp_path, target, test_series, verb, after):
    stock, patched = _ready(target, test_series, verb)
    r = subprocess.run([sys.executable, "-c", KILL, verb, str(after), str(target), str(test_series)],
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    r = run_cli("status", target, "--series", test_series)
    assert r.returncode == 4 and r.stdout.startswith("partly applied: "), r.stdout
    _finished_both_ways(tmp_path, target, test_series, stock, patched)


def test_disk_full_while_saving_changes_nothing(monkeypatch, target, test_series):
    stock, real_write = tree_digest(target), Path.write_bytes

    def write_bytes(self, data):
        if "saved.tmp" in self.parts:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    with pytest.raises(torch_patch.TorchPatchError, match="(?s)apply failed: No space left on device .*Free some "
                                                          "space there, then run .* again.\nThe target is now:\nnot applied"):
        torch_patch.apply(target, series_dir=test_series, log=lambda s: None)
    monkeypatch.undo()
    assert without_state(tree_digest(target)) == stock
    torch_patch.apply(target, series_dir=test_series, log=lambda s: None)
    torch_patch.revert(target, series_dir=test_series, log=lambda s: None)
    assert tree_digest(target) == stock


def test_reinstalled_torch_is_not_applied_and_apply_patches_again(target, template, test_series):
    stock = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    patched = without_state(tree_digest(target))
    shutil.copytree(template / "torch", target / "torch", dirs_exist_ok=True)  # pip rewrites the wheel's files
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (1, f"not applied: {head(target, test_series)}\nLeft over from an earlier "
                                           f"apply (torch reinstalled, or `git checkout`?):\n{NEW_FILE}\n`torch-patch "
                                           f"apply {target}` finishes it.\n`torch-patch revert {target}` undoes it.\n")
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    assert without_state(tree_digest(target)) == patched
    shutil.copytree(template / "torch", target / "torch", dirs_exist_ok=True)
    assert run_cli("revert", target, "--series", test_series).returncode == 0
    assert tree_digest(target) == stock


def test_saved_files_of_another_release_are_stale(target, test_series):
    """torch upgraded after apply (another patch release of the line): the saved stock files no longer match,
    the files are stock, and apply patches them (saving the new stock files)."""
    stock = {rel: (target / rel).read_bytes() for rel in TEST_FILES}
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    (target / NEW_FILE).unlink()
    for rel, data in stock.items():  # the new release: a line at the end of each file changed
        (target / rel).write_bytes(data + b"# changed in the next release\n")
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (1, f"not applied: {head(target, test_series)}\n")
    new_stock = without_state(tree_digest(target))
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    assert (target / TEST_FILES[1]).read_text().endswith("# changed in the next release\n")
    assert run_cli("revert", target, "--series", test_series).returncode == 0
    assert tree_digest(target) == new_stock


@pytest.mark.parametrize("verb", ["revert", "apply"])
def test_edited_file_is_kept_unless_force(target, test_series, verb):
    stock = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    patched = without_state(tree_digest(target))
    edited = target / TEST_FILES[1]
    edited.write_text(edited.read_text() + "# my edit\n")
    message = (f"modified: {head(target, test_series)}\nNeither stock nor patched: {TEST_FILES[1]}.\n"
               f"`torch-patch revert --force {target}` puts the stock files back.\n`torch-patch apply --force "
               f"{target}` the patched ones (the edits are lost).")
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (6, message + "\n")
    r = run_cli(verb, target, "--series", test_series)
    prefix = {"apply": "cannot apply", "revert": "refusing to revert"}[verb]
    assert (r.returncode, r.stderr) == (6, f"torch-patch: error: {prefix}:\n{message}\n")
    assert edited.read_text().endswith("# my edit\n")
    assert run_cli(verb, target, "--series", test_series, "--force").returncode == 0
    assert without_state(tree_digest(target)) == (stock if verb == "revert" else patched)


def test_series_of_an_earlier_torch_patch_is_replaced(target, test_series, first_patch_only):
    stock = tree_digest(target)
    assert run_cli("apply", target, "--series", first_patch_only).returncode == 0
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"applied: {head(target, test_series, 1, 'an earlier series')}\n"
                                           f"torch_patch now has another series for {RUNNING.line}: `torch-patch "
                                           f"apply {target}` replaces it.\n")
    r = run_cli("apply", target, "--series", test_series)
    earlier = head(target, test_series, 1, "an earlier series")
    assert r.returncode == 0 and r.stdout.splitlines() == [f"reverting {earlier} first",
                                                           f"applied: {head(target, test_series)}"], r.stderr
    assert run_cli("revert", target, "--series", test_series).returncode == 0
    assert tree_digest(target) == stock


@pytest.mark.parametrize("link", [TEST_FILES[1], ".torch-patch/saved.tmp"])
def test_symbolic_links_are_refused(tmp_path, target, test_series, link):
    """A file the series touches, or a name the state dir uses, that is a link: nothing is written through it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (target / link).parent.mkdir(exist_ok=True)
    if (target / link).exists():
        shutil.move(target / link, elsewhere / "file")
    (target / link).symlink_to(elsewhere / "file" if (elsewhere / "file").exists() else elsewhere)
    before, outside = tree_digest(target), tree_digest(elsewhere)
    for verb in ("apply", "revert", "status"):
        r = run_cli(verb, target, "--series", test_series)
        assert r.returncode == 5 and f"{target / link} is a symbolic link" in r.stderr, r.stderr
    assert tree_digest(target) == before and tree_digest(elsewhere) == outside


def test_read_only_target(target, test_series):
    """As root, permission bits stop nothing: the target is then a read-only bind mount (EROFS)."""
    before = tree_digest(target)
    cmd = [sys.executable, "-m", "torch_patch", "apply", str(target), "--series", str(test_series)]
    if os.geteuid() == 0:
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
        cmd = ["unshare", "-m", "sh", "-c", script, "sh", str(target), *cmd]
    else:
        target.chmod(0o555)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        target.chmod(0o755)
    assert r.returncode == 5 and r.stderr.startswith("torch-patch: error: apply failed: "), r.stderr
    assert "\nMake it writable (or run as a user who may write there), then run `torch-patch apply " in r.stderr
    assert "\nThe target is now:\nnot applied" in r.stderr
    assert tree_digest(target) == before


def test_one_process_at_a_time(target, test_series):
    """Two applies and a `status --json` while another holder has the lock: they wait and say so (status on
    stderr, its stdout stays JSON), then one applies, the other finds the series applied."""
    fd = os.open(target, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    cmd = [sys.executable, "-m", "torch_patch", "apply", str(target), "--series", str(test_series)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
             for args in (cmd, cmd, [*cmd[:3], "status", *cmd[4:], "--json"])]
    try:
        for p, stream in zip(procs, ("stdout", "stdout", "stderr")):
            assert getattr(p, stream).readline() == f"waiting for another torch-patch working on {target} to " \
                                                    f"finish…\n"
    finally:
        os.close(fd)
    outs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs[:2]] == [0, 0] and json.loads(outs[2])["state"] in ("applied", "not applied")
    assert sorted(out.splitlines()[-1] for out in outs[:2]) == [
        "Nothing to do.", f"applied: {head(target, test_series)}"]


def test_ctrl_c_says_what_the_target_is(target, test_series):
    """Ctrl-C while apply waits for the lock: exit code 130, and the state of the target."""
    fd = os.open(target, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def ctrl_c_as_in_a_terminal():  # a test runner's worker may ignore or block SIGINT: its children inherit that
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    proc = subprocess.Popen([sys.executable, "-m", "torch_patch", "apply", str(target), "--series", str(test_series)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        assert proc.stdout.readline().startswith("waiting for another torch-patch")
        proc.send_signal(signal.SIGINT)
    finally:
        os.close(fd)
    out, err = proc.communicate()
    assert err.splitlines()[-3:] == ["torch-patch: error: stopped by Ctrl-C", "The target is now:",
                                     f"not applied: {head(target, test_series)}"], (proc.returncode, out, err)
    assert proc.returncode == 130


@pytest.mark.parametrize("version,nearest", [("2.16.0", "2.15.0"), ("2.12.1", "2.13.0"), ("3.0.0", "2.15.0"),
                                             ("1.13.1", "2.13.0")])
def test_base_mismatch_names_the_nearest_release(target, test_series, version, nearest):
    vp = target / "torch" / "version.py"
    vp.write_text(vp.read_text().replace(f"'{RUNNING.version}'", f"'{version}'"))
    before = tree_digest(target)
    message = (f"base mismatch: torch {version} at {target}\nThe series are for torch 2.13, 2.14, 2.15: install "
               f"torch=={nearest} (or check out v{nearest}).")
    for verb in ("apply", "revert"):
        r = run_cli(verb, target, "--series", test_series)
        assert (r.returncode, r.stderr) == (3, f"torch-patch: error: {message}\n")
    r = run_cli("status", target)
    assert (r.returncode, r.stdout) == (3, message + "\n")
    assert tree_digest(target) == before


def test_not_a_target(tmp_path, target, test_series):
    r = run_cli("status", tmp_path)
    assert (r.returncode, r.stderr) == (5, f"torch-patch: error: {tmp_path} has no torch/__init__.py.\nPass a PyTorch "
                                           f"checkout, or the directory with an installed torch/ in it\n(of a venv: "
                                           f"VENV/lib/python3.X/site-packages).\n")
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    (target / "torch" / "__init__.py").unlink()  # what pip uninstall leaves: the files not in the wheel
    r = run_cli("status", target)
    assert r.returncode == 5 and r.stderr.endswith(f"\n`pip uninstall torch` left files there? rm -r {target}/torch "
                                                   f"{target}/.torch-patch removes them.\n")


@pytest.mark.parametrize("undo", [["checkout", "."], ["stash", "-u"]])
def test_checkout(tmp_path, template, test_series, undo):
    co = standin_checkout(tmp_path / "pytorch", template)
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0, r.stderr
    assert (co / ".git" / "torch-patch" / "saved" / "patches" / "series").is_file()
    assert git("diff", "--cached", "--name-only", cwd=co).stdout == ""  # the index is untouched
    assert git("diff", "--name-only", cwd=co).stdout.split() == sorted(TEST_FILES)
    git(*undo, cwd=co)
    r = run_cli("status", co, "--series", test_series)
    assert r.returncode == 1 and r.stdout.startswith("not applied: ")
    assert (NEW_FILE in r.stdout) == (undo[0] == "checkout")  # git checkout . keeps the untracked file
    assert run_cli("apply", co, "--series", test_series).returncode == 0
    assert run_cli("revert", co, "--series", test_series).returncode == 0
    assert git("status", "--porcelain", "--untracked-files=all", cwd=co).stdout == ""
    assert not (co / ".git" / "torch-patch").exists()


@pytest.mark.parametrize("how", ["am", "apply"])
def test_checkout_with_the_series_applied_by_git(tmp_path, template, test_series, how):
    """After `git am` or plain `git apply`: applied, and apply changes nothing; revert undoes `git apply` (with
    `git apply -R`) and leaves the commits of `git am` to git."""
    co = standin_checkout(tmp_path / "pytorch", template)
    git(how, *[str(test_series / n) for n in series_names(test_series)], cwd=co)
    note = {"am": "Committed in this checkout (e.g. with `git am`).",
            "apply": "Not by torch-patch (e.g. plain `git apply`)."}
    r = run_cli("status", co, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"applied: {head(co, test_series)}\n{note[how]}\n")
    r = run_cli("apply", co, "--series", test_series)
    assert r.returncode == 0 and r.stdout.startswith("already applied: ")
    r = run_cli("stock-file", TEST_FILES[0], co, "--series", test_series)
    assert r.returncode == 5 and r.stderr.startswith(f"torch-patch: error: no stock version of {TEST_FILES[0]} is on "
                                                     f"disk:\napplied: ") and f"`git show v{RELEASE}:" in r.stderr
    commit = git("rev-parse", "HEAD", cwd=co).stdout
    r = run_cli("revert", co, "--series", test_series)
    assert r.returncode == (6 if how == "am" else 0), r.stderr
    assert ("the series is committed in" in r.stderr and "git revert" in r.stderr) == (how == "am")
    assert git("status", "--porcelain", "--untracked-files=all", cwd=co).stdout == ""
    assert git("rev-parse", "HEAD", cwd=co).stdout == commit and not (co / ".git" / "torch-patch").exists()


def test_a_file_that_does_not_take_the_series_is_named(tmp_path, template, test_series, first_patch_only):
    """The first patch applied by hand, without its successor: that file is neither stock nor patched, and
    apply names the patch and the hunk that do not fit."""
    co = standin_checkout(tmp_path / "pytorch", template)
    git("apply", *[str(first_patch_only / n) for n in series_names(first_patch_only)], cwd=co)
    before = tree_digest(co)
    r = run_cli("status", co, "--series", test_series, "--json")
    assert json.loads(r.stdout)["files"] == {TEST_FILES[0]: "modified", TEST_FILES[1]: "stock", NEW_FILE: "stock"}
    r = run_cli("apply", co, "--series", test_series)
    first = series_names(test_series)[0]
    assert r.returncode == 6 and f"\nPatch {first} does not apply:\n{TEST_FILES[0]}, hunk #1 of 1 does not fit:\n@@ -" in r.stderr
    assert tree_digest(co) == before


def test_default_target_and_venvs(tmp_path, target, test_series):
    base = getattr(sys, "_base_executable", sys.executable)  # this venv's interpreter, outside it
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{target}"}
    r = run_cli("apply", "--series", test_series, python=base, env_extra=env)
    assert r.returncode == 5 and r.stderr.startswith(f"torch-patch: error: refusing to patch {target}: it is not the "
                                                     f"torch of a virtual environment") and "--allow-system" in r.stderr
    r = run_cli("apply", "--series", test_series, env_extra=env)  # in this venv, PYTHONPATH's torch
    assert r.returncode == 0 and r.stdout == f"applied: {head(target, test_series)}\n", r.stderr
    for rel in TEST_FILES:  # apply wrote the bytecode of the torch this Python imports
        source = target / rel
        pyc = Path(importlib.util.cache_from_source(str(source)))
        assert int.from_bytes(pyc.read_bytes()[8:12], "little") == int(source.stat().st_mtime), rel


def test_target_in_an_enclosing_git_repository(tmp_path, template, test_series):
    """A venv inside a clone (.venv, .nox) is an installed torch, and git apply ignores the clone."""
    clone = tmp_path / "clone"
    git("init", "-q", str(clone), cwd=tmp_path)
    target = clone / ".venv" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(template, target)
    stock = tree_digest(target)
    assert run_cli("apply", target, "--series", test_series, cwd=target).returncode == 0
    assert (target / ".torch-patch" / "saved").is_dir() and (target / NEW_FILE).is_file()
    assert run_cli("revert", target, "--series", test_series, cwd=target).returncode == 0
    assert tree_digest(target) == stock


def test_git_missing(target, test_series):
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series, env_extra={"PATH": "/nonexistent"})
    assert r.returncode == 5 and r.stderr.startswith("torch-patch: error: git not found on PATH")
    assert tree_digest(target) == before
