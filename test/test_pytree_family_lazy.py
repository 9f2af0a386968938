# Owner(s): ["module: pytree"]

"""Tests for lazy pytree families: ``register_pytree_family("package.module:Class")``.

A family registered by name is resolved where torch needs its families, at its
boundaries (export, load, DDP; ``_update_pytree_families()`` here), once its
module has been imported. Nothing watches imports: registering imports nothing
and hooks nothing, and a name that can no longer name a class is reported at the
next boundary. Loading a spec imports no module of the package either.
"""

import importlib
import importlib.machinery
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
from typing import Any

from test_pytree_family import _PYTREE_MODULES, boundary, FamilyTestCase

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
        "notdata.py": """
            class NotData:
                pass
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
        # A typo in the package: refused at once.
        with self.assertRaisesRegex(
            ValueError,
            r"No package 'familypgk' is installed, for 'familypgk.base:Base'\.",
        ):
            py_pytree.register_pytree_family("familypgk.base:Base")
        self.register_family("familypkg.outputs:Out")
        with self.assertRaisesRegex(
            ValueError, "already registered as a pytree family"
        ):
            py_pytree.register_pytree_family("familypkg.outputs:Out")
        self.assertNotIn("familypkg", sys.modules)
        with self.assertRaisesRegex(ValueError, "not registered as a pytree family"):
            py_pytree._deregister_pytree_family("nowhere.at_all:Cls")

    def test_registration_imports_and_hooks_nothing(self) -> None:
        meta_path = list(sys.meta_path)
        self.register_family("familypkg.base:Base")
        self.assertEqual(sys.meta_path, meta_path)
        self.assertNotIn("familypkg", sys.modules)
        from familypkg.base import Base
        from familypkg.outputs import Out

        self.assertEqual(sys.meta_path, meta_path)
        self.assertNotIn("__init_subclass__", vars(Base))
        self.assertTrue(py_pytree.tree_is_leaf(Out(1)))  # until a boundary
        boundary()
        for pytree in _PYTREE_MODULES:  # the C++ pytree knows the member too
            leaves, spec = pytree.tree_flatten([Out(1, c=2)])
            self.assertEqual(leaves, [1, 2])
            self.assertEqual(pytree.tree_unflatten([3, 4], spec), [Out(3, c=4)])
        self.assertEqual(py_pytree.tree_structure(Out(1)).type, Out)
        self.assertIn(Base, py_pytree._PYTREE_FAMILIES)

    def test_a_typo_is_reported_at_the_next_boundary(self) -> None:
        # Once its package is imported, a name that cannot name a class is
        # dropped with a warning that names it; other exports go on.
        for name, error in (
            ("familypkg.base:Bsae", r"familypkg.base has no class 'Bsae'"),
            ("familypkg.bsae:Base", r"there is no module familypkg.bsae"),
        ):
            py_pytree.register_pytree_family(name)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                boundary()  # familypkg is not imported: nothing to tell yet
            importlib.import_module("familypkg.base")
            with self.assertWarnsRegex(
                UserWarning,
                rf"register_pytree_family\('{name}'\) has no effect: {error}\.",
            ):
                boundary()
            self.assertNotIn(name, py_pytree._PYTREE_FAMILIES)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                boundary()  # reported once
            self.forget_modules()

    def test_registration_errors_never_raise_inside_an_import(self) -> None:
        py_pytree.register_pytree_family("familypkg.notdata:NotData")  # dropped below
        module = importlib.import_module("familypkg.notdata")  # imports as usual
        self.assertEqual(module.NotData.__name__, "NotData")
        with self.assertWarnsRegex(
            UserWarning,
            r"register_pytree_family\('familypkg.notdata:NotData'\) has no effect: "
            r"familypkg.notdata.NotData is neither a dataclass nor a mapping; "
            r"decorate it with @dataclasses.dataclass, or pass flatten_fn and "
            r"unflatten_fn\.$",
        ):
            boundary()

    def test_a_finder_ahead_of_torch(self) -> None:
        # Import hooks (typeguard, beartype, jaxtyping) that find modules with
        # PathFinder from sys.meta_path[0] change nothing.
        class Finder:
            @staticmethod
            def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
                return importlib.machinery.PathFinder.find_spec(name, path, target)

        sys.meta_path.insert(0, Finder)
        self.addCleanup(sys.meta_path.remove, Finder)
        self.register_family("familypkg.base:Base")
        from familypkg.outputs import Out

        boundary()
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(Out(1, c=2)), [1, 2])

    def test_registered_while_another_thread_imports(self) -> None:
        for i in range(300):
            self.write(
                f"racy{i}.py",
                "import dataclasses, time\n"
                "time.sleep(0.0005)\n"
                "@dataclasses.dataclass\nclass Base:\n    a: object\n",
            )
        for i in range(300):
            name = f"familypkg.racy{i}:Base"
            importer = threading.Thread(
                target=importlib.import_module, args=(f"familypkg.racy{i}",)
            )
            registrar = threading.Thread(target=self.register_family, args=(name,))
            importer.start()
            registrar.start()
            importer.join()
            registrar.join()
            boundary()
            base = sys.modules[f"familypkg.racy{i}"].Base
            self.assertEqual(py_pytree.tree_leaves(base(i)), [i], name)

    def test_loads_imports_nothing(self) -> None:
        self.register_family("familypkg.base:Base")
        importlib.import_module("familypkg.base")
        for name in (
            "familypkg.outputs.Out",  # a member's module, not imported
            "familypkg.other.SIDE_EFFECT",
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

    def test_loads_a_member_created_since_the_last_boundary(self) -> None:
        self.register_family("familypkg.base:Base")
        outputs = importlib.import_module("familypkg.outputs")
        spec = py_pytree.treespec_loads(self.spec_json("familypkg.outputs.Out"))
        self.assertIs(spec.type, outputs.Out)
        self.assertEqual(py_pytree.tree_unflatten([1], spec), outputs.Out(1))
        nested = py_pytree.treespec_loads(
            self.spec_json("familypkg.outputs.Holder.Nested")
        )
        self.assertIs(nested.type, outputs.Holder.Nested)

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
                "Import familypkg.outputs before loading: the class must be "
                "registered first.",
            ),
            (
                "__main__.Out",
                "Define the class in a module, and import it before loading.",
            ),
        ):
            message = loads_error(type_name)
            self.assertTrue(message.startswith(f"Deserializing {type_name} "), message)
            self.assertTrue(message.endswith(f". {fix}"), message)
        self.assertFalse(loads_error(5).endswith("first."))  # not a class name

    def test_module_half_imported_when_registered(self) -> None:
        # A module that registers its own families by name before it defines
        # their classes: they are resolved at the next boundary.
        self.write(
            "selfreg.py",
            """
            import dataclasses
            import torch.utils._pytree as pt
            pt.register_pytree_family("familypkg.selfreg:Base")
            pt.register_pytree_family("familypkg.selfreg:Other")  # a second one

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

        boundary()
        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten([Sub(1, 2), Other(5)])
            self.assertEqual(leaves, [1, 2, 5])
            self.assertEqual(
                pytree.tree_unflatten([3, 4, 6], spec), [Sub(3, 4), Other(6)]
            )

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
        boundary()  # the module exists: not a typo
        base = importlib.import_module("familypkg.flaky").Base
        boundary()
        self.assertEqual(py_pytree.tree_leaves(base(1)), [1])

    def test_unpickled_spec_in_a_fresh_process(self) -> None:
        with open(os.path.join(self.root, "familypkg", "registers.py"), "w") as f:
            f.write(
                "import torch.utils._pytree as pt\n"
                'pt.register_pytree_family("familypkg.base:Base")\n'
            )
        from familypkg.outputs import Out

        self.register_family("familypkg.base:Base")
        boundary()
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
