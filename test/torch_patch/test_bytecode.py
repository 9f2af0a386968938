"""apply and revert write the bytecode they invalidate (issue #19).

Where Python cannot write bytecode next to the patched files, every process would recompile
them on import; so after switching files over, torch-patch writes their ``__pycache__/*.pyc``
with the target's interpreter, timestamp-checked like pip's.  The bytecode is not part of the
state, a failure to write it only warns, and a .pyc that is a symlink is replaced, not written
through.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tp_helpers import NEW_FILE, TEST_FILES, make_venv, run_cli, tree_digest

from torch_patch import core


@pytest.fixture
def venv_site(tmp_path, template) -> Path:
    """The stand-in torch in a real venv's site-packages (so the tool finds its interpreter)."""
    site = make_venv(tmp_path / "venv")
    shutil.copytree(template, site, dirs_exist_ok=True)
    return site


def venv_python(site: Path) -> Path:
    return site.parents[2] / "bin" / "python"


def pyc_of(path: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(path)))


def assert_valid_pyc(src: Path) -> None:
    """The .pyc of ``src`` is what the import system accepts without recompiling: this
    interpreter's magic number, timestamp-checked (flags 0), source mtime and size."""
    data = pyc_of(src).read_bytes()
    magic, flags, mtime, size = data[:4], *struct.unpack("<III", data[4:16])
    st = src.stat()
    assert magic == importlib.util.MAGIC_NUMBER and flags == 0, (src, data[:16])
    assert (mtime, size) == (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF), src


def loads_from_pyc(python: Path, src: Path, name: str) -> bool:
    """``python``, not allowed to write bytecode, takes ``name``'s code from the existing .pyc
    (`-v` says "<pyc> matches <source>") rather than compiling the source."""
    code = (f"import importlib.util as u; s = u.spec_from_file_location({name!r}, {str(src)!r}); "
            f"s.loader.get_code({name!r})")
    r = subprocess.run([str(python), "-v", "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    return f"{pyc_of(src)} matches {src}" in r.stderr


def test_apply_and_revert_write_valid_bytecode(venv_site, test_series):
    site, py = venv_site, venv_python(venv_site)
    files = [site / rel for rel in [*TEST_FILES, NEW_FILE]]
    assert not any(pyc_of(f).exists() for f in files)
    r = run_cli("apply", site, "--series", test_series)
    assert r.returncode == 0 and "warning" not in r.stdout, r.stdout + r.stderr
    for f in files:
        assert_valid_pyc(f)
        assert loads_from_pyc(py, f, "torch.utils." + f.stem)
    r = run_cli("status", site, "--series", test_series)
    assert r.returncode == 0 and r.stdout.startswith("applied ("), r.stdout  # bytecode is no modification

    stock_pycs = {f: pyc_of(f).read_bytes() for f in files[:2]}
    r = run_cli("revert", site, "--series", test_series)
    assert r.returncode == 0, r.stdout + r.stderr
    for f in files[:2]:
        assert_valid_pyc(f)
        assert pyc_of(f).read_bytes() != stock_pycs[f]  # compiled from the restored original
        assert loads_from_pyc(py, f, "torch.utils." + f.stem)
    assert not pyc_of(files[2]).exists()  # the removed module's bytecode is gone
    assert (run_cli("status", site).returncode, run_cli("status", site).stdout) == (1, "not applied\n")


def test_symlinked_pyc_is_replaced_not_written_through(venv_site, test_series, tmp_path):
    """A farm-like tree whose bytecode is a link into another tree: that tree stays as it was."""
    other = tmp_path / "other.pyc"
    other.write_bytes(b"another tree's bytecode")
    pyc = pyc_of(venv_site / TEST_FILES[0])
    pyc.parent.mkdir()
    pyc.symlink_to(other)
    assert run_cli("apply", venv_site, "--series", test_series).returncode == 0
    assert other.read_bytes() == b"another tree's bytecode"
    assert not pyc.is_symlink()
    assert_valid_pyc(venv_site / TEST_FILES[0])


def test_bytecode_failure_only_warns(venv_site, test_series):
    """__pycache__ cannot be created (a file is in the way): apply still succeeds, with one
    warning line; state and files are as after any apply."""
    cache = venv_site / "torch" / "utils" / "__pycache__"
    cache.write_text("not a directory\n")
    r = run_cli("apply", venv_site, "--series", test_series)
    assert r.returncode == 0, r.stdout + r.stderr
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "could not write the bytecode" in warnings[0], r.stdout
    assert str(cache) in warnings[0]
    assert run_cli("status", venv_site, "--series", test_series).returncode == 0
    assert run_cli("revert", venv_site, "--series", test_series).returncode == 0
    assert cache.read_text() == "not a directory\n"


def test_no_interpreter_no_bytecode(target, test_series):
    """A plain directory (no venv layout, not on this Python's path): no interpreter to compile
    for, so no bytecode is written (Python writes it on import, where it may)."""
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    assert not list(target.rglob("*.pyc"))


def test_root_compiles_as_the_trees_owner(venv_site, test_series, monkeypatch, capsys):
    """Run as root on a tree another user owns, the target's interpreter runs as that user (root
    never executes an interpreter the owner could have replaced).  The switch of user is
    recorded, then skipped: the test interpreter lives in /root, which that user cannot enter."""
    if os.geteuid() != 0:
        monkeypatch.setattr(os, "geteuid", lambda: 0)
    owner = 65534
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **kw: _owned(real_stat(p, *a, **kw), owner)
                        if Path(p) == venv_site / "torch" else real_stat(p, *a, **kw))
    calls = []
    real_run = subprocess.run

    def run(cmd, *a, **kw):
        if "-S" in cmd:  # the .pyc writer
            calls.append(kw.copy())
            kw = {k: v for k, v in kw.items() if k not in ("user", "group", "extra_groups")}
        return real_run(cmd, *a, **kw)
    monkeypatch.setattr(subprocess, "run", run)
    from torch_patch import cli
    assert cli.main(["apply", str(venv_site), "--series", str(test_series)]) == 0
    assert [(c.get("user"), c.get("group"), c.get("extra_groups")) for c in calls] == [(owner, owner, [])]
    assert_valid_pyc(venv_site / TEST_FILES[0])


def _owned(st: os.stat_result, uid: int) -> os.stat_result:
    fields = list(st)
    fields[4] = fields[5] = uid  # st_uid, st_gid
    return os.stat_result(fields)


def test_running_interpreters_torch_gets_its_bytecode(target, test_series):
    """The default target (the torch this Python imports, here through PYTHONPATH): compiled in
    process by the running interpreter."""
    r = run_cli("apply", "--series", test_series, env_extra={"PYTHONPATH": str(target)})
    assert r.returncode == 0, r.stdout + r.stderr
    for rel in [*TEST_FILES, NEW_FILE]:
        assert_valid_pyc(target / rel)
        assert loads_from_pyc(Path(sys.executable), target / rel, "torch.utils." + Path(rel).stem)
