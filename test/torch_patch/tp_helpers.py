"""Helpers shared by conftest.py and the tests of the torch-patch tool (not sent upstream)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch_patch  # noqa: E402
from torch_patch import core  # noqa: E402

# the torch of this venv ("2.14.1+cu130"), its release ("2.14.1") and the shipped series of its line
RUNNING_VERSION = core.read_torch_version(core.installed_torch_root() or REPO) or "unknown"
RELEASE = RUNNING_VERSION.split("+", 1)[0]
REAL_SERIES_DIR = core.series_dir_for(core.release_line(RELEASE))

TEST_FILES = ["torch/utils/_pytree.py", "torch/utils/_cxx_pytree.py"]
NEW_FILE = "torch/utils/_torch_patch_probe.py"
BASE_FILES = ["torch/__init__.py", "torch/version.py"]

GIT_ID = {
    "GIT_AUTHOR_NAME": "Test Author", "GIT_AUTHOR_EMAIL": "author@example.com",
    "GIT_AUTHOR_DATE": "2001-02-03T04:05:06Z", "GIT_COMMITTER_NAME": "Test Author",
    "GIT_COMMITTER_EMAIL": "author@example.com", "GIT_COMMITTER_DATE": "2001-02-03T04:05:06Z",
}


def git(*args, cwd, check=True, env_extra=None):
    return subprocess.run(["git", *args], cwd=cwd, env=core.git_env({**GIT_ID, **(env_extra or {})}),
                          check=check, capture_output=True, text=True)


def real_series_files():
    try:
        return core.load_series(REAL_SERIES_DIR).files
    except core.TorchPatchError:
        return []


def tree_digest(root: Path) -> dict:
    """sha256 of every file below root (the state of a target, for exact comparisons)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def run_cli(*args, env_extra=None, python=None, cwd=None, env=None):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop(core.FAULT_ENV, None)
    env.update(env_extra or {})
    return subprocess.run([python or sys.executable, "-m", "torch_patch", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    # The CLI starts with SIGINT at its default, as from a terminal, whatever the test runner
    # inherited: a job started in the background (`cmd &`) runs with SIGINT ignored, and so
    # would the CLI, which would then never see the Ctrl-C that the tests send it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def base_python() -> str:
    """The interpreter this venv was made from (outside any venv)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def make_venv(path: Path) -> Path:
    """A bare venv (no pip: fast); returns its site-packages."""
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(path)], check=True)
    sps = sorted(path.glob("lib/python3*/site-packages"))
    assert len(sps) == 1, sps
    return sps[0]


def stock_torch_farm(site: Path) -> Path:
    """Install a *stock* copy of this interpreter's torch into ``site`` (a venv's site-packages)
    cheaply: real directories, every file a symlink to the installed torch, except the files the
    real series touches, which are real copies of their stock versions (the originals if this
    torch is patched); files stock torch lacks are left out.  The tool only ever replaces files
    (os.replace / unlink), so patching the farm never writes through a symlink.  Also copies
    the torch dist-info, so pip sees the same torch release installed there.  Returns ``site``."""
    src = core.resolve_target(core.installed_torch_root(), require_venv=False)
    copies = core.stock_files(src, None, series=core.load_series(REAL_SERIES_DIR))
    created = [rel for rel, path in copies.items() if path is None]
    for dirpath, dirnames, filenames in os.walk(src.root / "torch"):
        rel_dir = Path(dirpath).relative_to(src.root)
        (site / rel_dir).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.symlink(Path(dirpath) / name, site / rel_dir / name)
    for rel, path in copies.items():
        (site / rel).unlink(missing_ok=True)
        if path is not None:
            shutil.copyfile(path, site / rel)
    for rel in created:
        for pyc in (site / rel).parent.joinpath("__pycache__").glob(Path(rel).stem + ".*.pyc"):
            pyc.unlink()
    di = core.find_dist_info(src.root)
    shutil.copytree(di, site / di.name)
    return site


def simulate_pip_reinstall(target: Path, stock: Path) -> None:
    """What `pip install --force-reinstall --no-deps torch==<release>` does to a stand-in target
    (a real one takes a minute): every file the wheel's RECORD lists is removed and written anew
    with the wheel's bytes (here: those of the stock stand-in ``stock``); files it does not list
    (what the series added, .torch-patch/) are left alone."""
    record = core.load_record(target)
    for rel in record:
        (target / rel).unlink(missing_ok=True)
        if (stock / rel).exists():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(stock / rel, target / rel)


def run_until(cmd: str, cwd: Path, marker: str, env=None, timeout: float = 240.0):
    """Run the shell command ``cmd`` (bash) and stop it (its whole process group) once a line
    containing ``marker`` has been printed, or it exits.  Returns (exit code or None if stopped,
    output so far)."""
    import selectors
    import signal
    import time
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                continue
            line = proc.stdout.readline()
            if not line:
                return proc.wait(), "".join(lines)
            lines.append(line)
            if marker in line:
                return None, "".join(lines)
        raise AssertionError(f"{cmd!r}: no {marker!r} within {timeout} s:\n{''.join(lines)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def doc_commands(markdown: Path, must_contain: str) -> list:
    """The shell commands of the fenced code blocks of ``markdown`` that contain
    ``must_contain``: comment-only lines dropped, backslash continuations joined, exactly as
    a user pasting the block would run them."""
    import re
    text = markdown.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
        if must_contain not in block:
            continue
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.strip() and not cmd.lstrip().startswith("#"):
                out.append(cmd)
    assert out, f"no code block of {markdown} contains {must_contain!r}"
    return out


def standin_checkout(path: Path, template: Path) -> Path:
    """A git checkout at ``path`` holding a copy of ``template``'s ``torch/``, committed."""
    shutil.copytree(template / "torch", path / "torch")
    git("init", "-q", cwd=path)
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "v2.13.0 stand-in", cwd=path)
    return path
