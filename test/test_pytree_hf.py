# Owner(s): ["module: pytree"]

"""The output classes of HuggingFace transformers and diffusers are pytree
families that torch registers at its boundaries (export, load, DDP) once the
library is imported: importing torch imports and hooks nothing, and their classes
(and users' subclasses of them) are then pytree nodes."""

import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from typing import Any

import torch
import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    TestCase,
)


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
pytree_modules = [subtest(py_pytree, name="py")]
if py_pytree._cxx_pytree_dynamo_traceable:
    import torch.utils._cxx_pytree as cxx_pytree

    pytree_modules.append(subtest(cxx_pytree, name="cxx"))


def run_python(script: str) -> Any:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def fast_tokenizer() -> Any:
    """A fast tokenizer of four words, built here: nothing is downloaded."""
    from tokenizers import models, pre_tokenizers, Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]"
    )


class TestPytreeHF(TestCase):
    def setUp(self) -> None:
        super().setUp()
        py_pytree._update_pytree_families()  # as an export or a load does

    def test_import_torch_imports_and_hooks_nothing(self) -> None:
        # Nothing of the families runs at import: no module of theirs, nothing in
        # sys.meta_path, and a stub module (as test suites make for optional
        # dependencies) is not looked at.
        result = run_python(
            """
            import json, sys, types
            sys.modules["diffusers"] = types.ModuleType("diffusers")
            meta_path = [type(f).__name__ for f in sys.meta_path]
            import torch
            import torch.utils._pytree as pytree
            result = {
                "meta_path": [type(f).__name__ for f in sys.meta_path] == meta_path,
                "modules": [
                    m for m in sys.modules
                    if m.split(".")[0] == "transformers" or m == "torch.utils._pytree_hf"
                ],
            }
            pytree._update_pytree_families()  # a boundary, with the stub
            print(json.dumps(result))
            """
        )
        self.assertEqual(result, {"meta_path": True, "modules": []})

    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    def test_families_of_imported_libraries_at_a_boundary(self) -> None:
        # Registered where torch needs them, from what is imported, writing
        # nothing onto transformers' classes.
        result = run_python(
            """
            import json
            import torch, transformers
            import torch.utils._pytree as pytree
            from transformers import BatchEncoding
            from transformers.utils import ModelOutput

            classes = [ModelOutput, BatchEncoding]
            if hasattr(transformers, "DynamicCache"):  # transformers >= 4.36
                classes.append(transformers.cache_utils.Cache)
            before = [dict(vars(cls)) for cls in classes]
            leaf = pytree.tree_is_leaf(BatchEncoding({"a": torch.ones(1)}))
            pytree._update_pytree_families()
            print(json.dumps({
                "untouched": [dict(vars(cls)) for cls in classes] == before,
                "leaf before": leaf,
                "families": sorted(
                    c.__name__ for c in classes if c in pytree._PYTREE_FAMILIES
                ),
                "node after": not pytree.tree_is_leaf(BatchEncoding({"a": torch.ones(1)})),
            }))
            """
        )
        expected = ["BatchEncoding", "ModelOutput"]
        if hasattr(importlib.import_module("transformers"), "DynamicCache") and hasattr(
            importlib.import_module("torch.utils._pytree_hf"), "CACHE_BASES"
        ):  # the caches' patch, which follows this test's
            expected.insert(1, "Cache")
        self.assertEqual(
            result,
            {
                "untouched": True,
                "leaf before": True,
                "families": expected,
                "node after": True,
            },
        )

    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    @parametrize("pytree", pytree_modules)
    def test_model_output_subclass(self, pytree: Any) -> None:
        from transformers.utils import ModelOutput

        @dataclasses.dataclass
        class MyOutput(ModelOutput):
            logits: torch.Tensor | None = None
            hidden: tuple[torch.Tensor, ...] | None = None

        py_pytree._update_pytree_families()  # transformers 4.31 does not register it
        out = MyOutput(logits=torch.ones(2), hidden=(torch.zeros(1),))
        leaves, spec = pytree.tree_flatten(out)
        self.assertEqual(len(leaves), 2)
        rebuilt = pytree.tree_unflatten([leaf + 1 for leaf in leaves], spec)
        self.assertIs(type(rebuilt), MyOutput)
        self.assertEqual(list(rebuilt.keys()), ["logits", "hidden"])
        self.assertEqual(rebuilt.logits, torch.full((2,), 2.0))

    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    def test_spec_loads_in_a_fresh_process(self) -> None:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        out = BaseModelOutputWithPast(last_hidden_state=torch.ones(1))
        py_pytree._update_pytree_families()  # as export does (transformers < 4.32)
        dumped = py_pytree.treespec_dumps(py_pytree.tree_structure(out))
        result = run_python(
            f"""
            import json
            import torch, transformers
            import torch.utils._pytree as pytree
            spec = pytree.treespec_loads({dumped!r})
            print(json.dumps([spec.type.__module__, spec.type.__name__]))
            """
        )
        self.assertEqual(
            result, ["transformers.modeling_outputs", "BaseModelOutputWithPast"]
        )

    def test_loading_imports_only_modules_of_the_libraries(self) -> None:
        # A spec being loaded may import a module of transformers' or diffusers'
        # own package, once the package is imported (here a stand-in package of
        # that name), and nothing else; whatever that module raises, Ctrl-C
        # included, is an ImportError that names it.
        with tempfile.TemporaryDirectory() as root:
            for package in ("transformers", "mylib"):
                os.makedirs(os.path.join(root, package))
                for module, text in (
                    ("__init__", ""),
                    ("ran", "import sys; sys.ran = True\n"),
                    ("interrupted", "raise KeyboardInterrupt\n"),
                ):
                    path = os.path.join(root, package, f"{module}.py")
                    with open(path, "w") as f:
                        f.write(text)
            result = run_python(
                f"""
                import json, sys
                sys.path.insert(0, {root!r})
                import torch, transformers, mylib
                import torch.utils._pytree as pytree

                def load(name):
                    spec = pytree.treespec_dumps(pytree.tree_structure((1,)))
                    try:
                        pytree.treespec_loads(spec.replace("builtins.tuple", name))
                    except BaseException as e:
                        return type(e).__name__, str(e)

                print(json.dumps({{
                    name: load(name) + (hasattr(sys, "ran"),)
                    for name in (
                        "mylib.ran.Out", "transformers.ran.Out",
                        "transformers.interrupted.Out",
                    )
                }}))
                """
            )
        self.assertEqual(result["mylib.ran.Out"][0], "NotImplementedError")
        self.assertFalse(result["mylib.ran.Out"][2])  # not imported
        self.assertEqual(result["transformers.ran.Out"][0], "NotImplementedError")
        self.assertTrue(result["transformers.ran.Out"][2])  # imported: no such class
        self.assertEqual(
            result["transformers.interrupted.Out"][:2],
            [
                "ImportError",
                "Importing transformers.interrupted to load "
                "transformers.interrupted.Out failed: KeyboardInterrupt()",
            ],
        )

    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    @parametrize("pytree", pytree_modules)
    def test_batch_encoding_and_feature(self, pytree: Any) -> None:
        # UserDicts (mappings, not dicts) of the tokenizers and processors
        from transformers import BatchEncoding, BatchFeature

        classes = [BatchEncoding, BatchFeature]
        # a BatchFeature subclass in the transformers versions that have it (not 4.31)
        if importlib.util.find_spec("transformers.image_processing_base") is not None:
            import transformers.image_processing_base as image_processing_base

            classes.append(image_processing_base.BatchFeature)

        class MyEncoding(BatchEncoding):  # a user subclass, defined late
            pass

        py_pytree._update_pytree_families()

        ids, mask = torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3)
        for cls in [*classes, MyEncoding]:
            with self.subTest(cls=cls.__qualname__):
                obj = cls({"input_ids": ids, "extra": [mask, None]})
                self.assertFalse(pytree.tree_is_leaf(obj))
                leaves, spec = pytree.tree_flatten(obj)
                self.assertEqual(len(leaves), 3)
                self.assertIs(leaves[0], ids)
                rebuilt = pytree.tree_unflatten(leaves, spec)
                self.assertIs(type(rebuilt), cls)
                self.assertEqual(list(rebuilt.keys()), ["input_ids", "extra"])
                self.assertIs(rebuilt["extra"][0], mask)
                mapped = pytree.tree_map_only(torch.Tensor, lambda t: t * 2, obj)
                self.assertIs(type(mapped), cls)
                self.assertEqual(mapped.input_ids, ids * 2)

    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    @parametrize("pytree", pytree_modules)
    def test_fast_tokenizer_output_keeps_its_encodings(self, pytree: Any) -> None:
        # tree_map over a fast tokenizer's output maps its tensors and keeps
        # everything else it holds: word_ids() needs the encodings.
        tokenizer = fast_tokenizer()
        batch = tokenizer(["hello world", "world"], padding=True, return_tensors="pt")
        mapped = pytree.tree_map_only(torch.Tensor, lambda t: t * 2, batch)
        self.assertIs(type(mapped), type(batch))
        self.assertEqual(mapped["input_ids"], batch["input_ids"] * 2)
        self.assertTrue(mapped.is_fast)
        self.assertEqual(mapped.word_ids(1), batch.word_ids(1))
        self.assertEqual(vars(mapped).keys(), vars(batch).keys())
        # The encodings are state, not structure: another output of the same
        # keys has an equal spec, and the spec serializes without them; a
        # loaded spec rebuilds the object its constructor makes from the items.
        other = tokenizer(["world"], padding=True, return_tensors="pt")
        spec = py_pytree.tree_structure(batch)
        self.assertEqual(spec, py_pytree.tree_structure(other))
        self.assertEqual(hash(spec), hash(py_pytree.tree_structure(other)))
        loaded = py_pytree.treespec_loads(py_pytree.treespec_dumps(spec))
        self.assertEqual(loaded, spec)
        rebuilt = py_pytree.tree_unflatten(py_pytree.tree_leaves(batch), loaded)
        self.assertIs(type(rebuilt), type(batch))
        self.assertIsNone(rebuilt.encodings)
        self.assertIs(rebuilt["input_ids"], batch["input_ids"])

    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    def test_batch_encoding_and_feature_key_paths(self) -> None:
        from transformers import BatchEncoding, BatchFeature

        for cls in (BatchEncoding, BatchFeature):
            obj = cls({"input_ids": torch.ones(1), "pixel_values": (torch.zeros(1),)})
            pairs, _ = py_pytree.tree_flatten_with_path(obj)
            self.assertEqual(
                [path for path, _ in pairs],
                [
                    (py_pytree.MappingKey("input_ids"),),
                    (py_pytree.MappingKey("pixel_values"), py_pytree.SequenceKey(0)),
                ],
            )
            for path, leaf in pairs:
                self.assertIs(py_pytree.key_get(obj, path), leaf)


instantiate_parametrized_tests(TestPytreeHF)


if __name__ == "__main__":
    run_tests()
