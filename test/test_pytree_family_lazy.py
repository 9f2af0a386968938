# Owner(s): ["module: pytree"]

"""Tests for lazy pytree families: ``register_pytree_family("package.module:ClassName")``.

A lazy family is registered by name, without importing its module; it takes
effect once a subclass of that class is looked up, and ``treespec_loads`` may
import a member's module only within the lazy family's package.
"""

import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

from test_pytree_family import _PYTREE_MODULES, FamilyPackageTestCase, FamilyTestCase

import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import run_tests


class TestPytreeFamilyLazyAPI(FamilyTestCase):
    def test_rejects_invalid_names(self) -> None:
        before = list(py_pytree._LAZY_PYTREE_FAMILIES)
        for bad in ("nocolon", "a.b:", ":Cls", "a-b:Cls", "a:B:C"):
            with self.assertRaisesRegex(ValueError, "Invalid pytree family"):
                py_pytree.register_pytree_family(bad)
            self.assertEqual(list(py_pytree._LAZY_PYTREE_FAMILIES), before)

    def test_double_registration(self) -> None:
        self.register_family("some_unimported_package.outputs:Out")
        with self.assertRaisesRegex(
            ValueError, "already registered as a pytree family"
        ):
            py_pytree.register_pytree_family("some_unimported_package.outputs:Out")
        self.assertNotIn("some_unimported_package", sys.modules)

    def test_deregister_unknown(self) -> None:
        with self.assertRaisesRegex(ValueError, "not registered as a pytree family"):
            py_pytree._deregister_pytree_family("nowhere.at_all:Cls")


class TestPytreeFamilyLazy(FamilyPackageTestCase):
    def test_lazy_registration_imports_nothing(self) -> None:
        self.register_family("familypkg.base:Base")
        self.assertNotIn("familypkg", sys.modules)
        from familypkg.outputs import Out

        leaves, spec = py_pytree.tree_flatten(Out(1, c=2))
        self.assertEqual(leaves, [1, 2])
        self.assertIs(spec.type, Out)

    def test_lazy_registration_of_imported_module_is_immediate(self) -> None:
        from familypkg.base import Base

        self.register_family("familypkg.base:Base")
        self.assertIn(Base, py_pytree._PYTREE_FAMILIES)

    def test_loads_imports_within_lazy_package(self) -> None:
        self.register_family("familypkg.base:Base")
        importlib.import_module("familypkg.base")
        self.assertNotIn("familypkg.outputs", sys.modules)
        spec = py_pytree.treespec_loads(self._spec_json("familypkg.outputs.Out"))
        out_cls = sys.modules["familypkg.outputs"].Out
        self.assertIs(spec.type, out_cls)
        self.assertEqual(py_pytree.tree_unflatten([1], spec), out_cls(1))
        nested = py_pytree.treespec_loads(
            self._spec_json("familypkg.outputs.Holder.Nested")
        )
        self.assertIs(nested.type, sys.modules["familypkg.outputs"].Holder.Nested)

    def _loads_new_modules(
        self, type_name: str, base_imported: bool = True
    ) -> set[str]:
        # The modules that a failing treespec_loads of `type_name` imported,
        # with or without the lazy family's own module imported before.
        self._forget_modules()
        if base_imported:
            importlib.import_module("familypkg.base")
        before = set(sys.modules)
        with self.assertRaisesRegex(NotImplementedError, "is not registered"):
            py_pytree.treespec_loads(self._spec_json(type_name))
        return set(sys.modules) - before

    def test_loads_refuses_non_members_and_imports_nothing(self) -> None:
        self.register_family("familypkg.base:Base")
        # Outside the lazy family's package: nothing is imported.
        for name in (
            "os.path.join",
            "json.decoder.JSONDecoder",  # an importable class, not a member
            "torch._inductor.config.Foo",
            "not_a_module_anywhere.Cls",
            "5",
            "familypkg",
        ):
            self.assertEqual(self._loads_new_modules(name), set(), name)
        # Inside it: at most the one module that the name points to, and
        # nothing at all while the family's own module is not imported (no
        # member can exist then).
        self.assertEqual(self._loads_new_modules("familypkg.base.Unrelated"), set())
        self.assertEqual(
            self._loads_new_modules("familypkg.other.SIDE_EFFECT"), {"familypkg.other"}
        )
        for name in ("familypkg.outputs.Out", "familypkg.other.X", "familypkg.Out"):
            self.assertEqual(
                self._loads_new_modules(name, base_imported=False), set(), name
            )
        # A module that does not exist: nothing.
        self.assertEqual(self._loads_new_modules("familypkg.missing.Out"), set())
        self.assertEqual(
            self._loads_new_modules("familypkg.base.Out.Inner.Deeper"), set()
        )
        # A module's __getattr__ (a lazy package) is never called.
        importlib.import_module("familypkg.lazy")
        before = set(sys.modules)
        with self.assertRaisesRegex(NotImplementedError, "is not registered"):
            py_pytree.treespec_loads(self._spec_json("familypkg.lazy.Foo"))
        self.assertEqual(set(sys.modules) - before, set())

    def test_loads_of_a_member_imports_only_its_module(self) -> None:
        self.register_family("familypkg.base:Base")
        self.assertEqual(
            self._loads_new_modules("familypkg.outputs.Nope"), {"familypkg.outputs"}
        )
        self._forget_modules()
        importlib.import_module("familypkg.base")
        before = set(sys.modules)
        spec = py_pytree.treespec_loads(self._spec_json("familypkg.outputs.Out"))
        self.assertEqual(set(sys.modules) - before, {"familypkg.outputs"})
        self.assertIs(spec.type, sys.modules["familypkg.outputs"].Out)

    def test_loads_refuses_non_string_type_names(self) -> None:
        self.register_family("familypkg.base:Base")
        for name in (5, None, True, 1.5, ["familypkg.outputs.Out"]):
            spec_json = self._spec_json("X").replace('"X"', json.dumps(name))
            for pytree in _PYTREE_MODULES:
                with self.assertRaisesRegex(NotImplementedError, "is not registered"):
                    pytree.treespec_loads(spec_json)
        long_name = "familypkg." + "a." * 5000 + "Out"
        with self.assertRaisesRegex(NotImplementedError, "is not registered"):
            py_pytree.treespec_loads(self._spec_json(long_name))

    def test_import_in_another_thread_does_not_deadlock(self) -> None:
        # One thread imports a module that registers a pytree node while it is
        # imported; others load a spec that needs that module and register a
        # lazy family meanwhile. The registry lock is never held across an
        # import, so all of them finish.
        self.register_family("familypkg.base:Base")
        errors: list[str] = []

        def run(fn: Any) -> None:
            try:
                fn()
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = [
            threading.Thread(
                target=run, args=(lambda: importlib.import_module("familypkg.slow"),)
            ),
            threading.Thread(
                target=run,
                args=(
                    lambda: py_pytree.treespec_loads(
                        self._spec_json("familypkg.slow.Slow")
                    ),
                ),
            ),
            threading.Thread(
                target=run,
                args=(lambda: self.register_family("familypkg.lazy2:Thing"),),
            ),
        ]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=30)
        self.assertFalse(any(t.is_alive() for t in threads), "deadlock")
        self.assertEqual(errors, [], "\n".join(errors))
        self.assertIs(
            py_pytree.treespec_loads(self._spec_json("familypkg.slow.Slow")).type,
            sys.modules["familypkg.slow"].Slow,
        )

    def test_loads_while_lazy_families_change(self) -> None:
        self.register_family("familypkg.base:Base")
        importlib.import_module("familypkg.outputs")
        deadline = time.monotonic() + 2.0
        errors: list[str] = []
        loads = [0]

        def toggle() -> None:
            while time.monotonic() < deadline:
                py_pytree.register_pytree_family("familypkg.other:Thing")
                py_pytree._deregister_pytree_family("familypkg.other:Thing")

        def load() -> None:
            spec_json = self._spec_json("familypkg.outputs.Out")
            while time.monotonic() < deadline:
                try:
                    spec = py_pytree.treespec_loads(spec_json)
                    if spec.type is not sys.modules["familypkg.outputs"].Out:
                        errors.append(f"loaded {spec.type}")
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                loads[0] += 1

        threads = [threading.Thread(target=toggle)] + [
            threading.Thread(target=load) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertEqual(errors[:3], [])
        self.assertGreater(loads[0], 100)

    def test_unpickled_spec_in_a_fresh_process(self) -> None:
        # The family is registered by importing its module; the member's
        # registration is derived when the unpickled spec needs it.
        with open(
            os.path.join(self.tmpdir.name, "familypkg", "registers.py"), "w"
        ) as f:
            f.write(
                textwrap.dedent(
                    """
                    import torch.utils._pytree as pt
                    from familypkg.outputs import Out
                    pt.register_pytree_family("familypkg.base:Base")
                    """
                )
            )
        from familypkg.outputs import Out

        self.register_family("familypkg.base:Base")
        leaves, spec = py_pytree.tree_flatten([Out(1, c=2)])
        script = textwrap.dedent(
            f"""
            import pickle, sys
            sys.path.insert(0, {self.tmpdir.name!r})
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
