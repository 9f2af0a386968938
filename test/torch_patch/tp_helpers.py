"""Helpers of the torch-patch tool's tests (not sent upstream)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from torch_patch import core  # noqa: E402

# The torch of this venv: its root, version ("2.13.0+cpu"), release ("2.13.0") and shipped series.
RUNNING = core.resolve_target(require_venv=False)
RELEASE = RUNNING.release
REAL_SERIES = core.load_series(line=RUNNING.line)

TEST_FILES = ["torch/utils/_pytree.py", "torch/utils/_cxx_pytree.py"]  # what the test series changes
NEW_FILE = "torch/utils/_torch_patch_probe.py"  # and adds
GIT_ID = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER") for what, value in (
    ("NAME", "Test Author"), ("EMAIL", "author@example.com"), ("DATE", "2001-02-03T04:05:06Z"))}


def git(*args, cwd, check=True):
    return subprocess.run(["git", *args], cwd=cwd, env=core.git_env(GIT_ID), check=check, capture_output=True,
                          text=True)


def run_cli(*args, env_extra=None, python=None, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.update(env_extra or {})
    return subprocess.run([python or sys.executable, "-m", "torch_patch", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd)


def tree_digest(root: Path) -> dict:
    """sha256 of every file below root but bytecode: the state of a target, to compare exactly."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def without_state(digest: dict) -> dict:
    return {rel: sha for rel, sha in digest.items() if not rel.startswith(".torch-patch/")}


def series_names(series_dir: Path) -> list:
    return (series_dir / "series").read_text().split()


def standin_checkout(path: Path, template: Path) -> Path:
    """A git checkout at ``path`` of ``template``'s torch/, committed."""
    shutil.copytree(template / "torch", path / "torch")
    git("init", "-q", cwd=path)
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", f"v{RELEASE} stand-in", cwd=path)
    return path
