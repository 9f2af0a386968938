# Owner(s): ["oncall: export"]

"""The dynamic_shapes of an object of a class registered with pytree, e.g. a KV
cache: one ``Dim`` hint (``Dim.AUTO``, ``Dim.DYNAMIC``, ``Dim.STATIC``) for all of
it, or an object of its class that holds the shapes (as ``tree_map`` over the
input makes one), as well as the shapes of its flattened children."""

import copy
import dataclasses

import torch
import torch.utils._pytree as pytree
from torch._dynamo.exc import UserError
from torch.export import Dim, export
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


@dataclasses.dataclass
class Layer:
    keys: torch.Tensor  # dim 0 grows by one per step
    length: int  # increments per step


pytree.register_dataclass(Layer)


class Cache:
    def __init__(self, layers: list[Layer], steps: int) -> None:
        self.layers = layers
        self.steps = steps


pytree.register_pytree_node(
    Cache,
    lambda c: ([c.layers, c.steps], None),
    lambda children, _: Cache(*children),
    flatten_with_keys_fn=lambda c: (
        [
            (pytree.GetAttrKey("layers"), c.layers),
            (pytree.GetAttrKey("steps"), c.steps),
        ],
        None,
    ),
)


class DecodeStep(torch.nn.Module):
    """Appends ``x`` to the keys of each layer and counts the step."""

    def forward(self, x: torch.Tensor, cache: Cache) -> tuple[torch.Tensor, Cache]:
        out = x.sum(0)
        layers = []
        for layer in cache.layers:
            keys = torch.cat([layer.keys, x])
            out = out + keys.sum(0) * layer.length
            layers.append(Layer(keys, layer.length + 1))
        return out * cache.steps, Cache(layers, cache.steps + 1)


class LayerStep(torch.nn.Module):
    def forward(self, x: torch.Tensor, layer: Layer) -> tuple[torch.Tensor, Layer]:
        keys = torch.cat([layer.keys, x])
        return keys.sum(0) * layer.length, Layer(keys, layer.length + 1)


@dataclasses.dataclass
class Attention:
    keys: torch.Tensor
    scale: float
    causal: bool
    name: str
    mask: torch.Tensor | None = None


pytree.register_dataclass(Attention)


def _cache() -> Cache:
    # distinct lengths and counters, so that no two inputs share a symbol
    return Cache([Layer(torch.randn(3, 4), 3), Layer(torch.randn(5, 4), 7)], 11)


def _x() -> torch.Tensor:
    return torch.randn(1, 4)


def _symbolic_inputs(ep: torch.export.ExportedProgram) -> dict[str, bool]:
    """For each user input: is it (an int) or its dim 0 (a tensor) symbolic?"""
    result = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in ep.graph_signature.user_inputs:
            val = node.meta["val"]
            size = val.shape[0] if isinstance(val, torch.Tensor) else val
            result[node.name] = isinstance(size, torch.SymInt)
    return result


class TestDimHintForPytreeNode(TestCase):
    @parametrize("strict", [True, False])
    def test_auto(self, strict: bool) -> None:
        cache = _cache()
        ep = export(
            DecodeStep(),
            (_x(), copy.deepcopy(cache)),
            dynamic_shapes={"x": None, "cache": Dim.AUTO},
            strict=strict,
        )
        # every counter and every length, through the list and the nested class
        self.assertEqual(
            _symbolic_inputs(ep),
            {
                "x": False,
                "cache_layers_0_keys": True,
                "cache_layers_0_length": True,
                "cache_layers_1_keys": True,
                "cache_layers_1_length": True,
                "cache_steps": True,
            },
        )
        module = ep.module()
        expected_cache = got_cache = cache
        for _ in range(4):
            x = _x()
            expected, expected_cache = DecodeStep()(x, expected_cache)
            got, got_cache = module(x, got_cache)
            self.assertEqual(got, expected)
            self.assertEqual(
                pytree.tree_leaves(got_cache), pytree.tree_leaves(expected_cache)
            )
        self.assertEqual(got_cache.steps, 15)
        self.assertEqual(got_cache.layers[1].keys.shape, (9, 4))

    @parametrize("strict", [True, False])
    def test_auto_for_a_dataclass(self, strict: bool) -> None:
        layer = Layer(torch.randn(3, 4), 3)
        ep = export(
            LayerStep(),
            (_x(), layer),
            dynamic_shapes={"x": None, "layer": Dim.AUTO},
            strict=strict,
        )
        self.assertEqual(
            _symbolic_inputs(ep),
            {"x": False, "layer_keys": True, "layer_length": True},
        )
        x, grown = _x(), Layer(torch.randn(6, 4), 6)
        got, got_layer = ep.module()(x, grown)
        expected, expected_layer = LayerStep()(x, grown)
        self.assertEqual(got, expected)
        self.assertEqual(got_layer.keys, expected_layer.keys)
        self.assertEqual(got_layer.length, 7)

    @parametrize("strict", [True, False])
    def test_auto_skips_other_leaves(self, strict: bool) -> None:
        # a float, a bool, a str and None take no hint
        class M(torch.nn.Module):
            def forward(self, attention: Attention) -> torch.Tensor:
                return attention.keys * attention.scale

        attention = Attention(torch.randn(3, 4), 0.5, True, "attn")
        ep = export(M(), (attention,), dynamic_shapes=(Dim.AUTO,), strict=strict)
        self.assertEqual(_symbolic_inputs(ep), {"attention_keys": True})
        attention.keys = torch.randn(5, 4)
        self.assertEqual(ep.module()(attention), attention.keys * 0.5)

    @parametrize("strict", [True, False])
    def test_static(self, strict: bool) -> None:
        cache = _cache()
        ep = export(
            DecodeStep(),
            (_x(), copy.deepcopy(cache)),
            dynamic_shapes={"x": None, "cache": Dim.STATIC},
            strict=strict,
        )
        self.assertEqual(ep.range_constraints, {})
        self.assertFalse(any(_symbolic_inputs(ep).values()))
        module = ep.module()
        x = _x()
        self.assertEqual(module(x, copy.deepcopy(cache))[0], DecodeStep()(x, cache)[0])
        grown = copy.deepcopy(cache)
        grown.layers[1].keys = torch.randn(6, 4)
        with self.assertRaisesRegex(
            AssertionError,
            r"Guard failed: cache\.layers\[1\]\.keys\.size\(\)\[0\] == 5",
        ):
            module(x, grown)
        counted = copy.deepcopy(cache)
        counted.steps = 12
        with self.assertRaisesRegex(
            AssertionError, r"Guard failed: cache\.steps == 11"
        ):
            module(x, counted)

    @parametrize("strict", [True, False])
    def test_a_mirror_of_the_input(self, strict: bool) -> None:
        # tree_map over the input, as users write dynamic shapes: the same as
        # the children's shapes, and as Dim.AUTO here.
        cache = _cache()

        def shape(value: object) -> object:
            return {0: Dim.AUTO} if isinstance(value, torch.Tensor) else Dim.AUTO

        mirror = pytree.tree_map(shape, cache)
        children = [[[{0: Dim.AUTO}, Dim.AUTO]] * 2, Dim.AUTO]
        programs = [
            export(
                DecodeStep(),
                (_x(), copy.deepcopy(cache)),
                dynamic_shapes={"x": None, "cache": shapes},
                strict=strict,
            )
            for shapes in (mirror, children, Dim.AUTO)
        ]
        symbolic = [_symbolic_inputs(ep) for ep in programs]
        self.assertEqual(symbolic[0], symbolic[1])
        self.assertEqual(symbolic[0], symbolic[2])
        self.assertEqual([name for name, sym in symbolic[0].items() if not sym], ["x"])
        # a mirror without a shape for the counter: that one is static
        del mirror.steps
        ep = export(
            DecodeStep(),
            (_x(), copy.deepcopy(cache)),
            dynamic_shapes={"x": None, "cache": mirror},
            strict=strict,
        )
        symbolic = _symbolic_inputs(ep)
        self.assertNotIn("cache_steps", symbolic)  # a constant of the program
        self.assertEqual([name for name, sym in symbolic.items() if not sym], ["x"])

    @parametrize("strict", [True, False])
    def test_dynamic_specialized(self, strict: bool) -> None:
        # torch.cat with x (1, 4) makes dim 1 of the keys the constant 4
        with self.assertRaisesRegex(
            UserError,
            r"(?s)Constraints violated.*"
            r"You marked L\['cache'\]\.layers\[0\]\.keys\.size\(\)\[1\] as dynamic",
        ):
            export(
                DecodeStep(),
                (_x(), _cache()),
                dynamic_shapes={"x": None, "cache": Dim.DYNAMIC},
                strict=strict,
            )


instantiate_parametrized_tests(TestDimHintForPytreeNode)


if __name__ == "__main__":
    run_tests()
