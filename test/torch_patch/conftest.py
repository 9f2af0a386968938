"""Fixtures of the torch-patch tool's tests (not sent upstream).

* ``template``: a stand-in installed torch (a site-packages-like directory) with only what the tool reads:
  torch/__init__.py, torch/version.py and the stock versions of the files the test series and the real
  series touch, taken from this venv's torch (even if it is patched). Copying the whole 750 MB package per
  test would be far too slow; ``test_real_series.py`` patches a whole, importable torch.
* ``test_series``: a tiny series of two real commits, made in a dev tree of the template by
  ``torch_patch.dev_create`` and exported by ``torch_patch.dev_export``, so that these tests do not depend
  on the content of the real series.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tp_helpers import NEW_FILE, REAL_SERIES, RUNNING, TEST_FILES, git

import torch_patch
from torch_patch import core


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template") / "site-packages"
    stock = {rel: (RUNNING.root / rel).read_bytes() for rel in ("torch/__init__.py", "torch/version.py")}
    stock.update(core.stock_versions(RUNNING, REAL_SERIES))  # the real series touches the test series' files too
    assert all(stock[rel] for rel in TEST_FILES)
    for rel, data in stock.items():
        if data is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
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
    """A dev tree of the template with two commits on top of v<release>: the test series."""
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
    assert len(torch_patch.dev_export(dev_tree, patches_dir=out, log=lambda s: None)) == 2
    return out


@pytest.fixture(scope="session")
def first_patch_only(tmp_path_factory, test_series) -> Path:
    """Another series: the first patch of the test series alone."""
    out = tmp_path_factory.mktemp("series1")
    name = (test_series / "series").read_text().split()[0]
    shutil.copyfile(test_series / name, out / name)
    (out / "series").write_text(name + "\n")
    return out


@pytest.fixture
def target(tmp_path, template) -> Path:
    t = tmp_path / "site-packages"
    shutil.copytree(template, t)
    return t
