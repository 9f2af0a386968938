# Owner(s): ["module: pytree"]

"""Tests for the pytree functions of KV caches (in ``torch.utils._pytree_hf``).

They need no transformers: stand-in cache and layer classes, shaped like those
of transformers, are registered as pytree families with these functions. The
real caches are tested in test/extended/test_export_hf_kv_cache.py.
"""

import copy
import json
import math
import pprint
import sys
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
from torch.utils import _pytree_hf as hf


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

FUNCTIONS = hf._CACHE  # the functions of transformers' cache families


class Layer:
    """A stand-in for a transformers cache layer: keys and values grow."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def update(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if not self.is_initialized:
            self.keys, self.values = key[:, :, :0], value[:, :, :0]
            self.is_initialized, self.device = True, key.device
        self.keys = torch.cat([self.keys, key], dim=2)
        self.values = torch.cat([self.values, value], dim=2)


class SlidingLayer(Layer):
    """Keeps the last ``sliding_window`` tokens and counts all of them."""

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.cumulative_length = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> None:
        super().update(key, value)
        self.cumulative_length += key.shape[2]
        self.keys = self.keys[:, :, -self.sliding_window :]
        self.values = self.values[:, :, -self.sliding_window :]


class StateLayer:
    """Like transformers' linear-attention layers: states in dicts."""

    def __init__(self, number_of_states: int = 1) -> None:
        self.number_of_states = number_of_states
        self.conv_states = dict.fromkeys(range(number_of_states))
        self.has_previous_state = dict.fromkeys(range(number_of_states), False)
        self.dtype = torch.float32

    def update(self, state: torch.Tensor, idx: int = 0) -> None:
        self.conv_states[idx] = state
        self.has_previous_state[idx] = True


class Cache:
    """A stand-in for transformers' ``Cache``: a list of layers, and settings."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self.layer_class_to_replicate: type | None = None
        self.offloading = False


class CompressedCache(Cache):
    """Holds a list of tensors and a dict of counters, like MiniMax and DeepseekV4."""

    def __init__(self, layers: list[Any]) -> None:
        super().__init__(layers)
        self.linear_cache: list[Any] = []
        self.entry_count = {"compressor": 0}
        self.settings = {0: (1.5, "mean"), 1: [{torch.device("cpu")}, torch.int8]}


class ModuleCache(torch.nn.Module):
    """A stand-in for transformers' ``Cache`` of 4.36 to 4.5x, an ``nn.Module``."""

    def __init__(self) -> None:
        super().__init__()
        self.key_cache: list[torch.Tensor] = []
        self._seen_tokens = 0

    def update(self, key: torch.Tensor) -> None:
        self.key_cache.append(key)
        self._seen_tokens += key.shape[-2]


def kv(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4)


class TestPytreeHFCache(TestCase):
    def setUp(self) -> None:
        super().setUp()
        for base in (Cache, Layer, StateLayer, ModuleCache):
            py_pytree.register_pytree_family(base, **FUNCTIONS)
            self.addCleanup(py_pytree._deregister_pytree_family, base)

    def cache(self) -> CompressedCache:
        cache = CompressedCache([Layer(), SlidingLayer(sliding_window=3), StateLayer()])
        cache.layer_class_to_replicate = Layer
        for _ in range(2):  # a prefill of 4 tokens, then one step
            for layer in cache.layers[:2]:
                layer.update(*kv(4))
        cache.layers[2].update(torch.randn(1, 8, 4))
        cache.linear_cache = [torch.randn(1, 4), []]
        cache.entry_count["compressor"] += 1
        return cache

    def test_spec(self) -> None:
        def nodes(spec: py_pytree.TreeSpec) -> list[Any]:
            # (type, context) of each node, depth first
            if spec.is_leaf():
                return []
            children = [n for child in spec.children() for n in nodes(child)]
            return [(spec.type.__name__, spec.context), *children]

        spec = py_pytree.tree_structure(self.cache())
        self.assertExpectedInline(
            pprint.pformat(nodes(spec), width=80).replace(f"{__name__}.", ""),
            """\
[('CompressedCache',
  ['layers',
   ('layer_class_to_replicate', <class 'Layer'>),
   ('offloading', False),
   'linear_cache',
   'entry_count',
   ('settings', {0: (1.5, 'mean'), 1: [{device(type='cpu')}, torch.int8]})]),
 ('list', None),
 ('Layer',
  ['keys', 'values', ('is_initialized', True), ('device', device(type='cpu'))]),
 ('SlidingLayer',
  ['keys',
   'values',
   ('is_initialized', True),
   'sliding_window',
   'cumulative_length',
   ('device', device(type='cpu'))]),
 ('StateLayer',
  ['number_of_states',
   'conv_states',
   ('has_previous_state', {0: True}),
   ('dtype', torch.float32)]),
 ('dict', [0]),
 ('list', None),
 ('list', None),
 ('dict', ['compressor'])]""",
        )

    @pytree_impls
    def test_leaves_are_tensors_and_counters(self, pytree: Any) -> None:
        cache = self.cache()
        leaves = pytree.tree_leaves(cache)
        expected = [
            *(cache.layers[0].keys, cache.layers[0].values),
            *(cache.layers[1].keys, cache.layers[1].values),
            3,  # sliding_window: an int, as the counters are
            8,  # cumulative_length
            1,  # number_of_states
            cache.layers[2].conv_states[0],
            cache.linear_cache[0],
            1,  # entry_count["compressor"]
        ]
        self.assertEqual(len(leaves), len(expected))
        for leaf, want in zip(leaves, expected):
            if isinstance(want, torch.Tensor):
                self.assertIs(leaf, want)
            else:
                self.assertEqual(leaf, want)

    def test_key_paths(self) -> None:
        paths = [
            py_pytree.keystr(path)
            for path, _ in py_pytree.tree_flatten_with_path(self.cache())[0]
        ]
        self.assertExpectedInline(
            "\n".join(paths),
            """\
.layers[0].keys
.layers[0].values
.layers[1].keys
.layers[1].values
.layers[1].sliding_window
.layers[1].cumulative_length
.layers[2].number_of_states
.layers[2].conv_states[0]
.linear_cache[0]
.entry_count['compressor']""",
        )

    @pytree_impls
    def test_round_trip(self, pytree: Any) -> None:
        cache = self.cache()
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), CompressedCache)
        self.assertEqual(pytree.tree_structure(rebuilt), spec)
        self.assertEqual(
            [type(layer) for layer in rebuilt.layers],
            [Layer, SlidingLayer, StateLayer],
        )
        for new, old in zip(rebuilt.layers, cache.layers):
            self.assertEqual(list(vars(new)), list(vars(old)))
        self.assertIs(rebuilt.layers[0].keys, cache.layers[0].keys)
        self.assertIs(rebuilt.layer_class_to_replicate, Layer)
        self.assertEqual(rebuilt.settings, cache.settings)
        # settings are copied: updating a rebuilt cache leaves the spec alone
        rebuilt.settings[1].append(None)
        rebuilt.layers[2].has_previous_state[0] = False
        self.assertEqual(pytree.tree_structure(self.cache()), spec)

    @pytree_impls
    def test_spec_is_the_same_after_a_step(self, pytree: Any) -> None:
        cache = self.cache()
        spec = pytree.tree_structure(cache)
        for layer in cache.layers[:2]:
            layer.update(*kv(1))
        cache.entry_count["compressor"] += 1
        self.assertEqual(pytree.tree_structure(cache), spec)
        self.assertEqual(pytree.tree_leaves(cache)[5], 9)  # cumulative_length

    @pytree_impls
    def test_tree_map(self, pytree: Any) -> None:
        cache = self.cache()
        zeros = pytree.tree_map(
            lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, cache
        )
        self.assertEqual(zeros.layers[2].conv_states[0], torch.zeros(1, 8, 4))
        self.assertEqual(zeros.linear_cache[1], [])
        self.assertEqual(zeros.layers[1].cumulative_length, 8)

    def test_dumps_loads(self) -> None:
        spec = py_pytree.tree_structure(self.cache())
        dumped = py_pytree.treespec_dumps(spec)
        self.assertEqual(py_pytree.treespec_loads(dumped), spec)
        context = json.loads(json.loads(dumped)[1]["context"])
        self.assertExpectedInline(
            json.dumps(context).replace(__name__, "test"),
            """\
["layers", ["layer_class_to_replicate", {"class": "test.Layer"}], ["offloading", false], \
"linear_cache", "entry_count", ["settings", {"dict": [[0, {"tuple": [1.5, "mean"]}], \
[1, [{"set": [{"device": "cpu"}]}, {"dtype": "int8"}]]]}]]""",
        )

    @pytree_impls
    @parametrize(
        "context",
        [
            '[["__class__", 1]]',  # a dunder attribute
            '[["x.y", 1]]',  # not an identifier
            '[["x", {"class": "builtins.dict"}]]',  # a node class, not a family member
            '[["x", {"class": "json.tool.main"}]]',  # a module that is not imported
            '[["x", {"dtype": "_inductor"}]]',  # not a dtype
            '[["x", {"dtype": ["float32"]}]]',
            '[["x", {"device": "nowhere"}]]',
            '[["x", {"__enum__": true, "fqn": "json.tool:X", "name": "A"}]]',
            '[["x", {"dict": [[[0], 1]]}]]',  # an unhashable key
            '[["x", NaN]]',
            '[["x", 1, 2]]',
            '{"x": 1}',
        ],
    )
    def test_crafted_context_is_refused(self, pytree: Any, context: str) -> None:
        spec = json.loads(py_pytree.treespec_dumps(py_pytree.tree_structure(Cache([]))))
        spec[1]["context"] = context
        modules = set(sys.modules)
        with self.assertRaisesRegex(ValueError, "invalid"):
            pytree.treespec_loads(json.dumps(spec))
        self.assertEqual(set(sys.modules) - modules, set())

    @pytree_impls
    def test_rules_follow_what_an_attribute_holds(self, pytree: Any) -> None:
        # Not its name: an int is a child, a string named like a counter a
        # setting, a dict of flags by layer a setting, a dict of counters a child.
        cache = Cache([])
        cache.step, cache.counter_kind, cache.ready = 3, "seen", {0: True, 1: False}
        cache.counts = {"compressor": 7}
        leaves, spec = pytree.tree_flatten(cache)
        self.assertEqual(leaves, [3, 7])
        rebuilt = pytree.tree_unflatten([4, 8], spec)
        self.assertEqual((rebuilt.step, rebuilt.counter_kind), (4, "seen"))
        self.assertEqual(
            (rebuilt.ready, rebuilt.counts), (cache.ready, {"compressor": 8})
        )
        self.assertIsNot(rebuilt.ready, cache.ready)

    @parametrize(
        "value",
        [
            subtest(object(), name="object"),
            subtest(len, name="callable"),
            subtest(int, name="class"),
            subtest(math.nan, name="nan"),
        ],
    )
    def test_other_values_are_children(self, value: Any) -> None:
        # e.g. the stream of an offloaded cache: a leaf, so that tree_map
        # returns a cache that has it, and the spec still serializes.
        cache = Cache([Layer()])
        cache.stream = value
        for pytree in [py_pytree] + ([cxx_pytree] if cxx_pytree else []):
            leaves, spec = pytree.tree_flatten(cache)
            self.assertIs(leaves[-1], value)
            mapped = pytree.tree_map(lambda x: x, cache)
            self.assertIs(mapped.stream, value)
            self.assertIs(type(mapped.layers[0]), Layer)
        spec = py_pytree.tree_structure(cache)
        self.assertEqual(py_pytree.treespec_loads(py_pytree.treespec_dumps(spec)), spec)

    @pytree_impls
    def test_a_stream_is_carried_state(self, pytree: Any) -> None:
        # The stream of an offloaded cache: the rebuilt cache gets it back, but
        # it is no leaf (tree_map does not see it) and not in the spec, which
        # equals that of a cache with another stream and serializes.
        cache, other = Cache([Layer()]), Cache([Layer()])
        cache.stream, other.stream = torch.Stream(device="cpu"), torch.Event()
        leaves, spec = pytree.tree_flatten(cache)
        self.assertEqual(leaves, [])
        self.assertIs(pytree.tree_unflatten(leaves, spec).stream, cache.stream)
        self.assertIs(pytree.tree_map(lambda x: x, cache).stream, cache.stream)
        self.assertEqual(spec, pytree.tree_structure(other))
        py_spec = py_pytree.tree_structure(cache)
        loaded = py_pytree.treespec_loads(py_pytree.treespec_dumps(py_spec))
        self.assertEqual(loaded, py_spec)
        self.assertFalse(hasattr(py_pytree.tree_unflatten([], loaded), "stream"))

    @parametrize("strict", [False, True])
    def test_export_decode_step(self, strict: bool) -> None:
        class Step(torch.nn.Module):
            def forward(self, key: torch.Tensor, cache: CompressedCache) -> Any:
                for layer in cache.layers[:2]:
                    layer.update(key, key)
                cache.layers[2].update(cache.layers[2].conv_states[0] + 1)
                cache.entry_count["compressor"] += 1
                return key.sum() + cache.layers[1].keys.sum(), cache

        def step(key: torch.Tensor, cache: CompressedCache) -> Any:
            return Step()(key, copy.deepcopy(cache))

        keys = [kv(1)[0] for _ in range(4)]
        cache = self.cache()
        shapes = torch.export.AdditionalInputs()
        shapes.add((keys[1], step(keys[0], cache)[1]))
        ep = torch.export.export(
            Step(),
            (keys[0], copy.deepcopy(cache)),
            dynamic_shapes=shapes,
            strict=strict,
        )
        for key in keys:
            expected = step(key, cache)
            got = ep.module()(key, copy.deepcopy(cache))
            self.assertEqual(
                py_pytree.tree_structure(got), py_pytree.tree_structure(expected)
            )
            self.assertEqual(
                py_pytree.tree_leaves(got), py_pytree.tree_leaves(expected)
            )
            cache = got[1]

    def module_cache(self) -> ModuleCache:
        cache = ModuleCache()
        cache.update(torch.ones(1, 2, 3, 4))
        cache.register_buffer("position", torch.arange(3))
        cache.register_buffer("scratch", torch.ones(2), persistent=False)
        return cache.eval()

    @pytree_impls
    def test_module_cache(self, pytree: Any) -> None:
        cache = self.module_cache()
        leaves, spec = pytree.tree_flatten(cache)
        self.assertEqual(len(leaves), 4)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), ModuleCache)
        self.assertFalse(rebuilt.training)
        self.assertEqual(rebuilt._seen_tokens, 3)
        self.assertIs(rebuilt.key_cache[0], cache.key_cache[0])
        self.assertEqual(list(rebuilt.state_dict()), ["position"])
        self.assertEqual(rebuilt.scratch, torch.ones(2))
        mapped = pytree.tree_map(lambda t: t + 1, cache)
        self.assertEqual(mapped.position, torch.arange(1, 4))
        self.assertEqual(mapped._seen_tokens, 4)  # ints are leaves too
        if pytree is py_pytree:
            self.assertEqual(
                py_pytree.treespec_loads(py_pytree.treespec_dumps(spec)), spec
            )
            self.assertEqual(
                [
                    py_pytree.keystr(p)
                    for p, _ in py_pytree.tree_leaves_with_path(cache)
                ],
                [
                    "._buffers['position']",
                    "._buffers['scratch']",
                    ".key_cache[0]",
                    "._seen_tokens",
                ],
            )

    def test_module_cache_with_parameters_or_hooks_raises(self) -> None:
        with_parameter = self.module_cache()
        with_parameter.weight = torch.nn.Parameter(torch.ones(1))
        with self.assertRaisesRegex(
            TypeError, r"parameters, submodules or hooks \(_parameters\)"
        ):
            py_pytree.tree_flatten(with_parameter)
        with_hook = self.module_cache()
        with_hook.register_forward_hook(lambda *args: None)
        with self.assertRaisesRegex(TypeError, r"\(_forward_hooks\)"):
            py_pytree.tree_flatten(with_hook)


instantiate_parametrized_tests(TestPytreeHFCache)


if __name__ == "__main__":
    run_tests()
