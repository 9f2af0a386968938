# Owner(s): ["module: pytree"]

"""Key paths of mappings registered without a ``flatten_with_keys_fn``.

Libraries register their mapping outputs with ``register_pytree_node`` and no
key function (transformers' ``ModelOutput`` up to 5.13, diffusers'
``BaseOutput``). When the context of such a node lists the keys of its children,
in order, the key paths use them; otherwise ``tree_flatten_with_path`` still
refuses the node. The C++ pytree has no key paths.
"""

from collections import OrderedDict
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_utils import run_tests, TestCase


class Output(OrderedDict):
    """Like a ``ModelOutput``: an ``OrderedDict`` whose items are its fields."""


class Reversed(OrderedDict):
    """Flattened in reverse: its context does not give its children's keys."""


class Pair:
    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


pytree.register_pytree_node(
    Output,
    lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: Output(zip(keys, values)),
    serialized_type_name=f"{__name__}.Output",
)
pytree.register_pytree_node(
    Reversed,
    lambda d: (list(d.values())[::-1], list(d.keys())),
    lambda values, keys: Reversed(zip(keys, list(values)[::-1])),
    serialized_type_name=f"{__name__}.Reversed",
)
pytree.register_pytree_node(
    Pair,
    lambda p: ([p.a, p.b], None),
    lambda values, _: Pair(*values),
    serialized_type_name=f"{__name__}.Pair",
)


class TestMappingKeyPaths(TestCase):
    def test_key_paths_from_the_context(self) -> None:
        out = Output(logits=torch.ones(1), past=[torch.zeros(2), torch.zeros(3)])
        pairs, spec = pytree.tree_flatten_with_path({"out": out})
        self.assertEqual(
            [pytree.keystr(path) for path, _ in pairs],
            ["['out']['logits']", "['out']['past'][0]", "['out']['past'][1]"],
        )
        for path, leaf in pairs:
            self.assertIs(pytree.key_get({"out": out}, path), leaf)
        self.assertEqual(spec, pytree.tree_structure({"out": out}))
        doubled = pytree.tree_map_with_path(lambda path, x: x * 2, out)
        self.assertIsInstance(doubled, Output)
        self.assertEqual(doubled["logits"], torch.full((1,), 2.0))

    def test_refused_when_the_context_does_not_key_the_children(self) -> None:
        for tree in (Reversed(a=torch.ones(1), b=torch.zeros(1)), Pair(1, 2)):
            with self.assertRaisesRegex(
                ValueError, "Did not find a flatten_with_keys_fn"
            ):
                pytree.tree_flatten_with_path(tree)
        # one item is its own reverse: the context keys it
        self.assertEqual(
            pytree.tree_flatten_with_path(Reversed(a=1))[0],
            [((pytree.MappingKey("a"),), 1)],
        )


if __name__ == "__main__":
    run_tests()
