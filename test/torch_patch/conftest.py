"""Fixtures for the tests of the torch-patch tool itself (not sent upstream).

* ``template``: a stand-in "installed torch" (a site-packages-like dir) holding only what the
  tool needs: torch/__init__.py, torch/version.py, the wheel's dist-info (METADATA, RECORD) and
  the stock versions of the files touched by the test series and by the real series.  Copying
  the whole 750 MB package per test would be far too slow; it is built once per session from
  the torch installed in this venv (stock copies, verified against RECORD, even if that torch
  is patched).  Tests that need a whole importable torch (pip uninstall, the documented
  benchmark commands) use ``tp_helpers.stock_torch_farm``, a symlink copy of it.
* ``test_series``: a tiny series made by real git commits in a dev tree created by
  ``torch_patch.dev_create`` from the template and exported by ``torch_patch.dev_export``, so
  these tests do not depend on the content of the real series.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tp_helpers import NEW_FILE, TEST_FILES, BASE_FILES, git, real_series_files, core, torch_patch  # noqa: F401


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Path:
    src = core.resolve_target(core.installed_torch_root(), require_venv=False)
    record = core.load_record(src.root)
    root = tmp_path_factory.mktemp("template") / "site-packages"
    di = core.find_dist_info(src.root)
    (root / di.name).mkdir(parents=True)
    for name in ("METADATA", "RECORD"):
        shutil.copyfile(di / name, root / di.name / name)
    rels = list(dict.fromkeys(BASE_FILES + TEST_FILES + real_series_files()))
    for rel, stock in core.stock_files(src, rels, record).items():
        if stock is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(stock, root / rel)
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="session")
def empty_series(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("empty-series")
    (d / "series").write_text("")
    return d


@pytest.fixture(scope="session")
def dev_tree(tmp_path_factory, template, empty_series) -> Path:
    """A dev tree with two commits on top of v<this torch's release> (the test series)."""
    dev = tmp_path_factory.mktemp("dev") / "tree"
    torch_patch.dev_create(dev, source=template, series_dir=empty_series, log=lambda s: None)
    _edit(dev / TEST_FILES[0], "\nimport ", "\n# torch-patch test: first patch\nimport ")
    git("commit", "-q", "-am", "Test patch one\n\nAdds a comment to _pytree.", cwd=dev)
    _edit(dev / TEST_FILES[1], "\nimport ", "\n# torch-patch test: second patch\nimport ")
    _edit(dev / TEST_FILES[0], "\ndef tree_flatten(", "\n# torch-patch test: near tree_flatten\ndef tree_flatten(")
    (dev / NEW_FILE).write_text("PROBE = 'patched'\n")
    git("add", NEW_FILE, cwd=dev)
    git("commit", "-q", "-am", "Test patch two\n\nTouches two files and adds one.", cwd=dev)
    return dev


@pytest.fixture(scope="session")
def test_series(tmp_path_factory, dev_tree) -> Path:
    out = tmp_path_factory.mktemp("series")
    names = torch_patch.dev_export(dev_tree, patches_dir=out, log=lambda s: None)
    assert len(names) == 2
    return out


@pytest.fixture(scope="session")
def first_patch_only(tmp_path_factory, test_series) -> Path:
    """A different series: only the first patch of the test series."""
    out = tmp_path_factory.mktemp("series1")
    name = (test_series / "series").read_text().splitlines()[0]
    shutil.copyfile(test_series / name, out / name)
    (out / "series").write_text(name + "\n")
    return out


@pytest.fixture
def target(tmp_path, template) -> Path:
    t = tmp_path / "site-packages"
    shutil.copytree(template, t)
    return t
