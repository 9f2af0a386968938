# Owner(s): ["module: pytree"]

"""Tests for the fast ``tree_flatten``, ``tree_leaves`` and ``TreeSpec.unflatten``.

They handle children that are leaves, lists, tuples and dicts inline and build
each TreeSpec with its counts known. These tests compare them with the
definition: a straightforward recursion over ``SUPPORTED_NODES`` and
``TreeSpec(type, context, children)``.
"""

import collections
import copy
import dataclasses
import pickle
import warnings
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
        "list_of_one_class": [x] * 7,
        "list_of_lists": [[x], [x], [x], [x], [x], [x]],
        "list_of_namedtuples": [Point(1, 2)] * 6,
        "list_of_structseqs": [torch.return_types.max((x, x))] * 6,
        "tuple": (x, (x, ()), [x]),
        "dict": {"b": x, "a": [x, {"c": (x,)}]},
        "namedtuple": Point(x, Point(1, [2])),
        "ordered_dict": OrderedDict([("z", x), ("y", [1])]),
        "defaultdict": defaultdict(list, {"k": [x, x]}),
        "deque": deque([x, (1,)], maxlen=5),
        "structseq": torch.return_types.max((x, x)),
        "deep": [[[[[x]]]]],
    }


def _reference_flatten(tree: Any, leaves: list[Any]) -> py_pytree.TreeSpec:
    node_type = py_pytree._get_node_type(tree)
    if node_type not in py_pytree.SUPPORTED_NODES:
        leaves.append(tree)
        return py_pytree.treespec_leaf()
    children, context = py_pytree.SUPPORTED_NODES[node_type].flatten_fn(tree)
    specs = [_reference_flatten(child, leaves) for child in children]
    return py_pytree.TreeSpec(node_type, context, specs)


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
        expected_leaves: list[Any] = []
        expected = _spec_fields(_reference_flatten(tree, expected_leaves))
        for is_leaf in (None, lambda _: False):
            leaves, spec = py_pytree.tree_flatten(tree, is_leaf=is_leaf)
            self.assertEqual(_spec_fields(spec), expected)
            self.assertEqual(len(leaves), len(expected_leaves))
            self.assertTrue(all(a is b for a, b in zip(leaves, expected_leaves)))
            leaves = py_pytree.tree_leaves(tree, is_leaf=is_leaf)
            self.assertTrue(all(a is b for a, b in zip(leaves, expected_leaves)))
        rebuilt = py_pytree.tree_unflatten(leaves, spec)
        self.assertEqual(rebuilt, tree)
        self.assertEqual(py_pytree.tree_structure(rebuilt), spec)

    def test_unflatten_builds_new_containers(self) -> None:
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
        with self.assertRaisesRegex(ValueError, "`leaves` has length 6"):
            py_pytree.tree_unflatten(leaves[:-1], spec)

    def test_spec_repr(self) -> None:
        _, spec = py_pytree.tree_flatten({"a": [1, (2,)], "b": None})
        self.assertExpectedInline(
            repr(spec),
            """\
TreeSpec(dict, ['a', 'b'], [TreeSpec(list, None, [*,
    TreeSpec(tuple, None, [*])]),
  *])""",
        )

    def test_spec_stays_frozen_and_checked(self) -> None:
        _, spec = py_pytree.tree_flatten({"a": [1, (2,)], "b": None})
        self.assertEqual(
            (spec.num_nodes, spec.num_leaves, spec.num_children), (6, 3, 2)
        )
        with self.assertRaises(dataclasses.FrozenInstanceError):
            spec.num_leaves = 0  # type: ignore[misc]
        for copied in (
            copy.copy(spec),
            copy.deepcopy(spec),
            pickle.loads(pickle.dumps(spec)),
        ):
            self.assertEqual(_spec_fields(copied), _spec_fields(spec))
        with self.assertRaisesRegex(
            AssertionError, "leaf node should not have a context"
        ):
            py_pytree.TreeSpec(None, 0, [])
        with self.assertRaisesRegex(
            AssertionError, "leaf node should not have children"
        ):
            py_pytree.TreeSpec(None, None, [spec])

    def test_registration_and_deregistration_take_effect(self) -> None:
        obj = Box(torch.ones(1))
        trees = ([obj, 1], [obj] * 6)
        self.assertEqual(py_pytree.tree_leaves(trees), [obj, 1] + [obj] * 6)
        py_pytree.register_pytree_node(
            Box, lambda b: ([b.value], None), lambda v, _: Box(next(iter(v)))
        )
        try:
            self.assertFalse(py_pytree.tree_is_leaf(obj))
            leaves, spec = py_pytree.tree_flatten(trees)
            self.assertEqual(leaves, [obj.value, 1] + [obj.value] * 6)
            self.assertIs(spec.child(0).child(0).type, Box)
            self.assertEqual(py_pytree.tree_leaves(trees), leaves)
            self.assertEqual(py_pytree.tree_map(lambda v: v, trees), trees)
        finally:
            py_pytree._deregister_pytree_node(Box)
        self.assertEqual(py_pytree.tree_leaves(trees), [obj, 1] + [obj] * 6)

    @parametrize("builtin", [list, tuple, dict])
    def test_replaced_builtin_registration_is_used(self, builtin: type) -> None:
        # A user who replaces the registration of list, tuple or dict gets
        # theirs, in every entry point, and the stock one back afterwards.
        original = py_pytree.SUPPORTED_NODES[builtin]
        serialized = py_pytree.SUPPORTED_SERIALIZED_TYPES[builtin]
        calls: collections.Counter[str] = collections.Counter()

        def flatten(node: Any) -> tuple[list[Any], Any]:
            calls["flatten"] += 1
            children, context = original.flatten_fn(node)
            return list(reversed(list(children))), context

        def unflatten(values: Any, context: Any) -> Any:
            calls["unflatten"] += 1
            return original.unflatten_fn(list(reversed(list(values))), context)

        def register(flatten: Any, unflatten: Any) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore"
                )  # "Overwriting the previous registration"
                py_pytree._private_register_pytree_node(
                    builtin,
                    flatten,
                    unflatten,
                    serialized_type_name=serialized.serialized_type_name,
                    flatten_with_keys_fn=original.flatten_with_keys_fn,
                )

        tree = builtin([1, 2, 3]) if builtin is not dict else {"a": 1, "b": 2, "c": 3}
        register(flatten, unflatten)
        try:
            leaves, spec = py_pytree.tree_flatten(Point(tree, 0))
            self.assertEqual(leaves, [3, 2, 1, 0])
            self.assertEqual(py_pytree.tree_leaves(Point(tree, 0)), [3, 2, 1, 0])
            self.assertEqual(py_pytree.tree_unflatten(leaves, spec), Point(tree, 0))
            self.assertEqual(calls, {"flatten": 2, "unflatten": 1})
        finally:
            register(original.flatten_fn, original.unflatten_fn)
            py_pytree.SUPPORTED_NODES[builtin] = original
        self.assertEqual(py_pytree.tree_leaves(Point(tree, 0)), [1, 2, 3, 0])

    def test_is_leaf_called_once_per_node(self) -> None:
        tree = {"a": [1, (2, 3)], "b": Point(4, [5]), "c": [6] * 5}
        seen: list[Any] = []

        def is_leaf(node: Any) -> bool:
            seen.append(node)
            return False

        leaves, _ = py_pytree.tree_flatten(tree, is_leaf=is_leaf)
        self.assertEqual(leaves, [1, 2, 3, 4, 5, 6, 6, 6, 6, 6])
        # Each node (6) and leaf (10) once, in order, as stock.
        expected = [tree, tree["a"], 1, (2, 3), 2, 3, tree["b"], 4, [5], 5, tree["c"]]
        self.assertEqual(seen, expected + [6] * 5)
        seen.clear()
        self.assertEqual(py_pytree.tree_leaves(tree, is_leaf=is_leaf), leaves)
        self.assertEqual(seen, expected + [6] * 5)

    def test_compile_fullgraph(self) -> None:
        # Dynamo traces the same functions; eager flattening in between (of
        # classes it never saw) recompiles nothing.
        torch._dynamo.reset()
        counter = CompileCounter()

        @torch.compile(backend=counter, fullgraph=True)
        def fn(tree: Any) -> Any:
            leaves, spec = py_pytree.tree_flatten(tree)
            total = sum(py_pytree.tree_leaves(tree))
            return py_pytree.tree_unflatten([v * 2 for v in leaves], spec), total

        tree = {
            "a": [torch.ones(2), (torch.ones(2),)],
            "b": Point(torch.ones(2), 1),
            "c": [torch.ones(2)] * 6,
        }
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
