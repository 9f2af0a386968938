# Owner(s): ["module: pytree"]

"""Tests for lazy pytree families: ``register_pytree_family("package.module:Class")``.

A lazy family is registered by name, without importing its module; it takes
effect when that module is imported. ``treespec_loads`` imports the module of a
family member only within the package of a registered family's base.
"""

import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

from test_pytree_family import _PYTREE_MODULES, FamilyTestCase

import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import run_tests, skipIfTorchDynamo


@skipIfTorchDynamo(
    "re-imports a package that it writes, and deletes from sys.modules, around "
    "every test: a Dynamo-wrapped test can see a module object of an earlier import"
)
class FamilyPackageTestCase(FamilyTestCase):
    """Writes a package ``familypkg`` of family members to a temporary directory on ``sys.path``."""

    FILES = {
        "__init__.py": "",
        "base.py": """
            import dataclasses

            @dataclasses.dataclass
            class Base:
                a: object
                b: object = None

            @dataclasses.dataclass
            class Unrelated:
                a: object
            """,
        "outputs.py": """
            import dataclasses
            from familypkg.base import Base

            @dataclasses.dataclass
            class Out(Base):
                c: object = None

            class Holder:
                @dataclasses.dataclass
                class Nested(Base):
                    pass
            """,
        "other.py": "SIDE_EFFECT = True\n",
        "lazy.py": """
            def __getattr__(name):
                import familypkg.other
                raise AttributeError(name)
            """,
    }

    def setUp(self) -> None:
        super().setUp()
        # Set aside the lazy families that torch registers for the libraries
        # that are installed (transformers'): these tests see only their own.
        pending = {
            b: f for b, f in py_pytree._PYTREE_FAMILIES.items() if isinstance(b, str)
        }
        for name in pending:
            del py_pytree._PYTREE_FAMILIES[name]
        py_pytree._wait_for_lazy_families()
        self.addCleanup(py_pytree._wait_for_lazy_families)
        self.addCleanup(py_pytree._PYTREE_FAMILIES.update, pending)
        tmpdir = tempfile.TemporaryDirectory()
        self.addCleanup(tmpdir.cleanup)
        self.root = tmpdir.name
        os.makedirs(os.path.join(self.root, "familypkg"))
        for name, text in self.FILES.items():
            with open(os.path.join(self.root, "familypkg", name), "w") as f:
                f.write(textwrap.dedent(text))
        sys.path.insert(0, self.root)
        self.addCleanup(sys.path.remove, self.root)
        self.addCleanup(self.forget_modules)

    def write(self, name: str, text: str) -> None:
        with open(os.path.join(self.root, "familypkg", name), "w") as f:
            f.write(textwrap.dedent(text))

    def deregister_if_registered(self, name: str) -> None:
        if any(py_pytree._family_name(b) == name for b in py_pytree._PYTREE_FAMILIES):
            py_pytree._deregister_pytree_family(name)

    def forget_modules(self) -> None:
        for name in [m for m in sys.modules if m.split(".")[0] == "familypkg"]:
            del sys.modules[name]
        py_pytree.treespec_loads.cache_clear()  # it holds classes of these modules

    def spec_json(self, type_name: Any) -> str:
        return (
            f'[1, {{"type": {json.dumps(type_name)}, "context": "[[\\"a\\"], [\\"b\\"]]", '
            '"children_spec": [{"type": null, "context": null, "children_spec": []}]}]'
        )

    def modules_imported_by_loads(self, type_name: Any) -> set[str]:
        before = set(sys.modules)
        with self.assertRaisesRegex(NotImplementedError, "is not registered"):
            py_pytree.treespec_loads(self.spec_json(type_name))
        return set(sys.modules) - before


class TestPytreeFamilyLazy(FamilyPackageTestCase):
    def test_invalid_and_double_registration(self) -> None:
        for bad in ("nocolon", "a.b:", ":Cls", "a-b:Cls", "a:B:C"):
            with self.assertRaisesRegex(
                ValueError, "Invalid family name .*: use 'package.module:Class'"
            ):
                py_pytree.register_pytree_family(bad)
        # A typo in the package: refused at once, not pending for ever.
        with self.assertRaisesRegex(
            ValueError,
            r"No package 'familypgk' is installed, for 'familypgk.base:Base'\.",
        ):
            py_pytree.register_pytree_family("familypgk.base:Base")
        self.assertNotIn(py_pytree._LazyPyTreeFamilyFinder, sys.meta_path)
        self.register_family("familypkg.outputs:Out")
        with self.assertRaisesRegex(
            ValueError, "already registered as a pytree family"
        ):
            py_pytree.register_pytree_family("familypkg.outputs:Out")
        self.assertNotIn("familypkg", sys.modules)
        with self.assertRaisesRegex(ValueError, "not registered as a pytree family"):
            py_pytree._deregister_pytree_family("nowhere.at_all:Cls")
        importlib.import_module("familypkg.base")
        with self.assertRaisesRegex(ValueError, "has no class 'Missing'"):
            py_pytree.register_pytree_family("familypkg.base:Missing")

    def test_registration_imports_nothing_and_takes_effect_on_import(self) -> None:
        self.register_family("familypkg.base:Base")
        self.assertNotIn("familypkg", sys.modules)
        from familypkg.outputs import Out

        for pytree in _PYTREE_MODULES:  # the C++ pytree knows the member too
            leaves, spec = pytree.tree_flatten([Out(1, c=2)])
            self.assertEqual(leaves, [1, 2])
            self.assertEqual(pytree.tree_unflatten([3, 4], spec), [Out(3, c=4)])
        self.assertEqual(py_pytree.tree_structure(Out(1)).type, Out)

    def test_registration_of_an_imported_module_is_immediate(self) -> None:
        from familypkg.outputs import Out

        py_pytree.register_pytree_family("familypkg.base:Base")
        self.assertEqual(py_pytree.tree_leaves(Out(1, c=2)), [1, 2])
        py_pytree._deregister_pytree_family("familypkg.base:Base")
        self.assertEqual(py_pytree.tree_leaves(Out(1)), [Out(1)])

    def test_loads_imports_the_module_of_a_member(self) -> None:
        self.register_family("familypkg.base:Base")
        importlib.import_module("familypkg.base")
        before = set(sys.modules)
        spec = py_pytree.treespec_loads(self.spec_json("familypkg.outputs.Out"))
        self.assertEqual(set(sys.modules) - before, {"familypkg.outputs"})
        out_cls = sys.modules["familypkg.outputs"].Out
        self.assertIs(spec.type, out_cls)
        self.assertEqual(py_pytree.tree_unflatten([1], spec), out_cls(1))
        nested = py_pytree.treespec_loads(
            self.spec_json("familypkg.outputs.Holder.Nested")
        )
        self.assertIs(nested.type, sys.modules["familypkg.outputs"].Holder.Nested)

    def test_loads_imports_nothing_outside_a_family_package(self) -> None:
        self.register_family("familypkg.base:Base")
        # The family's module is not imported: no member can exist.
        for name in ("familypkg.outputs.Out", "familypkg.other.X", "familypkg.Out"):
            self.assertEqual(self.modules_imported_by_loads(name), set(), name)
        importlib.import_module("familypkg.base")
        for name in (
            "os.path.join",
            "json.decoder.JSONDecoder",  # an importable class, not a member
            "torch._inductor.config.Foo",
            "not_a_module_anywhere.Cls",
            "familypkg",
            "familypkg.base.Unrelated",  # imported, not a member
            "familypkg.missing.Out",
            "familypkg.base.Out.Inner.Deeper",
            "familypkg." + "a." * 5000 + "Out",
            5,
            None,
            1.5,
        ):
            self.assertEqual(self.modules_imported_by_loads(name), set(), name)
        importlib.import_module("familypkg.lazy")  # its __getattr__ is never called
        self.assertEqual(self.modules_imported_by_loads("familypkg.lazy.Foo"), set())
        # Within the package: the one module the name points to.
        self.assertEqual(
            self.modules_imported_by_loads("familypkg.other.SIDE_EFFECT"),
            {"familypkg.other"},
        )

    def test_load_errors_name_the_fix(self) -> None:
        # Each message ends with what to import (stock's wording before it
        # differs from one release to the next).
        def loads_error(type_name: object) -> str:
            with self.assertRaisesRegex(NotImplementedError, "not registered") as cm:
                py_pytree.treespec_loads(self.spec_json(type_name))
            return str(cm.exception)

        self.register_family("familypkg.base:Base")
        for type_name, fix in (
            (
                "familypkg.outputs.Out",
                "Import familypkg before loading: it has pytree families.",
            ),
            (
                "__main__.Out",
                "Define the class in a module, and import it before loading.",
            ),
            # a class of a module of the user's, whose registration has not run
            (
                "otherpkg.outputs.Out",
                "Import otherpkg.outputs before loading: the class must be registered first.",
            ),
        ):
            message = loads_error(type_name)
            self.assertTrue(message.startswith(f"Deserializing {type_name} "), message)
            self.assertTrue(message.endswith(f". {fix}"), message)
        self.assertFalse(loads_error(5).endswith("first."))  # not a class name

    def test_module_half_imported_when_registered(self) -> None:
        # A module that registers a lazy family of its own before it defines the
        # class, as transformers.cache_utils is half imported when it imports
        # torch, which registers transformers' families.
        self.write(
            "selfreg.py",
            """
            import dataclasses
            import torch.utils._pytree as pt
            pt.register_pytree_family("familypkg.selfreg:Base")
            pt.register_pytree_family("familypkg.selfreg:Other")  # a second one
            pt.register_pytree_family("familypkg.selfreg:Missing")  # dropped

            @dataclasses.dataclass
            class Base:
                a: object

            @dataclasses.dataclass
            class Sub(Base):
                b: object = None

            @dataclasses.dataclass
            class Other:
                c: object
            """,
        )
        for name in ("Base", "Other"):
            self.addCleanup(self.deregister_if_registered, f"familypkg.selfreg:{name}")
        from familypkg.selfreg import Other, Sub

        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten([Sub(1, 2), Other(5)])
            self.assertEqual(leaves, [1, 2, 5])
            self.assertEqual(
                pytree.tree_unflatten([3, 4, 6], spec), [Sub(3, 4), Other(6)]
            )
        self.assertNotIn(py_pytree._LazyPyTreeFamilyFinder, sys.meta_path)

    def test_a_failed_import_is_waited_for_again(self) -> None:
        self.write(
            "flaky.py",
            """
            import dataclasses, sys
            if not hasattr(sys, "_familypkg_flaky"):
                sys._familypkg_flaky = True
                raise ImportError("not this time")

            @dataclasses.dataclass
            class Base:
                a: object
            """,
        )
        self.addCleanup(lambda: delattr(sys, "_familypkg_flaky"))
        self.register_family("familypkg.flaky:Base")
        with self.assertRaisesRegex(ImportError, "not this time"):
            importlib.import_module("familypkg.flaky")
        self.assertIn(py_pytree._LazyPyTreeFamilyFinder, sys.meta_path)
        base = importlib.import_module("familypkg.flaky").Base
        self.assertEqual(py_pytree.tree_leaves(base(1)), [1])
        self.assertNotIn(py_pytree._LazyPyTreeFamilyFinder, sys.meta_path)

    def test_the_finder_leaves_when_nothing_can_arrive(self) -> None:
        # The module is imported without the class: the family is dropped.
        py_pytree.register_pytree_family("familypkg.base:Missing")
        self.assertIn(py_pytree._LazyPyTreeFamilyFinder, sys.meta_path)
        importlib.import_module("familypkg.base")
        self.assertNotIn(py_pytree._LazyPyTreeFamilyFinder, sys.meta_path)
        self.assertNotIn("familypkg.base:Missing", py_pytree._PYTREE_FAMILIES)

    def test_a_member_module_that_raises_is_a_load_error(self) -> None:
        self.write("exits.py", "raise SystemExit(3)\n")
        self.register_family("familypkg.base:Base")
        importlib.import_module("familypkg.base")
        with self.assertRaisesRegex(
            ImportError,
            r"Importing familypkg.exits to load familypkg.exits.Out failed: "
            r"SystemExit\(3\)",
        ):
            py_pytree.treespec_loads(self.spec_json("familypkg.exits.Out"))

    def test_unpickled_spec_in_a_fresh_process(self) -> None:
        with open(os.path.join(self.root, "familypkg", "registers.py"), "w") as f:
            f.write(
                "import torch.utils._pytree as pt\n"
                'pt.register_pytree_family("familypkg.base:Base")\n'
            )
        from familypkg.outputs import Out

        self.register_family("familypkg.base:Base")
        leaves, spec = py_pytree.tree_flatten([Out(1, c=2)])
        script = textwrap.dedent(
            f"""
            import pickle, sys
            sys.path.insert(0, {self.root!r})
            import torch.utils._pytree as pt
            import familypkg.registers
            spec = pickle.loads({pickle.dumps(spec)!r})
            print(pt.tree_unflatten({leaves!r}, spec))
            print(pt.treespec_dumps(spec))
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        out_line, dumps_line = result.stdout.strip().splitlines()[-2:]
        self.assertEqual(out_line, "[Out(a=1, b=None, c=2)]")
        self.assertEqual(dumps_line, py_pytree.treespec_dumps(spec))


if __name__ == "__main__":
    run_tests()
