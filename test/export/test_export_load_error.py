# Owner(s): ["oncall: export"]

"""torch.export.load raises the error that stopped it, once, with the fix that
error names: the module to import before loading a program whose output class
that module registers."""

import importlib
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


MODULE = "load_error_outputs"
SOURCE = """
import dataclasses

import torch
from torch.utils._pytree import register_pytree_family


@dataclasses.dataclass
class DetectorOutput:
    boxes: torch.Tensor


register_pytree_family(DetectorOutput)
"""

# Loads the program in a process that has not imported MODULE, then imports it.
LOAD = f"""
import json, sys
import torch

try:
    torch.export.load(sys.argv[1])
    error = None
except Exception as e:
    error = {{"type": type(e).__name__, "message": str(e)}}
    error["runtime_error"] = isinstance(e, RuntimeError)
import {MODULE}  # what the message says to do

out = torch.export.load(sys.argv[1]).module()(torch.ones(2))
print(json.dumps({{"error": error, "after_import": type(out).__qualname__}}))
"""

HINT = f"Import {MODULE} before loading: the class must be registered first."


class Detector(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> object:
        return importlib.import_module(MODULE).DetectorOutput(x + 1)


class TestExportLoadError(TestCase):
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
        self.addCleanup(self._deregister)
        self.path = os.path.join(self.dir, "detector.pt2")
        ep = torch.export.export(Detector(), (torch.ones(2),))
        torch.export.save(ep, self.path)

    def _deregister(self) -> None:
        if self.module.DetectorOutput in pytree.SUPPORTED_NODES:
            pytree._deregister_pytree_family(self.module.DetectorOutput)

    def test_fresh_process_names_the_module_to_import(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([self.dir, *sys.path])}
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(LOAD), self.path],
            capture_output=True,
            text=True,
            env=env,
            cwd=self.dir,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        result = json.loads(proc.stdout.splitlines()[-1])
        error = result["error"]
        self.assertEqual(
            (error["type"], error["runtime_error"]), ("RuntimeError", True)
        )
        # the pytree error's wording differs between releases; its fix does not
        self.assertRegex(
            error["message"],
            "^We ran into an error when deserializing the saved file: Deserializing "
            rf"{MODULE}\.DetectorOutput in pytree .*{re.escape(HINT)}$",
        )
        self.assertEqual(result["after_import"], "DetectorOutput")

    def test_the_error_is_printed_once(self) -> None:
        # Uncaught, in a fresh process: one message, nothing logged besides.
        proc = subprocess.run(
            [sys.executable, "-c", f"import torch; torch.export.load({self.path!r})"],
            capture_output=True,
            text=True,
            cwd=self.dir,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 1)
        self.assertEqual(proc.stderr.count(HINT), 1, proc.stderr)
        self.assertEqual(proc.stderr.count("Traceback"), 1, proc.stderr)
        self.assertTrue(proc.stderr.rstrip().endswith(HINT), proc.stderr)

    def test_not_a_program(self) -> None:
        path = os.path.join(self.dir, "notes.zip")
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "not a program")
        with self.assertRaisesRegex(
            RuntimeError,
            "^We ran into an error when deserializing the saved file: .*notes.txt",
        ):
            torch.export.load(path)


if __name__ == "__main__":
    run_tests()
