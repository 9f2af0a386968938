"""Helpers shared by conftest.py and the tests of the torch-patch tool (not sent upstream)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch_patch  # noqa: E402
from torch_patch import core  # noqa: E402

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
        return core.load_series(core.PATCHES_DIR).files
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
                          capture_output=True, text=True, env=env, cwd=cwd)
