# Owner(s): ["oncall: export"]

"""Runtime guards of an unlifted exported program on inputs whose key paths
extend one another (``counts.n`` and ``counts.n_int``)."""

import dataclasses

import torch
from torch.export import Dim, export
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


@dataclasses.dataclass
class Counts:
    n: int
    n_int: int


torch.export.register_dataclass(
    Counts, serialized_type_name="test_guard_key_paths.Counts"
)


class TestGuardKeyPaths(TestCase):
    @parametrize("strict", [False, True])
    def test_path_that_extends_another(self, strict: bool) -> None:
        class M(torch.nn.Module):
            def forward(self, x: torch.Tensor, counts: Counts) -> torch.Tensor:
                if counts.n_int > 3:
                    return x + counts.n + counts.n_int
                return x

        ep = export(
            M(),
            (torch.ones(2), Counts(2, 5)),
            dynamic_shapes={"x": None, "counts": [Dim.DYNAMIC, Dim.DYNAMIC]},
            strict=strict,
        )
        module = ep.module()  # generated the guard code "args[1]_int >= 4"
        self.assertEqual(module(torch.ones(2), Counts(3, 4)), torch.full((2,), 8.0))
        with self.assertRaisesRegex(
            AssertionError, r"Guard failed: counts\.n_int >= 4"
        ):
            module(torch.ones(2), Counts(2, 1))


instantiate_parametrized_tests(TestGuardKeyPaths)


if __name__ == "__main__":
    run_tests()
