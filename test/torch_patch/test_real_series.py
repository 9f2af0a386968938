"""The real series on a whole, importable torch: `torch-patch apply` and `revert` in a venv.

The venv's torch is a *farm* of this venv's: real directories, each file (but bytecode) a symlink to this
venv's torch, but the files the series touches, which are real copies of their stock versions (the tool only
ever replaces those, never writing through a link). The venv sees this venv's other packages and this
checkout's torch_patch.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tp_helpers import REAL_SERIES, REPO, RUNNING

from torch_patch import core


def test_real_series_apply_and_revert_on_a_real_torch(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    stock = core.stock_versions(RUNNING, REAL_SERIES)
    for dirpath, dirnames, filenames in os.walk(RUNNING.root / "torch"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]  # as in a venv that has imported nothing yet
        (site / Path(dirpath).relative_to(RUNNING.root)).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            (site / Path(dirpath).relative_to(RUNNING.root) / name).symlink_to(Path(dirpath) / name)
    for rel, data in stock.items():
        (site / rel).unlink(missing_ok=True)
        if data is not None:
            (site / rel).write_bytes(data)
    (site / "farm.pth").write_text(f"{REPO}\nimport site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = "import torch, torch.utils._pytree as p; print(torch.__file__, hasattr(p, 'register_pytree_family'))"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, *args], capture_output=True, text=True, env=env)

    head = f"{len(REAL_SERIES.patches)} patches (series {RUNNING.line}) on torch {RUNNING.version} at {site}"
    r = run("-m", "torch_patch", "apply")
    assert (r.returncode, r.stdout) == (0, f"applied: {head}\n"), r.stderr
    assert run("-c", probe).stdout == f"{site / 'torch' / '__init__.py'} True\n"
    source = site / "torch" / "utils" / "_pytree.py"  # apply wrote its bytecode (a file, not through the link)
    pyc = Path(importlib.util.cache_from_source(str(source)))
    assert not pyc.is_symlink() and pyc.read_bytes()[8:12] == int(source.stat().st_mtime).to_bytes(4, "little")
    r = run("-m", "torch_patch", "stock-file", "torch/utils/_pytree.py")
    assert Path(r.stdout.strip()).read_bytes() == stock["torch/utils/_pytree.py"]
    r = run("-m", "torch_patch", "revert")
    assert r.returncode == 0 and r.stdout.startswith(f"reverted: {head}\nIts "), r.stderr
    assert {rel: (site / rel).read_bytes() if (site / rel).exists() else None for rel in stock} == stock
    assert not (site / ".torch-patch").exists()
    assert run("-c", probe).stdout == f"{site / 'torch' / '__init__.py'} False\n"
    r = run("-m", "torch_patch", "status")
    assert (r.returncode, r.stdout) == (1, f"not applied: {head}\n")
