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
        "enums.py": """
            import enum

            class Color(enum.Enum):
                RED = 1
            """,
        "lazy.py": """
            def __getattr__(name):
                import familypkg.other
                raise AttributeError(name)
            """,
    }

    def setUp(self) -> None:
        super().setUp()
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
            with self.assertRaisesRegex(ValueError, "Invalid pytree family name"):
                py_pytree.register_pytree_family(bad)
        self.register_family("some_unimported_package.outputs:Out")
        with self.assertRaisesRegex(
            ValueError, "already registered as a pytree family"
        ):
            py_pytree.register_pytree_family("some_unimported_package.outputs:Out")
        self.assertNotIn("some_unimported_package", sys.modules)
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
        def loads_error(type_name: object) -> str:
            with self.assertRaisesRegex(NotImplementedError, "not registered") as cm:
                py_pytree.treespec_loads(self.spec_json(type_name))
            return str(cm.exception)

        self.register_family("familypkg.base:Base")
        self.assertIn(
            ". Import familypkg before loading: it has the pytree family "
            "'familypkg.base:Base'.",
            loads_error("familypkg.outputs.Out"),
        )
        self.assertIn(
            ". A class defined in __main__ cannot be loaded by another program: "
            "define it in a module, and import that module before loading.",
            loads_error("__main__.Out"),
        )
        for message in (loads_error("otherpkg.outputs.Out"), loads_error(5)):
            self.assertNotIn("family", message)  # stock's message

    def test_enum_contexts_import_nothing(self) -> None:
        # A spec whose context holds enums, as EnumEncoder writes them.
        class Tagged:
            def __init__(self, tag: Any, value: Any) -> None:
                self.tag, self.value = tag, value

        self.register_node(
            py_pytree,
            Tagged,
            lambda t: ([t.value], t.tag),
            lambda values, tag: Tagged(tag, *values),
            serialized_type_name="test_pytree_family_lazy.Tagged",
        )

        def spec_json(fqn: str) -> str:
            enum = {"__enum__": True, "fqn": fqn, "name": "RED"}
            leaf = {"type": None, "context": None, "children_spec": []}
            node = {
                "type": "test_pytree_family_lazy.Tagged",
                "context": json.dumps(enum),
                "children_spec": [leaf],
            }
            return json.dumps([1, node])

        self.register_family("familypkg.base:Base")  # a family package, too
        importlib.import_module("familypkg.base")
        for fqn in (
            "familypkg.enums:Color",  # not imported
            "familypkg.other:SIDE_EFFECT",  # not imported, not an enum
            "os:environ",  # imported, not an enum
            "familypkg.base:Base",  # imported, not an enum
            "enum:Enum.__getattr__",
            "not_a_module_anywhere:Color",
        ):
            before = set(sys.modules)
            with self.assertRaisesRegex(ValueError, "Import the module of enum"):
                py_pytree.treespec_loads(spec_json(fqn))
            self.assertEqual(set(sys.modules) - before, set(), fqn)
        from familypkg.enums import Color

        spec = py_pytree.treespec_loads(spec_json("familypkg.enums:Color"))
        self.assertIs(spec.context, Color.RED)
        self.assertIs(py_pytree.tree_unflatten([1], spec).tag, Color.RED)

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
