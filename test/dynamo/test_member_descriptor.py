# Owner(s): ["module: dynamo"]

"""Tracing ``member_descriptor.__set__``: storing a ``__slots__`` field through
its descriptor, which bypasses a ``__setattr__`` override of the class (as
``object.__setattr__`` does). ``torch.utils._pytree.TreeSpec.__init__`` stores
its fields that way, so every pytree flattened in compiled code goes through it
(``test_compile_fullgraph`` in ``test/test_pytree_fast_path.py``).
"""

import dataclasses
import unittest
from typing import Any

import torch
import torch._dynamo.test_case
from torch._dynamo.testing import CompileCounter
from torch.testing._internal.common_utils import skipIfTorchDynamo


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenPoint:
    x: Any
    y: Any


# The bound setters of the two slots, as `TreeSpec.__init__` uses them.
_set_x = vars(FrozenPoint)["x"].__set__
_set_y = vars(FrozenPoint)["y"].__set__


class Unrelated:
    pass


# 2.13 traces the setters with the backport; 2.14 and later with their own tracing,
# which stores only on objects made in the graph, as TreeSpec.__init__ does.
only_backport = unittest.skipUnless(
    torch.__version__.startswith("2.13."), "2.14 and later trace __set__ themselves"
)


class MemberDescriptorSetTests(torch._dynamo.test_case.TestCase):
    @skipIfTorchDynamo("counts its own compiled frames: a compiled test inlines them")
    def test_set_on_object_created_in_graph(self) -> None:
        def fn(t: torch.Tensor) -> torch.Tensor:
            p = object.__new__(FrozenPoint)
            _set_x(p, t + 1)
            _set_y(p, t * 2)
            return p.x * p.y

        cnt = CompileCounter()
        t = torch.randn(3)
        self.assertEqual(torch.compile(fn, backend=cnt, fullgraph=True)(t), fn(t))
        self.assertEqual(cnt.frame_count, 1)

    def test_set_through_descriptor_attribute(self) -> None:
        # `FrozenPoint.x.__set__(...)` written out, not bound beforehand.
        def fn(t: torch.Tensor) -> torch.Tensor:
            p = object.__new__(FrozenPoint)
            FrozenPoint.x.__set__(p, t - 1)  # type: ignore[misc]
            FrozenPoint.y.__set__(p, t)  # type: ignore[misc]
            return p.x + p.y

        t = torch.randn(3)
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        self.assertEqual(compiled(t), 2 * t - 1)

    @only_backport
    def test_set_on_existing_object_is_applied(self) -> None:
        def fn(p: FrozenPoint, t: torch.Tensor) -> torch.Tensor:
            _set_x(p, t * 3)
            return p.x + p.y

        p = FrozenPoint(0, torch.ones(2))
        t = torch.randn(2)
        out = torch.compile(fn, backend="eager", fullgraph=True)(p, t)
        self.assertEqual(out, t * 3 + 1)
        # The store is replayed on the real object after the graph ran.
        self.assertEqual(p.x, t * 3)
        with self.assertRaises(dataclasses.FrozenInstanceError):
            p.x = 1  # type: ignore[misc]

    @only_backport
    def test_set_on_wrong_type_raises_like_eager(self) -> None:
        def fn(obj: Any, t: torch.Tensor) -> torch.Tensor:
            _set_x(obj, t)
            return t + 1

        t = torch.randn(2)
        with self.assertRaisesRegex(TypeError, "doesn't apply to a 'Unrelated' object"):
            fn(Unrelated(), t)
        # Not traced (a graph break): the call runs in eager and raises the same.
        with self.assertRaisesRegex(TypeError, "doesn't apply to a 'Unrelated' object"):
            torch.compile(fn, backend="eager")(Unrelated(), t)


if __name__ == "__main__":
    from torch._dynamo.test_case import run_tests

    run_tests()
