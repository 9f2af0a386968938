# Owner(s): ["module: onnx"]
"""The dynamo ONNX exporter names graph inputs and outputs after their pytree key paths.

See ``torch/onnx/_internal/exporter/_pytree_io_names.py`` for the rule. Every
model is also run in onnxruntime, feeding the inputs and reading the outputs by
their names, and compared with eager.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import unittest
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_utils import run_tests, TestCase


_MISSING = [
    name
    for name in ("onnx", "onnxscript", "onnxruntime")
    if importlib.util.find_spec(name) is None
]


class _Point(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    extra: torch.Tensor | None = None


pytree.register_dataclass(_Output)


class _Pair:
    """A node registered without a flatten_with_keys_fn: its children are numbered."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first = first
        self.second = second


pytree.register_pytree_node(
    _Pair,
    lambda p: ([p.first, p.second], None),
    lambda children, _: _Pair(*children),
)


class _Lambda(torch.nn.Module):
    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.fn(*args, **kwargs)


class _TwoInputs(torch.nn.Module):
    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor]):
        return {"x": x * 2, "state": {"h": state["h"] + x, "c": state["c"] - 1}}


@unittest.skipIf(_MISSING, f"needs {', '.join(_MISSING)}")
class TestPytreeIONames(TestCase):
    def export(self, model, args, kwargs=None, **options):  # type: ignore[no-untyped-def]
        return torch.onnx.export(
            model.eval(), args, kwargs=kwargs, dynamo=True, verbose=False, **options
        )

    def names(self, onnx_program) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
        graph = onnx_program.model.graph
        return [v.name for v in graph.inputs], [v.name for v in graph.outputs]

    def run_ort(self, onnx_program, feeds: dict[str, torch.Tensor]) -> dict:  # type: ignore[no-untyped-def]
        import onnx
        import onnxruntime

        proto = onnx_program.model_proto
        onnx.checker.check_model(proto)
        session = onnxruntime.InferenceSession(
            proto.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in session.get_outputs()]
        results = session.run(
            names, {name: t.detach().numpy() for name, t in feeds.items()}
        )
        return {name: torch.from_numpy(r) for name, r in zip(names, results)}

    def assert_unique_value_names(self, onnx_program) -> None:  # type: ignore[no-untyped-def]
        graph = onnx_program.model.graph
        names = [v.name for v in graph.inputs]
        names += list(graph.initializers)
        names += [v.name for node in graph for v in node.outputs]
        self.assertEqual(len(names), len(set(names)), names)

    def check(  # type: ignore[no-untyped-def]
        self,
        model,
        args,
        kwargs,
        expected_inputs: dict[str, torch.Tensor],
        expected_outputs: list[str],
        **options,
    ):
        """Export, check the names, run by name in onnxruntime, compare with eager."""
        onnx_program = self.export(model, args, kwargs, **options)
        inputs, outputs = self.names(onnx_program)
        self.assertEqual(inputs, list(expected_inputs))
        self.assertEqual(outputs, expected_outputs)
        self.assert_unique_value_names(onnx_program)
        eager = pytree.tree_leaves(model(*args, **(kwargs or {})))
        eager = [t for t in eager if isinstance(t, torch.Tensor)]
        got = self.run_ort(onnx_program, expected_inputs)
        self.assertEqual(list(got), expected_outputs)
        for name, expected in zip(expected_outputs, eager, strict=True):
            torch.testing.assert_close(got[name], expected, msg=name)
        return onnx_program

    def test_dict_output_and_nested_inputs(self) -> None:
        x, h, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
        self.check(
            _TwoInputs(),
            (x,),
            {"state": {"h": h, "c": c}},
            {"x": x, "state.h": h, "state.c": c},
            # the names are taken by the inputs: the outputs get the next free ones
            ["x_1", "state.h_1", "state.c_1"],
        )

    def test_constant_outputs_are_left_out(self) -> None:
        # A returned pytree may hold constants of the program (e.g. the ints and
        # flags of a KV cache): they are not values of the ONNX graph.
        class Model(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> dict[str, object]:
                return {"y": x + 1, "window": 4, "updated": {0: True}}

        x = torch.randn(2, 3)
        self.check(Model(), (x,), None, {"x": x}, ["y"])

    def test_positional_nested_input(self) -> None:
        class Model(torch.nn.Module):
            def forward(self, state: dict[str, torch.Tensor], x: torch.Tensor):
                return {"h": state["h"] + x, "c": state["c"] - 1}

        x, h, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
        self.check(
            Model(),
            ({"h": h, "c": c}, x),
            None,
            {"state.h": h, "state.c": c, "x": x},
            ["h", "c"],
        )

    def test_var_positional_inputs(self) -> None:
        a, b = torch.randn(3), torch.randn(3)
        self.check(
            _Lambda(lambda p, q: p * q),
            (a, b),
            None,
            {"args_0": a, "args_1": b},
            ["output"],
        )

    def test_tuple_and_list_outputs(self) -> None:
        a = torch.randn(4)
        self.check(
            _Lambda(lambda t: (t + 1, [t * 2, (t - 1,)])),
            (a,),
            None,
            {"args_0": a},
            ["output.0", "output.1.0", "output.1.1.0"],
        )

    def test_namedtuple(self) -> None:
        x, y = torch.randn(3), torch.randn(3)
        self.check(
            _Lambda(lambda p: _Point(p.y * 2, p.x + p.y)),
            (_Point(x, y),),
            None,
            {"args_0.x": x, "args_0.y": y},
            ["x", "y"],
        )

    def test_dataclass_with_none_field(self) -> None:
        x = torch.randn(3)
        self.check(
            _Lambda(lambda t: {"out": _Output(t.sin()), "more": _Output(t, t.cos())}),
            (x,),
            None,
            {"args_0": x},
            # the returned input gets its own Identity output
            ["out.hidden", "more.hidden", "more.extra"],
        )

    def test_node_without_keys_is_numbered(self) -> None:
        x = torch.randn(3)
        self.check(
            _Lambda(lambda t: {"pair": _Pair(t + 1, t * 3)}),
            (x,),
            None,
            {"args_0": x},
            ["pair.0", "pair.1"],
        )

    def test_invalid_characters_and_collisions(self) -> None:
        x = torch.randn(3)

        def fn(t):  # type: ignore[no-untyped-def]
            return {
                "a.b": t + 1,  # "." separates components only: "a_b"
                "a b": t + 2,  # also "a_b": the second one is "a_b_1"
                "a": {"b": t + 3},  # "a.b"
                "": t + 4,  # an empty component is "_"
                "π/2": t + 5,  # non-ASCII too
                7: t + 6,  # non-string keys: str(key)
            }

        self.check(
            _Lambda(fn),
            (x,),
            None,
            {"args_0": x},
            ["a_b", "a_b_1", "a.b", "_", "__2", "7"],
        )

    def test_initializer_and_intermediate_names(self) -> None:
        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.randn(3))
                self.linear = torch.nn.Linear(3, 3)

            def forward(self, x):  # type: ignore[no-untyped-def]
                y = self.linear(x)
                # "weight" is an initializer: the output is "weight_1"; the
                # intermediate value named "linear" gives way to the output.
                return {"weight": x * self.weight, "linear": y * 2, "y": y}

        x = torch.randn(2, 3)
        onnx_program = self.check(
            Model().eval(), (x,), None, {"x": x}, ["weight_1", "linear", "y"]
        )
        self.assertIn("weight", onnx_program.model.graph.initializers)

    def test_returned_input_gets_its_own_name(self) -> None:
        x = torch.randn(3)
        self.check(
            _Lambda(lambda t: {"same": t, "again": t, "double": t * 2}),
            (x,),
            None,
            {"args_0": x},
            ["same", "again", "double"],
        )

    def test_caller_names_win(self) -> None:
        x, h, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
        model = _TwoInputs()
        args, kwargs = (x,), {"state": {"h": h, "c": c}}
        onnx_program = self.export(
            model,
            args,
            kwargs,
            input_names=["a", "b", "c"],
            output_names=["o", "p", "q"],
        )
        self.assertEqual(self.names(onnx_program), (["a", "b", "c"], ["o", "p", "q"]))
        # Fewer names than inputs or outputs: the rest are derived, and avoid
        # the names given.
        x = torch.randn(3)
        model = _Lambda(lambda t: {"a": t + 1, "b": t * 2})
        self.check(model, (x,), None, {"b": x}, ["a", "b_1"], input_names=["b"])
        self.check(model, (x,), None, {"args_0": x}, ["b", "b_1"], output_names=["b"])


if __name__ == "__main__":
    run_tests()
