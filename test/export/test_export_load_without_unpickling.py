# Owner(s): ["oncall: export"]

"""torch.export.load unpickles no object unless the caller passes
weights_only=False: example inputs that hold an object (a KV cache) are saved as
their pytree leaves and spec, and load with weights_only=True; a file whose
example inputs, weights or constants would need unpickling is refused with the
fix, and runs nothing."""

import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import zipfile

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_utils import run_tests, TestCase


MODULE = "unpickling_caches"
SOURCE = """
import dataclasses

import torch
from torch.utils._pytree import register_pytree_family


@dataclasses.dataclass
class KVCache:
    keys: torch.Tensor
    length: int


register_pytree_family(KVCache)


class Step(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: KVCache) -> KVCache:
        keys = torch.cat([cache.keys, x])
        return KVCache(keys, cache.length + x.shape[0])
"""

FIX = (
    "It needs unpickling, which can run any code: load it with "
    "torch.export.load(f, weights_only=False) if you trust the file."
)


class Runs:
    """Unpickling it creates the file ``path``: it stands for any code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> object:
        return (open, (self.path, "w"))


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _replace(path: str, suffix: str, content: bytes, out: str) -> None:
    # Copies the archive at path to out, with the entry ending in suffix replaced.
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            data = content if name.endswith(suffix) else src.read(name)
            dst.writestr(name, data)


class TestExportLoadWithoutUnpickling(TestCase):
    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = tmp.name
        with open(os.path.join(self.dir, f"{MODULE}.py"), "w") as f:
            f.write(SOURCE)
        sys.path.insert(0, self.dir)
        self.addCleanup(sys.path.remove, self.dir)
        self.addCleanup(sys.modules.pop, MODULE, None)
        self.module = importlib.import_module(MODULE)
        self.addCleanup(pytree._deregister_pytree_family, self.module.KVCache)
        self.path = os.path.join(self.dir, "step.pt2")
        self.cache = self.module.KVCache(torch.ones(3, 2), 3)
        ep = torch.export.export(self.module.Step(), (torch.ones(1, 2), self.cache))
        torch.export.save(ep, self.path)
        self.marker = os.path.join(self.dir, "ran")

    def test_example_inputs_load_with_weights_only(self) -> None:
        # In a fresh process: no fallback to unpickling, nothing logged.
        script = f"""
            import json, sys
            import torch, {MODULE}
            ep = torch.export.load(sys.argv[1])
            (x, cache), kwargs = ep.example_inputs
            out = ep.module()(x, cache)
            print(json.dumps([type(cache).__name__, cache.length, out.length]))
            """
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([self.dir, *sys.path])}
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), self.path],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(json.loads(proc.stdout.splitlines()[-1]), ["KVCache", 3, 4])
        self.assertEqual(proc.stderr, "")
        with zipfile.ZipFile(self.path) as archive:
            [name] = [n for n in archive.namelist() if "sample_inputs" in n]
            saved = torch.load(io.BytesIO(archive.read(name)), weights_only=True)
        self.assertEqual(sorted(saved), ["pytree_leaves", "pytree_spec"])

    def test_example_inputs_that_need_unpickling_are_refused(self) -> None:
        crafted = os.path.join(self.dir, "crafted.pt2")
        _replace(self.path, ".pt", _saved(((Runs(self.marker),), {})), crafted)
        with self.assertRaisesRegex(RuntimeError, re.escape(FIX)):
            torch.export.load(crafted)
        self.assertFalse(os.path.exists(self.marker))
        torch.export.load(crafted, weights_only=False)  # opted in: it runs
        self.assertTrue(os.path.exists(self.marker))

    def test_a_weight_that_needs_unpickling_is_refused(self) -> None:
        class Scale(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(2))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight

        path = os.path.join(self.dir, "scale.pt2")
        torch.export.save(torch.export.export(Scale(), (torch.ones(2),)), path)
        with zipfile.ZipFile(path) as archive:
            config_name = next(n for n in archive.namelist() if "weights_config" in n)
            config = json.loads(archive.read(config_name))
        [meta] = config["config"].values()
        meta["use_pickle"] = True  # a crafted config: unpickled by stock torch
        weight = f"/{meta['path_name']}"
        crafted = os.path.join(self.dir, "crafted.pt2")
        _replace(path, config_name, json.dumps(config).encode(), crafted + ".tmp")
        _replace(crafted + ".tmp", weight, _saved(Runs(self.marker)), crafted)
        with self.assertRaisesRegex(RuntimeError, re.escape(FIX)):
            torch.export.load(crafted)
        self.assertFalse(os.path.exists(self.marker))


if __name__ == "__main__":
    run_tests()
