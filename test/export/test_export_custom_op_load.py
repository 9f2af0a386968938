# Owner(s): ["oncall: export"]
"""torch.export.load of a program that calls a custom op it has not seen registered.

The op ``opspkg::scale`` is registered by a module of the package ``opspkg``
that the module of the model's class imports. Loading imports nothing to find
it: the error names the module that calls the op (from the program's stack
traces), and the program loads once that module is imported. Each test writes a
package to a temporary directory, exports and saves in one fresh process, and
loads in another.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

from torch.testing._internal.common_utils import run_tests, TestCase


PACKAGE = "opspkg"

FILES = {
    "__init__.py": "from opspkg import outputs\n",
    "outputs.py": """
        import dataclasses

        import torch

        @dataclasses.dataclass
        class Output:
            out: torch.Tensor
        """,
    "ops.py": """
        import torch

        @torch.library.custom_op("{ns}::scale", mutates_args=())
        def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
            return x * factor

        @scale.register_fake
        def _(x: torch.Tensor, factor: float) -> torch.Tensor:
            return torch.empty_like(x)
        """,
    "model.py": """
        import torch

        import opspkg.ops
        from opspkg.outputs import Output

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(4, 3)

            def forward(self, x: torch.Tensor) -> Output:
                return Output(torch.ops.{ns}.scale(self.linear(x), 2.0))
        """,
    "other.py": """
        import dataclasses

        @dataclasses.dataclass
        class OtherBase:
            a: object
        """,
}

# How a process makes opspkg.outputs.Output a pytree node: as a family (by its
# name, before importing opspkg, or by the class), or exactly.
_REGISTER = """
import importlib, sys
import torch.utils._pytree as pytree

sys.path.insert(0, sys.argv[1])
mode = sys.argv[2]
if mode == "family_by_name":
    pytree.register_pytree_family("opspkg.outputs:Output")
    importlib.import_module("opspkg")
elif mode == "family_by_class":
    pytree.register_pytree_family(importlib.import_module("opspkg").outputs.Output)
else:
    pytree.register_dataclass(
        importlib.import_module("opspkg").outputs.Output,
        serialized_type_name="opspkg.outputs.Output",
    )
    if mode == "exact_other_family":  # a family, of another package
        pytree.register_pytree_family(importlib.import_module("opspkg_other").OtherBase)
"""

_EXPORT = (
    _REGISTER
    + """
import json, os
import torch
from opspkg.model import Model

torch.manual_seed(0)
model = Model()
x = torch.randn(2, 4)
ep = torch.export.export(model, (x,))
torch.export.save(ep, os.path.join(sys.argv[1], "model.pt2"))
torch.save((x, model(x).out), os.path.join(sys.argv[1], "expected.pt"))
targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
print(json.dumps({"targets": targets}))
"""
)

_LOAD = (
    _REGISTER
    + """
import json, os
import torch

def imported():
    return sorted(m for m in sys.modules if m.startswith("opspkg."))

for module in sys.argv[3:]:  # what the error of an earlier load named
    importlib.import_module(module)
before = imported()
try:
    ep = torch.export.load(os.path.join(sys.argv[1], "model.pt2"))
except BaseException as e:
    result = {"loaded": False, "error": f"{type(e).__name__}: {e}"}
else:
    x, expected = torch.load(os.path.join(sys.argv[1], "expected.pt"))
    out = ep.module()(x)
    result = {
        "loaded": True,
        "type": f"{type(out).__module__}.{type(out).__qualname__}",
        "equal": torch.equal(out.out, expected),
    }
result.update(before=before, after=imported())
print(json.dumps(result))
"""
)

_FIX = (
    "torch.ops.opspkg.scale.default is not registered: import opspkg.model "
    "before loading (the program calls the custom op from there)."
)


class TestExportCustomOpLoad(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.ns = PACKAGE  # the op namespace is the package's name
        tmpdir = tempfile.TemporaryDirectory()
        self.addCleanup(tmpdir.cleanup)
        self.root = tmpdir.name
        os.makedirs(os.path.join(self.root, PACKAGE))
        for name, text in FILES.items():
            path = (
                os.path.join(self.root, "opspkg_other.py")
                if name == "other.py"
                else os.path.join(self.root, PACKAGE, name)
            )
            with open(path, "w") as f:
                f.write(textwrap.dedent(text).replace("{ns}", self.ns))

    def run_python(self, code: str, mode: str, *imports: str) -> tuple[Any, str]:
        """Run ``code`` with the package root, ``mode`` and ``imports`` as
        arguments in a fresh process; the JSON of its last line of stdout, and
        its stderr."""
        env = os.environ.copy()
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # in an empty directory: with -c, the working directory is on sys.path
        with tempfile.TemporaryDirectory() as cwd:
            proc = subprocess.run(
                [sys.executable, "-c", code, self.root, mode, *imports],
                capture_output=True,
                text=True,
                env=env,
                cwd=cwd,
                timeout=300,
            )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr

    def export(self, mode: str) -> None:
        result, _ = self.run_python(_EXPORT, mode)
        self.assertIn(f"{self.ns}.scale.default", result["targets"])

    def test_the_error_names_the_module_to_import(self) -> None:
        self.export("family_by_class")
        for mode in ("family_by_name", "family_by_class", "exact"):
            with self.subTest(mode=mode):
                result, stderr = self.run_python(_LOAD, mode)
                self.assertFalse(result["loaded"])
                # in the error, or in the log before [export] Raise the error
                # that stopped torch.export.load
                self.assertIn(_FIX, result["error"] + stderr)
                self.assertTrue(result["error"].startswith("RuntimeError: "))
                self.assertEqual(result["after"], result["before"])  # no import
                # after the one import the error names, it loads
                result, stderr = self.run_python(_LOAD, mode, "opspkg.model")
                self.assertTrue(result["loaded"], stderr[-3000:])
                self.assertEqual(result["type"], "opspkg.outputs.Output")
                self.assertTrue(result["equal"])

    def test_load_runs_nothing_that_names_the_op(self) -> None:
        # Modules whose text names the op, in the package and beside it, are
        # neither imported nor run, whatever they would raise.
        marker = os.path.join(self.root, "ran")
        for path, text in (
            (
                "opspkg/broken.py",
                '# defines "opspkg::scale" too\nraise SystemExit(2)\n',
            ),
            ("opspkg/ctrlc.py", '# "opspkg::scale"\nraise KeyboardInterrupt\n'),
            ("stray/run.py", f'# "opspkg::scale"\nopen({marker!r}, "w")\n'),
        ):
            os.makedirs(os.path.dirname(os.path.join(self.root, path)), exist_ok=True)
            with open(os.path.join(self.root, path), "w") as f:
                f.write(text)
        self.export("family_by_class")
        result, stderr = self.run_python(_LOAD, "family_by_class")
        self.assertFalse(result["loaded"])
        self.assertIn(_FIX, result["error"] + stderr)
        self.assertEqual(result["after"], ["opspkg.outputs"])
        self.assertFalse(os.path.exists(marker))


if __name__ == "__main__":
    run_tests()
