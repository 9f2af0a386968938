# Owner(s): ["module: pytree"]

"""Loading a serialized TreeSpec imports nothing.

The enums and the defaultdict factories in a serialized context resolve only
to what modules that are already imported hold; a spec that names anything
else is refused with an error that names the module to import.
"""

import os
import sys
import tempfile
import textwrap
from collections import defaultdict
from typing import Any

import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import run_tests, TestCase


FILES = {
    "__init__.py": "",
    "things.py": """
        import enum

        class Color(enum.Enum):
            RED = 1

        class Counter(int):
            pass
        """,
    # Its module-level __getattr__ would import things.py.
    "lazy.py": """
        def __getattr__(name):
            import loadpkg.things
            return getattr(loadpkg.things, name)
        """,
}


class TestLoadImportsNothing(TestCase):
    def setUp(self) -> None:
        super().setUp()
        tmpdir = tempfile.TemporaryDirectory()
        self.addCleanup(tmpdir.cleanup)
        os.makedirs(os.path.join(tmpdir.name, "loadpkg"))
        for name, text in FILES.items():
            with open(os.path.join(tmpdir.name, "loadpkg", name), "w") as f:
                f.write(textwrap.dedent(text))
        sys.path.insert(0, tmpdir.name)
        self.addCleanup(sys.path.remove, tmpdir.name)
        self.addCleanup(self.forget_modules)

    def forget_modules(self) -> None:
        for name in [m for m in sys.modules if m.partition(".")[0] == "loadpkg"]:
            del sys.modules[name]
        py_pytree.treespec_loads.cache_clear()

    def dumped(self, tree: Any) -> str:
        # Dump with the module imported, then forget it, as a fresh process would.
        dumped = py_pytree.treespec_dumps(py_pytree.tree_structure(tree))
        self.forget_modules()
        return dumped

    def assertRefused(self, dumped: str, module: str, what: str) -> None:
        with self.assertRaisesRegex(
            ValueError,
            rf"Import {module} before loading: it has the {what} \(loading a spec "
            r"imports nothing\)\.",
        ):
            py_pytree.treespec_loads(dumped)
        self.assertNotIn("loadpkg.things", sys.modules)

    def test_enum_of_a_module_not_imported(self) -> None:
        from loadpkg.things import Color

        dumped = self.dumped({Color.RED: 1})
        self.assertRefused(dumped, "loadpkg.things", "enum 'Color'")
        import loadpkg.things

        spec = py_pytree.treespec_loads(dumped)
        self.assertEqual(spec.context, [loadpkg.things.Color.RED])

    def test_defaultdict_factory_of_a_module_not_imported(self) -> None:
        from loadpkg.things import Counter

        dumped = self.dumped(defaultdict(Counter, a=1))
        self.assertRefused(
            dumped, "loadpkg.things", "default_factory 'Counter' of a defaultdict"
        )
        import loadpkg.things

        spec = py_pytree.treespec_loads(dumped)
        self.assertIs(spec.context[0], loadpkg.things.Counter)
        self.assertEqual(
            py_pytree.tree_unflatten([2], spec),
            defaultdict(loadpkg.things.Counter, a=2),
        )

    def test_names_are_looked_up_without_import(self) -> None:
        # A module's __getattr__ is not called, and what a name finds must be an
        # enum (for an enum) or callable (for a factory).
        from loadpkg.things import Color, Counter

        enum_spec = self.dumped({Color.RED: 1})
        factory_spec = self.dumped(defaultdict(Counter))
        import loadpkg.lazy  # noqa: F401

        for module, name in (("loadpkg.lazy", "Color"), ("os", "sep")):
            self.assertRefused(
                enum_spec.replace("loadpkg.things:Color", f"{module}:{name}"),
                module,
                f"enum {name!r}",
            )
        self.assertRefused(
            factory_spec.replace('"loadpkg.things"', '"loadpkg.lazy"'),
            "loadpkg.lazy",
            "default_factory 'Counter' of a defaultdict",
        )

    def test_builtin_factories_load(self) -> None:
        dumped = py_pytree.treespec_dumps(py_pytree.tree_structure(defaultdict(list)))
        self.assertIs(py_pytree.treespec_loads(dumped).context[0], list)


if __name__ == "__main__":
    run_tests()
