# Owner(s): ["module: pytree"]

"""Tests for the pytree functions of transformers' KV caches (``torch.utils._pytree_hf_cache``).

They run without transformers: ``ModuleCache`` stands in for a ``Cache`` of transformers 4.36
to 4.5x, which is an ``nn.Module``. The real cache classes are covered by
test/export/test_export_hf_kv_cache.py.
"""

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


if py_pytree._cxx_pytree_dynamo_traceable:
    import torch.utils._cxx_pytree as cxx_pytree
else:
    cxx_pytree = None

skipIfNoCxxPytree = unittest.skipIf(cxx_pytree is None, "missing optree package")
pytree_impls = parametrize(
    "pytree",
    [
        subtest(py_pytree, name="py"),
        subtest(cxx_pytree, name="cxx", decorators=[skipIfNoCxxPytree]),
    ],
)


class FamilyTestCase(TestCase):
    def register_family(self, base: Any, **kwargs: Any) -> None:
        py_pytree.register_pytree_family(base, **kwargs)
        self.addCleanup(py_pytree._deregister_pytree_family, base)


class ModuleCache(torch.nn.Module):
    """A stand-in for transformers' ``Cache`` of 4.36 to 4.5x (an ``nn.Module``)."""

    def __init__(self) -> None:
        super().__init__()
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self._seen_tokens = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key_cache.append(key)
        self.value_cache.append(value)
        self._seen_tokens += key.shape[-2]


class TestPytreeCacheFunctions(FamilyTestCase):
    """The functions of ``torch.utils._pytree_hf_cache`` on a stand-in cache."""

    def setUp(self) -> None:
        super().setUp()
        from torch.utils import _pytree_hf_cache as hf_cache

        self.register_family(
            ModuleCache,
            flatten_fn=hf_cache.cache_flatten,
            unflatten_fn=hf_cache.cache_unflatten,
            flatten_with_keys_fn=hf_cache.cache_flatten_with_keys,
        )

    def _cache(self) -> ModuleCache:
        cache = ModuleCache()
        cache.update(torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
        cache.register_buffer("position", torch.arange(3))
        cache.register_buffer("scratch", torch.ones(2), persistent=False)
        cache.eval()
        return cache

    @pytree_impls
    def test_module_cache_round_trip(self, pytree: Any) -> None:
        cache = self._cache()
        leaves, spec = pytree.tree_flatten(cache)
        self.assertEqual(len(leaves), 4)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), ModuleCache)
        self.assertFalse(rebuilt.training)
        self.assertEqual(rebuilt._seen_tokens, 3)
        self.assertEqual(rebuilt.key_cache, cache.key_cache)
        self.assertEqual(rebuilt.position, cache.position)
        self.assertEqual(list(rebuilt.state_dict()), ["position"])
        self.assertEqual(rebuilt.scratch, torch.ones(2))
        mapped = pytree.tree_map(lambda t: t + 1, cache)
        self.assertEqual(mapped.value_cache[0], torch.ones(1, 2, 3, 4))
        self.assertEqual(mapped.position, torch.arange(1, 4))
        if pytree is py_pytree:
            spec2 = py_pytree.treespec_loads(py_pytree.treespec_dumps(spec))
            self.assertEqual(spec2, spec)
            paths = [
                py_pytree.keystr(p)
                for p, _ in py_pytree.tree_flatten_with_path(cache)[0]
            ]
            self.assertEqual(
                paths, [".position", ".scratch", ".key_cache[0]", ".value_cache[0]"]
            )

    def test_module_cache_with_parameters_or_hooks_is_refused(self) -> None:
        with_parameter = self._cache()
        with_parameter.weight = torch.nn.Parameter(torch.ones(1))
        with self.assertRaisesRegex(TypeError, "registered parameters .weight."):
            py_pytree.tree_flatten(with_parameter)
        with_hook = self._cache()
        with_hook.register_forward_hook(lambda *args: None)
        with self.assertRaisesRegex(TypeError, "a cache with _forward_hooks"):
            py_pytree.tree_flatten(with_hook)


instantiate_parametrized_tests(TestPytreeCacheFunctions)


if __name__ == "__main__":
    run_tests()
