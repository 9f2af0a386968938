# Owner(s): ["oncall: export"]

"""The message of an ep.module() guard that fails on an input that export took
as a constant of the example names the fix: dynamic_shapes. In eager it gives
the values of the guard's inputs, in this call and at export, and says when the
model's own code fixed them, where dynamic_shapes cannot help."""

import dataclasses
import io

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


# the end of the message of a guard that the model's code made
BRANCH = (
    "a branch (a counter reaching a sliding window, say) needs one program per side"
)


@dataclasses.dataclass
class Window:
    keys: torch.Tensor  # dim 0 grows by one per step
    length: int  # increments per step
    window: int  # a setting: the length past which the step takes the other branch


pytree.register_dataclass(
    Window, serialized_type_name="test_export_guard_fix_hint.Window"
)


class WindowStep(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: Window) -> torch.Tensor:
        if w.length < w.window:  # a branch on two inputs
            return torch.cat([w.keys, x]).sum(0)
        return w.keys.sum(0)


class Branch(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        if n == 6:  # fixes n even when dynamic_shapes lets it vary
            return x * 2
        return x + n


class Plain(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x + n


def _saved_and_loaded(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


class TestGuardValues(TestCase):
    def _message(self, module: torch.nn.Module, *args: object) -> str:
        with self.assertRaises(AssertionError) as cm:
            module(*args)
        return str(cm.exception)

    @parametrize("strict", [True, False])
    def test_a_constant_of_the_example(self, strict: bool) -> None:
        ep = export(Plain(), (torch.ones(3), 2), strict=strict)
        for module in (ep.module(), _saved_and_loaded(ep).module()):
            self.assertEqual(
                self._message(module, torch.ones(3), 3),
                "Guard failed: n == 2 (3 in this call; fixed at export: "
                "dynamic_shapes, e.g. Dim.AUTO, lets it vary)",
            )

    @parametrize("strict", [True, False])
    def test_a_constant_of_the_model_code(self, strict: bool) -> None:
        # Dim.AUTO lets n vary; the model's code fixes it: no dynamic_shapes hint
        ep = export(
            Branch(),
            (torch.ones(3), 6),
            dynamic_shapes={"x": None, "n": Dim.AUTO},
            strict=strict,
        )
        for module in (ep.module(), _saved_and_loaded(ep).module()):
            self.assertEqual(
                self._message(module, torch.ones(3), 7),
                "Guard failed: n == 6 (7 in this call; the model's code fixed it at "
                f"export, even with dynamic_shapes: {BRANCH})",
            )

    def test_a_relation_of_two_inputs(self) -> None:
        # non-strict: strict export takes the ints of a dataclass as constants
        w = Window(torch.randn(3, 4), 3, 5)
        shapes = (None, Window({0: Dim.AUTO}, Dim.AUTO, Dim.AUTO))
        ep = export(WindowStep(), (torch.randn(1, 4), w), dynamic_shapes=shapes)
        w.length = 9  # the example changed after export: not a value at export
        for module in (ep.module(), _saved_and_loaded(ep).module()):
            x, later = torch.randn(1, 4), Window(torch.randn(4, 4), 4, 5)
            self.assertEqual(module(x, later), WindowStep()(x, later))
            self.assertEqual(
                self._message(module, x, Window(torch.randn(5, 4), 5, 5)),
                "Guard failed: w.length < w.window\n"
                "  w.length: 5 in this call, 3 at export\n"
                "  w.window: 5 in this call and at export\n"
                f"The model's code required this of its inputs at export; {BRANCH}.",
            )

    @parametrize("strict", [True, False])
    def test_a_traced_program_keeps_its_guards(self, strict: bool) -> None:
        # the guards traced again by export: a failing call still fails
        ep = export(Plain(), (torch.ones(3), 2), strict=strict)
        again = export(ep.module(), (torch.ones(3), 2), strict=strict).module()
        self.assertEqual(again(torch.ones(3), 2), torch.full((3,), 3.0))
        self.assertRegex(
            self._message(again, torch.ones(3), 3), r"^Guard failed: n == 2"
        )


instantiate_parametrized_tests(TestGuardMessage)
instantiate_parametrized_tests(TestGuardValues)


if __name__ == "__main__":
    run_tests()
