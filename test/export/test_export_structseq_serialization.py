# Owner(s): ["oncall: export"]
"""Structseq outputs (``torch.return_types``) in saved specs and programs.

Each ``torch.return_types`` class is registered with the pytree under its own
name, ``torch.return_types.<name>``, so a spec that holds one serializes, and
an exported program that returns one saves and loads back the same class.
"""

import io

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


_OPS = {
    "max": lambda x: torch.max(x, dim=0),
    "topk": lambda x: torch.topk(x, 2),
    "sort": lambda x: torch.sort(x, dim=1),
    "aminmax": lambda x: torch.aminmax(x),
}


class _Returns(torch.nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _OPS[self.op](x)


class TestStructseqSerialization(TestCase):
    @parametrize("op", list(_OPS))
    def test_treespec_round_trip(self, op: str) -> None:
        out = _OPS[op](torch.randn(3, 4))
        spec = pytree.tree_structure(out)
        dumped = pytree.treespec_dumps(spec)
        self.assertIn(f'"type": "torch.return_types.{op}"', dumped)
        loaded = pytree.treespec_loads(dumped)
        self.assertEqual(loaded, spec)
        self.assertIs(loaded.type, type(out))

    @parametrize("op", list(_OPS))
    def test_export_save_load(self, op: str) -> None:
        x = torch.randn(3, 4)
        buffer = io.BytesIO()
        torch.export.save(torch.export.export(_Returns(op), (x,)), buffer)
        buffer.seek(0)
        actual = torch.export.load(buffer).module()(x)
        expected = _OPS[op](x)
        self.assertIs(type(actual), type(expected))
        self.assertEqual(tuple(actual), tuple(expected))


instantiate_parametrized_tests(TestStructseqSerialization)

if __name__ == "__main__":
    run_tests()
