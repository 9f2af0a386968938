# Owner(s): ["oncall: export"]

"""torch.export.save and load of a program that calls a custom autograd
Function through flat_apply (what export emits for an ``apply`` marked with
allow_in_pre_dispatch_graph, as the vmapped indexing in transformers' mask code
is); the call imports nothing a file names, and nothing else is saved."""

import io
import sys

import torch
from torch._export.serde.serialize import GraphModuleSerializer, SerializeError
from torch._export.wrappers import allow_in_pre_dispatch_graph
from torch._higher_order_ops.flat_apply import _ConstantFunction
from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.utils import _pytree as pytree


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factors: list[torch.Tensor]) -> torch.Tensor:
        return x * factors[0] + factors[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None

    @classmethod
    @allow_in_pre_dispatch_graph
    def apply(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().apply(*args, **kwargs)


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(x, [x.sum(), torch.ones(3)]) + 1


def flat_apply_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return list(
        ep.graph.find_nodes(
            op="call_function", target=torch.ops.higher_order.flat_apply
        )
    )


class TestExportSaveAutogradFunction(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.x = torch.arange(3.0)
        self.ep = torch.export.export(Model(), (self.x,))

    def test_save_and_load(self) -> None:
        self.assertEqual(len(flat_apply_nodes(self.ep)), 1)
        buffer = io.BytesIO()
        torch.export.save(self.ep, buffer)
        loaded = torch.export.load(buffer)
        (node,) = flat_apply_nodes(loaded)
        func_spec, in_spec = (
            getattr(loaded.graph_module, a.target) for a in node.args[:2]
        )
        self.assertEqual(
            func_spec, self.spec_of(_call_custom_autograd_function_in_pre_dispatch)
        )
        self.assertEqual(
            in_spec,
            getattr(self.ep.graph_module, flat_apply_nodes(self.ep)[0].args[1].target),
        )
        self.assertEqual(loaded.module()(self.x), Model()(self.x))
        self.assertEqual(loaded.module()(self.x + 2), Model()(self.x + 2))

    def test_a_call_imports_nothing_and_runs_only_autograd_functions(self) -> None:
        name = f"{__name__}.Scale"
        x, factors = self.x, [torch.tensor(2.0), torch.ones(3)]
        self.assertEqual(
            _call_custom_autograd_function_in_pre_dispatch(name, x, factors),
            Scale.apply(x, factors),
        )
        self.assertNotIn("antigravity", sys.modules)
        for name, message in (
            (
                "antigravity.Fly",
                "antigravity.Fly is not an autograd Function: import antigravity first.",
            ),
            ("os.system", "os.system is not an autograd Function."),
        ):
            with (
                self.subTest(name=name),
                self.assertRaisesRegex(RuntimeError, f"^{message}$"),
            ):
                _call_custom_autograd_function_in_pre_dispatch(name, "echo")
        self.assertNotIn("antigravity", sys.modules)

    def test_only_calls_of_autograd_functions_are_saved(self) -> None:
        node = flat_apply_nodes(self.ep)[0]
        setattr(self.ep.graph_module, node.args[0].target, self.spec_of(print))
        with self.assertRaisesRegex(
            SerializeError,
            "Cannot save flat_apply of <built-in function print>: only calls of "
            "custom autograd Functions are saved.",
        ):
            torch.export.save(self.ep, io.BytesIO())

    def test_a_spec_is_saved_only_as_an_argument_of_flat_apply(self) -> None:
        # Any other get_attr of a TreeSpec is refused, as before: only the
        # flat_apply branch of the loader makes specs again.
        node = flat_apply_nodes(self.ep)[0]
        serializer = GraphModuleSerializer(
            self.ep.graph_signature, self.ep.module_call_graph
        )
        with self.assertRaisesRegex(
            SerializeError, "Unsupported getattr attribute .*TreeSpec"
        ):
            serializer.serialize_input(node.args[1])

    @staticmethod
    def spec_of(func: object) -> pytree.TreeSpec:
        return pytree.tree_structure(_ConstantFunction(func))


if __name__ == "__main__":
    run_tests()
