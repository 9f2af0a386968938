"""The demo's stock side (demo.install_stock): stock torch imported from the files that `apply`
saved, in a venv whose torch is patched.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tp_helpers import NEW_FILE, REPO, RUNNING, TEST_FILES

import torch_patch
from torch_patch import core, demo

# A dataclass whose base is registered as a family where torch has families: flattened into its tensor by
# the patched pytree, a leaf in stock torch. Prints what the process imported, as JSON.
PROBE = """
import dataclasses, json, sys
import torch, torch.onnx, torch.utils._pytree as pytree, torch.utils._cxx_pytree as cxx_pytree
from torch.onnx._internal.exporter import _core

@dataclasses.dataclass
class Base:
    x: torch.Tensor

has_family = hasattr(pytree, "register_pytree_family")
if has_family:
    pytree.register_pytree_family(Base)

@dataclasses.dataclass
class Sub(Base):
    pass

if has_family:  # a subclass created since: a member from torch's next boundary on
    pytree._update_pytree_families()

try:
    import torch.utils._pytree_hf
    added = "imported"
except ModuleNotFoundError as e:
    added = str(e)
print(json.dumps({
    "has_family": has_family, "cxx": hasattr(cxx_pytree, "register_pytree_family"), "added": added,
    "leaves": [type(leaf).__name__ for leaf in pytree.tree_leaves(Sub(torch.ones(1)))],
    "files": {name: sys.modules[name].__file__ for name in ("torch.utils._pytree", "torch.onnx", _core.__name__)},
    "onnx_path": list(torch.onnx.__path__),
}))
"""
RUN_PROBE = ("import json, os, sys\nfrom torch_patch import demo\n"
             "demo.install_stock(json.loads(os.environ['MODULES']))\n")

st = core.status()
applied = pytest.mark.skipif(st.code != core.EXIT_APPLIED or not st.stock_files, reason=f"needs this venv's torch "
                             f"patched by `torch-patch apply`, but it is {st.state}")


def probe(modules=None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), MODULES=json.dumps(modules))
    code = (RUN_PROBE if modules is not None else "") + PROBE
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@applied
def test_stock_loader_imports_the_saved_stock_files():
    modules = demo.stock_modules()
    saved = RUNNING.root / ".torch-patch" / "saved" / "orig"
    assert modules["torch.utils._pytree"] == str(saved / "torch/utils/_pytree.py")
    assert modules["torch.onnx"] == str(saved / "torch/onnx/__init__.py")
    assert modules["torch.utils._pytree_hf"] is None  # the series adds it
    got = probe(modules)
    assert got["has_family"] is False and got["cxx"] is False
    assert got["leaves"] == ["Sub"]  # stock: an unregistered dataclass is a leaf
    assert got["files"] == {"torch.utils._pytree": modules["torch.utils._pytree"], "torch.onnx":
                            modules["torch.onnx"], "torch.onnx._internal.exporter._core":
                            modules["torch.onnx._internal.exporter._core"]}
    assert got["onnx_path"] == [str(RUNNING.root / "torch" / "onnx")]  # its submodules are the installed ones
    assert got["added"] == "No module named 'torch.utils._pytree_hf'"
    for rel, path in st.stock_files.items():  # they are the stock files; nothing was written next to them
        assert not (saved / rel).parent.joinpath("__pycache__").exists(), rel
        assert path == str(saved / rel)


@applied
def test_without_the_loader_the_same_code_gets_the_patched_torch():
    got = probe()
    assert got["has_family"] is True and got["cxx"] is True
    assert got["leaves"] == ["Tensor"]  # a member of the family: flattened into its tensor
    assert got["files"]["torch.utils._pytree"] == str(RUNNING.root / "torch" / "utils" / "_pytree.py")
    assert got["added"] == "imported"


@applied
def test_install_refuses_a_torch_already_imported():
    code = "import torch, torch_patch.demo as d\nd.install_stock(d.stock_modules())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("RuntimeError: ") and "torch.utils._pytree" in last, r.stderr
    assert last.endswith(" already imported: install the stock finder before torch"), r.stderr


def test_stock_modules_of_a_standin_target(target, test_series):
    with pytest.raises(core.TorchPatchError, match=r"is not patched by torch-patch:\nnot applied: .*\nRun "
                       r"`torch-patch apply` first") as e:
        demo.stock_modules(target)
    assert e.value.code == core.EXIT_NOT_APPLIED
    torch_patch.apply(target, series_dir=test_series, log=lambda s: None)
    saved = target / ".torch-patch" / "saved" / "orig"
    assert demo.stock_modules(target) == {"torch.utils._pytree": str(saved / TEST_FILES[0]),
                                          "torch.utils._cxx_pytree": str(saved / TEST_FILES[1]),
                                          NEW_FILE[:-3].replace("/", "."): None}


def test_demo_names_torch_patch_apply_when_torch_is_not_patched(target):
    code = f"import sys\nsys.path.insert(0, {str(target)!r})\nfrom torch_patch import demo\nsys.exit(demo.main([]))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 1 and "Run `torch-patch apply` first" in r.stderr, r.stderr
    assert r.stdout == ""


def test_demo_shows_the_opt_in_line_it_writes(capsys, tmp_path):
    """The line the demo's module opts its classes in with is the line it tells the reader to write,
    and main() prints it (the sides' processes mocked: no export runs)."""
    from unittest import mock

    from torch_patch import demo

    assert demo.REGISTER in demo.OUTPUTS and demo.REGISTER in demo.opt_in()
    results = {"stock": {"info": {"torch": "2", "transformers": None, "has_family": False}},
               "patched": {"family": {"ok": True, "text": "ok"}}}
    with mock.patch.object(demo, "stock_modules", return_value={}), \
            mock.patch.object(demo, "_run_side", side_effect=lambda tmp, side: results[side]), \
            mock.patch.object(demo, "opt_in", wraps=demo.opt_in) as opt_in:
        assert demo.main([]) == 0
    opt_in.assert_called_once_with()
    assert f"\n    {demo.REGISTER}\n" in capsys.readouterr().out
