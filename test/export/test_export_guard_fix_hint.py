# Owner(s): ["oncall: export"]

"""The message of an ep.module() guard that fails on an input that export took
as a constant of the example names the fix: dynamic_shapes."""

import dataclasses

import torch
import torch.utils._pytree as pytree
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


class LayerStep(torch.nn.Module):
    def forward(self, x: torch.Tensor, layer: Layer) -> tuple[torch.Tensor, Layer]:
        keys = torch.cat([layer.keys, x])
        return keys.sum(0) * layer.length, Layer(keys, layer.length + 1)


def _x() -> torch.Tensor:
    return torch.randn(1, 4)


class TestGuardMessage(TestCase):
    @parametrize("strict", [True, False])
    def test_constant_names_the_fix(self, strict: bool) -> None:
        layer = Layer(torch.randn(3, 4), 3)
        module = export(LayerStep(), (_x(), layer), strict=strict).module()
        # the guard, then how to let the input vary
        hint = r" \(.*dynamic_shapes, e\.g\. Dim\.AUTO, lets it vary\)$"
        with self.assertRaisesRegex(
            AssertionError, r"^Guard failed: layer\.keys\.size\(\)\[0\] == 3" + hint
        ):
            module(_x(), Layer(torch.randn(4, 4), 3))
        with self.assertRaisesRegex(
            AssertionError, r"^Guard failed: layer\.length == 3" + hint
        ):
            module(_x(), Layer(torch.randn(3, 4), 4))

    @parametrize("strict", [True, False])
    def test_size_of_one_names_backed_size_oblivious(self, strict: bool) -> None:
        # Dim.AUTO does not keep a size of 1 in the example dynamic
        layer, shapes = Layer(torch.randn(1, 4), 1), (None, [{0: Dim.AUTO}, Dim.AUTO])
        module = export(
            LayerStep(), (_x(), layer), dynamic_shapes=shapes, strict=strict
        ).module()
        with self.assertRaisesRegex(
            AssertionError,
            r"^Guard failed: layer\.keys\.size\(\)\[0\] == 1 \(.*lets it vary; a size "
            r"of 0 or 1 only under torch\.fx\.experimental\._config\.patch\("
            r"backed_size_oblivious=True\)\)$",
        ):
            module(_x(), Layer(torch.randn(2, 4), 2))
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            module = export(
                LayerStep(), (_x(), layer), dynamic_shapes=shapes, strict=strict
            ).module()
        x, later = _x(), Layer(torch.randn(2, 4), 2)  # the next step: one key more
        self.assertEqual(module(x, later)[0], LayerStep()(x, later)[0])

    @parametrize("strict", [True, False])
    def test_range_has_no_hint(self, strict: bool) -> None:
        class M(torch.nn.Module):
            def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
                return x + n

        module = export(
            M(),
            (torch.ones(3), 2),
            dynamic_shapes={"x": {0: Dim("n", max=8)}, "n": None},
            strict=strict,
        ).module()
        self.assertEqual(module(torch.ones(8), 2), torch.full((8,), 3.0))
        with self.assertRaises(AssertionError) as cm:
            module(torch.ones(9), 2)
        self.assertExpectedInline(
            str(cm.exception), """Guard failed: x.size()[0] <= 8"""
        )
        # in the same program, the unmarked int has the hint
        with self.assertRaisesRegex(AssertionError, r"n == 2 \(.*e\.g\. Dim\.AUTO"):
            module(torch.ones(8), 3)


class TestGuardMessageRule(TestCase):
    def test_only_an_input_equal_to_an_int_has_the_hint(self) -> None:
        from torch.export._unlift import _convert_guards_code_to_fn

        paths = [
            (pytree.MappingKey("x"),),
            (pytree.MappingKey("n"),),
            (pytree.MappingKey("d"), pytree.MappingKey("max len")),
        ]
        hint = " (fixed at export: dynamic_shapes, e.g. Dim.AUTO, lets it vary)"
        oblivious = (
            "; a size of 0 or 1 only under"
            " torch.fx.experimental._config.patch(backed_size_oblivious=True))"
        )
        for guard, message in (
            ("L['x'].size()[0] == 4", "x.size()[0] == 4" + hint),
            ("L['x'].size()[0] == 1", "x.size()[0] == 1" + hint[:-1] + oblivious),
            ("L['n'] == 1", "n == 1" + hint),
            ("L['x'].size()[0] == 10", "x.size()[0] == 10" + hint),
            ("L['n'] == 2", "n == 2" + hint),
            ("L['d']['max len'] == 2", "d['max len'] == 2" + hint),
            ("L['x'].size()[0] % 2 == 0", "x.size()[0] % 2 == 0"),
            ("2 * L['n'] == 4", "2 * L['n'] == 4".replace("L['n']", "n")),
            ("L['x'].size()[0] == L['n']", "x.size()[0] == n"),
            ("L['x'].size()[0] <= 8", "x.size()[0] <= 8"),
        ):
            fn = _convert_guards_code_to_fn([guard], paths)
            with self.assertRaises(AssertionError) as cm:
                fn(torch.ones(9), 3, 3)
            self.assertEqual(str(cm.exception), f"Guard failed: {message}")


instantiate_parametrized_tests(TestGuardMessage)


if __name__ == "__main__":
    run_tests()
