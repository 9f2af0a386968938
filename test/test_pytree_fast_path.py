# Owner(s): ["module: pytree"]

"""Tests for the eager fast paths of ``torch.utils._pytree``.

``tree_flatten``, ``tree_leaves`` and ``tree_is_leaf`` without ``is_leaf``
resolve each class through a per-class cache and handle exact lists, tuples
and dicts inline; Dynamo traces reference implementations instead. These
tests pin down that both give what the registry says, at all times.
"""

import collections
import dataclasses
import gc
import warnings
import weakref
from collections import defaultdict, deque, namedtuple, OrderedDict
from typing import Any

import torch
import torch.utils._pytree as py_pytree
from torch._dynamo.testing import CompileCounter
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Box:
    value: Any


def _trees() -> dict[str, Any]:
    x = torch.ones(2)
    return {
        "leaf": x,
        "none": None,
        "empty_list": [],
        "empty_dict": {},
        "list": [x, 1, "s", None],
        "tuple": (x, (x, ()), [x]),
        "dict": {"b": x, "a": [x, {"c": (x,)}]},
        "namedtuple": Point(x, Point(1, [2])),
        "ordered_dict": OrderedDict([("z", x), ("y", [1])]),
        "defaultdict": defaultdict(list, {"k": [x, x]}),
        "deque": deque([x, (1,)], maxlen=5),
        "structseq": torch.return_types.max((x, x)),
        "deep": [[[[[x]]]]],
    }


def _spec_fields(spec: py_pytree.TreeSpec) -> Any:
    # Everything a TreeSpec holds, recursively.
    return (
        spec.type,
        spec._context,
        spec.num_nodes,
        spec.num_leaves,
        spec.num_children,
        [_spec_fields(child) for child in spec._children],
    )


class TestPytreeFastPath(TestCase):
    @parametrize("name", list(_trees()))
    def test_same_as_reference(self, name: str) -> None:
        tree = _trees()[name]
        fast_leaves: list[Any] = []
        reference_leaves: list[Any] = []
        fast = py_pytree._tree_flatten_fast(tree, fast_leaves)
        reference = py_pytree._tree_flatten_reference(tree, reference_leaves)
        self.assertEqual(_spec_fields(fast), _spec_fields(reference))
        self.assertEqual(fast, reference)
        self.assertEqual(fast_leaves, reference_leaves)
        self.assertTrue(all(a is b for a, b in zip(fast_leaves, reference_leaves)))
        self.assertEqual(py_pytree.tree_leaves(tree), reference_leaves)
        # And the public functions agree with the is_leaf path (which does not
        # use the fast path).
        leaves, spec = py_pytree.tree_flatten(tree)
        slow_leaves, slow_spec = py_pytree.tree_flatten(tree, is_leaf=lambda _: False)
        self.assertEqual(_spec_fields(spec), _spec_fields(slow_spec))
        self.assertEqual(leaves, slow_leaves)
        self.assertEqual(py_pytree.tree_unflatten(leaves, spec), tree)
        self.assertEqual(
            py_pytree.tree_is_leaf(tree),
            py_pytree.tree_is_leaf(tree, is_leaf=lambda _: False),
        )

    def test_unflatten_builds_new_containers(self) -> None:
        # Lists and tuples of leaves are built inline from the leaves; every
        # container is new and of the exact type, whatever sequence of leaves
        # is given.
        tree = {"a": [1, 2], "b": (3, [4, ()]), "c": [], "d": Point(5, 6), "e": [[7]]}
        leaves, spec = py_pytree.tree_flatten(tree)
        for given in (leaves, tuple(leaves), iter(leaves)):
            out = py_pytree.tree_unflatten(given, spec)
            self.assertEqual(out, tree)
            self.assertIs(type(out["b"]), tuple)
            self.assertIs(type(out["b"][1][1]), tuple)
            self.assertIs(type(out["d"]), Point)
        out = py_pytree.tree_unflatten(leaves, spec)
        out["a"].append(0)
        out["c"].append(0)
        out["e"][0].append(0)
        self.assertEqual(leaves, [1, 2, 3, 4, 5, 6, 7])
        self.assertEqual(py_pytree.tree_unflatten(leaves, spec), tree)
        flat, flat_spec = py_pytree.tree_flatten([1, 2])
        self.assertIsNot(py_pytree.tree_unflatten(flat, flat_spec), flat)

    def test_spec_repr(self) -> None:
        _, spec = py_pytree.tree_flatten({"a": [1, (2,)], "b": None})
        self.assertExpectedInline(
            repr(spec),
            """\
TreeSpec(dict, ['a', 'b'], [TreeSpec(list, None, [*,
    TreeSpec(tuple, None, [*])]),
  *])""",
        )

    def test_registration_and_deregistration_take_effect(self) -> None:
        obj = Box(torch.ones(1))
        tree = [obj, 1]
        self.assertEqual(py_pytree.tree_leaves(tree), [obj, 1])  # cached as a leaf
        self.assertTrue(py_pytree.tree_is_leaf(obj))
        py_pytree.register_pytree_node(
            Box, lambda b: ([b.value], None), lambda v, _: Box(next(iter(v)))
        )
        try:
            self.assertFalse(py_pytree.tree_is_leaf(obj))
            leaves, spec = py_pytree.tree_flatten(tree)
            self.assertEqual(leaves, [obj.value, 1])
            self.assertIs(spec.child(0).type, Box)
            self.assertEqual(py_pytree.tree_leaves(tree), [obj.value, 1])
            self.assertEqual(py_pytree.tree_map(lambda v: v, tree)[0], obj)
        finally:
            py_pytree._deregister_pytree_node(Box)
        self.assertTrue(py_pytree.tree_is_leaf(obj))
        self.assertEqual(py_pytree.tree_leaves(tree), [obj, 1])
        self.assertEqual(py_pytree.tree_flatten(tree)[1].num_leaves, 2)

    @parametrize("builtin", [list, tuple, dict])
    def test_replaced_builtin_registration_is_used(self, builtin: type) -> None:
        # A user who replaces the registration of list, tuple or dict gets
        # theirs, in every entry point, and the stock one back afterwards.
        original = py_pytree.SUPPORTED_NODES[builtin]
        serialized = py_pytree.SUPPORTED_SERIALIZED_TYPES[builtin]
        calls = collections.Counter()

        def flatten(node: Any) -> tuple[list[Any], Any]:
            calls["flatten"] += 1
            children, context = original.flatten_fn(node)
            return list(reversed(list(children))), context

        def unflatten(values: Any, context: Any) -> Any:
            calls["unflatten"] += 1
            return original.unflatten_fn(list(reversed(list(values))), context)

        tree = builtin([1, 2, 3]) if builtin is not dict else {"a": 1, "b": 2, "c": 3}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overwriting the previous registration"
            py_pytree._private_register_pytree_node(
                builtin,
                flatten,
                unflatten,
                serialized_type_name=serialized.serialized_type_name,
                flatten_with_keys_fn=original.flatten_with_keys_fn,
            )
        try:
            leaves, spec = py_pytree.tree_flatten([tree])
            self.assertEqual(leaves, [3, 2, 1])
            self.assertEqual(py_pytree.tree_leaves([tree]), [3, 2, 1])
            self.assertEqual(py_pytree.tree_unflatten(leaves, spec), [tree])
            self.assertGreaterEqual(calls["flatten"], 2)
            self.assertGreaterEqual(calls["unflatten"], 1)
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                py_pytree._private_register_pytree_node(
                    builtin,
                    original.flatten_fn,
                    original.unflatten_fn,
                    serialized_type_name=serialized.serialized_type_name,
                    flatten_with_keys_fn=original.flatten_with_keys_fn,
                )
            py_pytree.SUPPORTED_NODES[builtin] = original
            py_pytree._clear_flatten_cache()
        self.assertEqual(py_pytree.tree_leaves([tree]), [1, 2, 3])

    def test_is_leaf_called_once_per_node(self) -> None:
        tree = {"a": [1, (2, 3)], "b": Point(4, [5])}
        seen: list[Any] = []

        def is_leaf(node: Any) -> bool:
            seen.append(node)
            return False

        leaves, _ = py_pytree.tree_flatten(tree, is_leaf=is_leaf)
        self.assertEqual(leaves, [1, 2, 3, 4, 5])
        # dict, list, tuple, namedtuple, list and 5 leaves, each once (as stock).
        self.assertEqual(len(seen), 10)
        seen.clear()
        self.assertEqual(py_pytree.tree_leaves(tree, is_leaf=is_leaf), leaves)
        self.assertEqual(len(seen), 10)

    def test_classes_are_not_kept_alive(self) -> None:
        refs = []
        for i in range(50):
            cls = type(f"Temp{i}", (), {})
            py_pytree.tree_flatten([cls(), {"k": cls()}])
            py_pytree.tree_leaves((cls(),))
            py_pytree.tree_is_leaf(cls())
            refs.append(weakref.ref(cls))
            del cls
        gc.collect()
        self.assertEqual([r for r in refs if r() is not None], [])

    def test_class_seen_once_then_covered(self) -> None:
        # A plain leaf class is not cached at its first sighting; a family or
        # an exact registration made after it takes effect at the next one.
        @dataclasses.dataclass
        class Base:
            value: Any

        class Member(Base):
            pass

        class Exact:
            pass

        member, exact = Member(1), Exact()
        self.assertEqual(py_pytree.tree_leaves([member, exact]), [member, exact])
        py_pytree.register_pytree_family(Base)
        py_pytree.register_pytree_node(
            Exact, lambda e: ([2], None), lambda v, _: Exact()
        )
        try:
            self.assertEqual(py_pytree.tree_leaves([member, exact]), [1, 2])
            self.assertFalse(py_pytree.tree_is_leaf(member))
            self.assertIs(py_pytree.tree_structure(exact).type, Exact)
        finally:
            py_pytree._deregister_pytree_family(Base)
            py_pytree._deregister_pytree_node(Exact)
        self.assertEqual(py_pytree.tree_leaves([member, exact]), [member, exact])

    def test_caching_that_races_a_registration_is_taken_back(self) -> None:
        # A class seen for the second time is cached without the registry
        # lock. If a family that covers it is registered between the check
        # and the caching, the entry must not survive.
        @dataclasses.dataclass
        class Base:
            value: Any

        class Member(Base):
            pass

        generation = py_pytree._NODE_TYPE_CACHE_GENERATION
        self.assertEqual(py_pytree._plain_leaf_sighting(Member), 1)
        self.assertEqual(py_pytree._plain_leaf_sighting(Member), 2)
        py_pytree.register_pytree_family(Base)  # the racing registration
        try:
            self.assertTrue(py_pytree._cache_plain_leaf_class(Member, generation))
            self.assertFalse(py_pytree.tree_is_leaf(Member(1)))
            self.assertEqual(py_pytree.tree_leaves([Member(1)]), [1])
        finally:
            py_pytree._deregister_pytree_family(Base)
        self.assertEqual(py_pytree._plain_leaf_sighting(Member), 1)

    def test_compile_does_not_guard_on_the_caches(self) -> None:
        # Dynamo traces the reference implementations: flattening other trees
        # eagerly between calls (which fills the caches) recompiles nothing.
        torch._dynamo.reset()
        counter = CompileCounter()

        @torch.compile(backend=counter, fullgraph=True)
        def fn(tree: Any) -> Any:
            leaves, spec = py_pytree.tree_flatten(tree)
            total = sum(py_pytree.tree_leaves(tree))
            return py_pytree.tree_unflatten([v * 2 for v in leaves], spec), total

        tree = {"a": [torch.ones(2), (torch.ones(2),)], "b": Point(torch.ones(2), 1)}
        expected = py_pytree.tree_map(lambda v: v * 2, tree)
        self.assertEqual(fn(tree)[0], expected)
        for i in range(5):
            cls = type(f"Fresh{i}", (), {})
            py_pytree.tree_flatten([cls(), Box(i)])
        self.assertEqual(fn(tree)[0], expected)
        self.assertEqual(counter.frame_count, 1)


instantiate_parametrized_tests(TestPytreeFastPath)


if __name__ == "__main__":
    run_tests()
