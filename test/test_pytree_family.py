# Owner(s): ["module: pytree"]

"""Tests for pytree families (``register_pytree_family``).

A family is a base class registered once; the base and all of its subclasses,
present and future, become pytree nodes, while exact registrations keep
precedence. See ``torch.utils._pytree.register_pytree_family``.
"""

import dataclasses
import gc
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import unittest
import warnings
import weakref
from collections import defaultdict, namedtuple, OrderedDict
from typing import Any

import torch
import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    skipIfTorchDynamo,
    subtest,
    TestCase,
)


if py_pytree._cxx_pytree_dynamo_traceable:
    import torch.utils._cxx_pytree as cxx_pytree

    _PYTREE_MODULES: tuple[Any, ...] = (py_pytree, cxx_pytree)
else:
    cxx_pytree = None
    _PYTREE_MODULES = (py_pytree,)

skipIfNoCxxPytree = unittest.skipIf(cxx_pytree is None, "missing optree package")

_PYTREE_SUBTESTS = [
    subtest(py_pytree, name="py"),
    subtest(cxx_pytree, name="cxx", decorators=[skipIfNoCxxPytree]),
]
pytree_impls = parametrize("pytree", _PYTREE_SUBTESTS)


def _normalized_dumps(spec: Any) -> str:
    # Serialized type names contain this module's name, which is "__main__"
    # or "test_pytree_family" depending on how the file is run.
    return py_pytree.treespec_dumps(spec).replace(f"{__name__}.", "")


class ModelOutputLike(OrderedDict):
    """A stand-in for HuggingFace ``ModelOutput``.

    An ``OrderedDict`` whose dataclass subclasses hold their non-None fields as
    keys, and whose attributes and items stay in sync.
    """

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


@dataclasses.dataclass
class EncoderOutput(ModelOutputLike):
    last_hidden_state: Any = None
    pooler_output: Any = None
    hidden_states: Any = None
    attentions: Any = None


@dataclasses.dataclass
class PointBase:
    x: Any
    y: Any = None


@dataclasses.dataclass
class Point3(PointBase):
    z: Any = None


class PlainDictBase(dict):
    pass


class PlainDictChild(PlainDictBase):
    pass


class FamilyTestCase(TestCase):
    def register_family(self, base: Any, **kwargs: Any) -> None:
        py_pytree.register_pytree_family(base, **kwargs)
        self.addCleanup(py_pytree._deregister_pytree_family, base)

    def deregister_node_on_cleanup(self, cls: type) -> None:
        self.addCleanup(py_pytree._deregister_pytree_node, cls)
        if cxx_pytree is not None:
            self.addCleanup(cxx_pytree._private_deregister_pytree_node, cls)


class TestPytreeFamilyAPI(FamilyTestCase):
    @skipIfNoCxxPytree
    def test_public_api_aligned(self) -> None:
        self.assertIn("register_pytree_family", py_pytree.__all__)
        self.assertIn("register_pytree_family", cxx_pytree.__all__)
        self.assertEqual(
            inspect.signature(py_pytree.register_pytree_family),
            inspect.signature(cxx_pytree.register_pytree_family),
        )

    @skipIfNoCxxPytree
    def test_cxx_refuses_flatten_with_keys_fn(self) -> None:
        # As cxx_pytree.register_pytree_node does: key paths are python-only.
        class Base(dict):
            pass

        with self.assertRaisesRegex(NotImplementedError, "KeyPaths are not yet"):
            cxx_pytree.register_pytree_family(
                Base,
                flatten_fn=lambda d: (list(d.values()), list(d)),
                unflatten_fn=lambda cls, values, keys: cls(zip(keys, values)),
                flatten_with_keys_fn=lambda d: ([], None),
            )
        self.assertNotIn(Base, py_pytree._PYTREE_FAMILIES)
        self.assertIs(cxx_pytree.FamilyUnflattenFn, py_pytree.FamilyUnflattenFn)
        self.assertIn("FamilyUnflattenFn", py_pytree.__all__)
        self.assertIn("FamilyUnflattenFn", cxx_pytree.__all__)

    def test_rejects_builtin_and_invalid_bases(self) -> None:
        for base in (object, dict, OrderedDict, list, tuple, defaultdict):
            with self.assertRaisesRegex(ValueError, "builtin type"):
                py_pytree.register_pytree_family(base)
        Point = namedtuple("Point", ["x", "y"])
        with self.assertRaisesRegex(ValueError, "builtin type"):
            py_pytree.register_pytree_family(Point)
        with self.assertRaisesRegex(TypeError, "expects a class"):
            py_pytree.register_pytree_family(3)  # type: ignore[arg-type]

    def test_argument_pairs(self) -> None:
        with self.assertRaisesRegex(ValueError, "both flatten_fn and unflatten_fn"):
            py_pytree.register_pytree_family(PointBase, flatten_fn=lambda x: ([], None))
        with self.assertRaisesRegex(ValueError, "to_dumpable_context"):
            py_pytree.register_pytree_family(PointBase, to_dumpable_context=str)
        self.assertNotIn(PointBase, py_pytree._PYTREE_FAMILIES)

    def test_double_registration(self) -> None:
        self.register_family(PointBase)
        with self.assertRaisesRegex(
            ValueError, "already registered as a pytree family"
        ):
            py_pytree.register_pytree_family(PointBase)

    def test_deregister_unknown(self) -> None:
        with self.assertRaisesRegex(ValueError, "not registered as a pytree family"):
            py_pytree._deregister_pytree_family(PointBase)


class TestPytreeFamilyResolution(FamilyTestCase):
    @pytree_impls
    def test_not_opted_in_stays_leaf(self, pytree: Any) -> None:
        @dataclasses.dataclass
        class Opaque:
            x: Any

        class OpaqueDict(dict):
            pass

        for obj in (Opaque(1), OpaqueDict(a=1), PlainDictChild(a=1), Point3(1, 2)):
            leaves, spec = pytree.tree_flatten([obj])
            self.assertEqual(len(leaves), 1)
            self.assertIs(leaves[0], obj)
            self.assertTrue(pytree.tree_is_leaf(obj))

    @pytree_impls
    def test_subclasses_present_and_future(self, pytree: Any) -> None:
        self.register_family(PointBase)

        @dataclasses.dataclass
        class Point4(Point3):  # defined after the registration
            w: Any = None

        for obj, expected in (
            (PointBase(1, 2), [1, 2]),
            (Point3(1, 2, 3), [1, 2, 3]),
            (Point4(1, 2, 3, 4), [1, 2, 3, 4]),
        ):
            leaves, spec = pytree.tree_flatten(obj)
            self.assertEqual(leaves, expected)
            self.assertFalse(pytree.tree_is_leaf(obj))
            rebuilt = pytree.tree_unflatten(leaves, spec)
            self.assertIs(type(rebuilt), type(obj))
            self.assertEqual(rebuilt, obj)

    @parametrize("registrar", _PYTREE_SUBTESTS)
    def test_exact_registration_wins_without_warning(self, registrar: Any) -> None:
        self.register_family(PointBase)

        @dataclasses.dataclass
        class Special(PointBase):
            pass

        # Seen through the family first, then registered exactly, as
        # transformers does in ModelOutput.__init_subclass__.
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(Special(1, 2)), [1, 2])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            registrar.register_pytree_node(
                Special,
                lambda p: ([p.x], p.y),
                lambda values, y: Special(next(iter(values)), y),
                serialized_type_name="test.Special",
            )
        self.deregister_node_on_cleanup(Special)
        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten(Special(1, 2))
            self.assertEqual(leaves, [1])
            self.assertEqual(pytree.tree_unflatten([5], spec), Special(5, 2))
        # Registering twice exactly still fails, as before.
        with self.assertRaisesRegex(ValueError, "already registered as pytree node"):
            py_pytree.register_pytree_node(
                Special, lambda p: ([], None), lambda v, c: Special(0)
            )

    def test_exact_registration_before_family_is_kept(self) -> None:
        @dataclasses.dataclass
        class Exact(PointBase):
            pass

        py_pytree.register_pytree_node(
            Exact,
            lambda p: ([p.y], p.x),
            lambda values, x: Exact(x, next(iter(values))),
        )
        self.deregister_node_on_cleanup(Exact)
        self.register_family(PointBase)
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(Exact(1, 2)), [2])
        self.assertNotIn(Exact, py_pytree._FAMILY_DERIVED_NODES)

    def test_nearest_family_wins(self) -> None:
        self.register_family(
            ModelOutputLike,
            flatten_fn=lambda d: (list(d.values())[:1], list(d.keys())[:1]),
            unflatten_fn=lambda cls, values, keys: cls(**dict(zip(keys, values))),
        )
        out = EncoderOutput(last_hidden_state=1, pooler_output=2)
        self.assertEqual(py_pytree.tree_leaves(out), [1])
        # A nearer family registered later takes over the classes below it ...
        py_pytree.register_pytree_family(EncoderOutput)
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(out), [1, 2])
        # ... and hands them back when it is deregistered.
        py_pytree._deregister_pytree_family(EncoderOutput)
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(out), [1])

    def test_namedtuple_rules_unchanged(self) -> None:
        @dataclasses.dataclass
        class Base:
            pass

        class NT(namedtuple("NT", ["a", "b"])):
            __slots__ = ()

        self.register_family(Base)
        _, spec = py_pytree.tree_flatten(NT(1, 2))
        self.assertIs(spec.type, namedtuple)
        self.assertIs(spec.context, NT)

    def test_deregistration_restores_leaves(self) -> None:
        py_pytree.register_pytree_family(PointBase)
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(Point3(1, 2, 3)), [1, 2, 3])
        self.assertIn(Point3, py_pytree.SUPPORTED_NODES)
        py_pytree._deregister_pytree_family(PointBase)
        self.assertNotIn(Point3, py_pytree.SUPPORTED_NODES)
        self.assertNotIn(Point3, py_pytree._FAMILY_DERIVED_NODES)
        obj = Point3(1, 2, 3)
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(obj), [obj])

    def test_cache_invalidated(self) -> None:
        @dataclasses.dataclass
        class Base:
            x: Any

        @dataclasses.dataclass
        class Child(Base):
            pass

        obj = Child(1)
        self.assertEqual(py_pytree.tree_leaves(obj), [obj])  # cached as leaf
        self.register_family(Base)
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(obj), [1])

    @pytree_impls
    def test_leaf_classes_are_not_kept_alive(self, pytree: Any) -> None:
        # torch.fx.GraphModule, for one, creates a class per instance.
        @dataclasses.dataclass
        class Base:
            x: Any

        self.register_family(Base)  # the slow path of the resolution runs too
        refs = []
        for i in range(200):
            cls = type(f"Leaf{i}", (), {})
            tree = [cls(), {"a": cls()}, (cls(),)]
            pytree.tree_flatten(tree)
            pytree.tree_map(lambda x: x, tree)
            pytree.tree_leaves(tree)
            pytree.tree_is_leaf(cls())
            refs.append(weakref.ref(cls))
            del cls, tree
        gc.collect()
        self.assertEqual([r for r in refs if r() is not None], [])
        self.assertEqual(
            len(py_pytree._WEAK_NODE_TYPE_CACHE),
            len(py_pytree._WEAK_NODE_TYPE_CACHE_REFS),
        )

    def test_family_members_are_freed_with_their_family(self) -> None:
        # A derived registration keeps its class alive, like register_pytree_node,
        # until the family is deregistered.
        @dataclasses.dataclass
        class Base:
            x: Any

        py_pytree.register_pytree_family(Base)
        refs = []
        for i in range(20):
            cls = dataclasses.make_dataclass(f"Member{i}", [], bases=(Base,))
            for pytree in _PYTREE_MODULES:
                self.assertEqual(pytree.tree_leaves(cls(1)), [1])
            refs.append(weakref.ref(cls))
            del cls
        gc.collect()
        self.assertEqual(sum(r() is not None for r in refs), 20)
        py_pytree._deregister_pytree_family(Base)
        gc.collect()
        self.assertEqual([r for r in refs if r() is not None], [])
        self.assertNotIn("__init_subclass__", Base.__dict__)

    def test_plain_base_with_dataclass_members(self) -> None:
        class Output:
            pass

        @dataclasses.dataclass
        class A(Output):
            x: Any
            y: Any = None

        class NotDerivable(Output):
            def __init__(self, x: Any) -> None:
                self.x = x

        self.register_family(Output)

        @dataclasses.dataclass
        class B(Output):  # defined after the registration
            z: Any

        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves([A(1), B(2)]), [1, 2])
            leaves, spec = pytree.tree_flatten(A(1, 2))
            self.assertEqual(pytree.tree_unflatten(leaves, spec), A(1, 2))
            for obj in (NotDerivable(1), Output()):
                name = type(obj).__qualname__
                with self.assertRaisesRegex(
                    TypeError,
                    rf"Cannot flatten .*{name}, a member of the pytree family "
                    r".*Output: it is neither a dataclass nor a dict subclass",
                ):
                    pytree.tree_flatten([obj])

    def test_thread_safety(self) -> None:
        @dataclasses.dataclass
        class Base:
            x: Any
            y: Any = None

        classes = [
            dataclasses.make_dataclass(f"Sub{i}", [], bases=(Base,)) for i in range(50)
        ]
        trees = [[cls(i, (i, i)), {"k": cls(i)}] for i, cls in enumerate(classes)]
        start = threading.Barrier(9)
        errors: list[str] = []

        def flatten_all() -> None:
            start.wait()
            for _ in range(20):
                for tree in trees:
                    leaves, spec = py_pytree.tree_flatten(tree)
                    # Before the registration the instances are leaves, after it
                    # they are nodes; never anything else.
                    if len(leaves) not in (2, 4):
                        errors.append(f"{len(leaves)} leaves for {tree}")
                    if py_pytree.tree_unflatten(leaves, spec) != tree:
                        errors.append(f"round trip failed for {tree}")

        threads = [threading.Thread(target=flatten_all) for _ in range(8)]
        for t in threads:
            t.start()
        start.wait()
        self.register_family(Base)
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        for tree in trees:
            self.assertEqual(len(py_pytree.tree_leaves(tree)), 4)

    @skipIfNoCxxPytree
    @parametrize(
        "pair",
        [
            subtest((py_pytree, cxx_pytree), name="py_cxx"),
            subtest((cxx_pytree, cxx_pytree), name="cxx_cxx"),
        ],
    )
    def test_threads_meet_a_new_member_at_once(self, pair: Any) -> None:
        # Two threads flatten the same never-seen family member at the same
        # time: both must see a node, in every round.
        @dataclasses.dataclass
        class Base:
            x: Any
            y: Any = None

        self.register_family(Base)
        rounds = 300
        barrier = threading.Barrier(2)
        classes: list[Any] = [None]
        results: list[list[Any]] = [[], []]

        def run(i: int) -> None:
            for r in range(rounds):
                if i == 0:
                    classes[0] = dataclasses.make_dataclass(f"M{r}", [], bases=(Base,))
                barrier.wait()
                results[i].append(pair[i].tree_leaves([classes[0](r, (r,))]))
                barrier.wait()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i in range(2):
            wrong = [r for r, leaves in enumerate(results[i]) if leaves != [r, r]]
            self.assertEqual(wrong, [], f"thread {i} got leaves instead of nodes")
            self.assertEqual(len(results[i]), rounds)

    def test_metaclass_subclasscheck_is_not_called(self) -> None:
        # Membership follows the MRO; a metaclass whose __subclasscheck__
        # raises neither breaks the registration nor leaves half of it.
        class Meta(type):
            def __subclasscheck__(cls, subclass: type) -> bool:
                raise RuntimeError("__subclasscheck__ called")

        @dataclasses.dataclass
        class Base(metaclass=Meta):
            x: Any = None

        @dataclasses.dataclass
        class Other:
            x: Any = None

        self.register_family(Other)
        self.assertEqual(py_pytree.tree_leaves(Other(1)), [1])
        self.register_family(Base)

        @dataclasses.dataclass
        class Sub(Base):
            y: Any = None

        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves([Sub(1, 2), Other(3)]), [1, 2, 3])

    def test_spec_survives_a_nearer_family(self) -> None:
        # A spec made before a nearer base became a family still unflattens
        # and serializes (the member is derived again on demand).
        @dataclasses.dataclass
        class Base:
            x: Any

        @dataclasses.dataclass
        class Middle(Base):
            pass

        @dataclasses.dataclass
        class Leafy(Middle):
            y: Any = None

        self.register_family(Base)
        leaves, spec = py_pytree.tree_flatten([Leafy(1, 2)])
        dumped = py_pytree.treespec_dumps(spec)
        self.register_family(Middle)
        self.assertNotIn(Leafy, py_pytree.SUPPORTED_NODES)
        self.assertEqual(py_pytree.tree_unflatten(leaves, spec), [Leafy(1, 2)])
        self.assertEqual(py_pytree.treespec_dumps(spec), dumped)

    def test_stress_registration_while_flattening(self) -> None:
        # 8 threads for a bounded time: two (de)register a family and an exact
        # node, six flatten, unflatten and map with both pytrees, on members of
        # a family that stays registered (some of them created on the way, so
        # never seen before), of the toggled family and plain containers.
        @dataclasses.dataclass
        class StableBase:
            x: Any
            y: Any = None

        @dataclasses.dataclass
        class ToggledBase:
            x: Any

        class Exact:
            def __init__(self, v: Any) -> None:
                self.v = v

            def __eq__(self, other: object) -> bool:
                return type(other) is Exact and other.v == self.v

        self.register_family(StableBase)
        self.addCleanup(
            lambda: ToggledBase in py_pytree._PYTREE_FAMILIES
            and py_pytree._deregister_pytree_family(ToggledBase)
        )

        def deregister_exact() -> None:
            if Exact in py_pytree.SUPPORTED_NODES:
                py_pytree._deregister_pytree_node(Exact)
                if cxx_pytree is not None:
                    try:
                        cxx_pytree._private_deregister_pytree_node(Exact)
                    except ValueError:
                        # Since torch 2.15, _deregister_pytree_node unregisters
                        # the class from optree too.
                        pass

        self.addCleanup(deregister_exact)
        deadline = time.monotonic() + 3.0
        errors: list[str] = []
        counts: list[int] = []
        lock = threading.Lock()

        def toggle_family() -> None:
            while time.monotonic() < deadline:
                py_pytree.register_pytree_family(ToggledBase)
                py_pytree._deregister_pytree_family(ToggledBase)

        def toggle_exact() -> None:
            while time.monotonic() < deadline:
                py_pytree.register_pytree_node(
                    Exact, lambda e: ([e.v], None), lambda v, _: Exact(next(iter(v)))
                )
                deregister_exact()

        def work(seed: int) -> None:
            n = 0
            try:
                while time.monotonic() < deadline:
                    pytree = _PYTREE_MODULES[(seed + n) % len(_PYTREE_MODULES)]
                    member_cls = (
                        dataclasses.make_dataclass(
                            f"New{seed}_{n}", [], bases=(StableBase,)
                        )
                        if n % 5 == 0
                        else StableBase
                    )
                    tree = {
                        "stable": [member_cls(n, (n, 1))],
                        "plain": [(n,), {"a": n}],
                    }
                    leaves, spec = pytree.tree_flatten(tree)
                    if leaves != [n, n, 1, n, n]:
                        errors.append(f"{pytree.__name__}: leaves {leaves}")
                    if pytree.tree_unflatten(leaves, spec) != tree:
                        errors.append(f"{pytree.__name__}: round trip of {tree}")
                    mapped = pytree.tree_map(lambda v: v, tree)
                    if mapped != tree:
                        errors.append(f"{pytree.__name__}: tree_map gave {mapped}")
                    # A registration that changes under us: a node or a leaf,
                    # nothing else (unflattening a spec whose type was just
                    # deregistered fails, as it always did).
                    for obj in (ToggledBase(n), Exact(n)):
                        leaves = pytree.tree_leaves([obj, n])
                        if leaves not in ([obj, n], [n, n]):
                            errors.append(f"{pytree.__name__}: {obj} gave {leaves}")
                    n += 1
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
            with lock:
                counts.append(n)

        threads = [
            threading.Thread(target=toggle_family),
            threading.Thread(target=toggle_exact),
        ] + [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertFalse(any(t.is_alive() for t in threads), "a thread hangs")
        if errors:
            self.fail(
                f"{len(errors)} errors, the first ones:\n" + "\n".join(errors[:5])
            )
        self.assertEqual(len(counts), 6)
        self.assertGreater(min(counts), 10)


class TestPytreeFamilyMapping(FamilyTestCase):
    @pytree_impls
    def test_model_output_like_none_fields(self, pytree: Any) -> None:
        self.register_family(ModelOutputLike)
        out = EncoderOutput(
            last_hidden_state=torch.ones(2), hidden_states=(torch.zeros(1), 3)
        )
        self.assertEqual(list(out.keys()), ["last_hidden_state", "hidden_states"])
        leaves, spec = pytree.tree_flatten(out)
        self.assertEqual(len(leaves), 3)
        self.assertIs(leaves[0], out.last_hidden_state)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), EncoderOutput)
        self.assertEqual(list(rebuilt.keys()), ["last_hidden_state", "hidden_states"])
        self.assertIsNone(rebuilt.pooler_output)
        self.assertIs(rebuilt.hidden_states[0], out.hidden_states[0])
        doubled = pytree.tree_map(lambda t: t * 2, out)
        self.assertIs(type(doubled), EncoderOutput)
        self.assertEqual(doubled.hidden_states[1], 6)
        self.assertEqual(doubled.last_hidden_state, torch.full((2,), 2.0))

    def test_model_output_like_spec(self) -> None:
        self.register_family(ModelOutputLike)
        out = EncoderOutput(last_hidden_state=1, attentions=(2, 3))
        _, spec = py_pytree.tree_flatten(out)
        self.assertIs(spec.type, EncoderOutput)
        self.assertExpectedInline(
            repr(spec),
            """\
TreeSpec(EncoderOutput, ['last_hidden_state', 'attentions'], [*,
  TreeSpec(tuple, None, [*,
    *])])""",
        )
        self.assertExpectedInline(
            _normalized_dumps(spec),
            """[1, {"type": "EncoderOutput", "context": "[\\"last_hidden_state\\", \\"attentions\\"]", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]}]""",  # noqa: B950, RUF100
        )
        self.assertEqual(py_pytree.treespec_loads(py_pytree.treespec_dumps(spec)), spec)
        if cxx_pytree is not None:
            self.assertEqual(
                cxx_pytree.treespec_dumps(cxx_pytree.tree_structure(out)),
                py_pytree.treespec_dumps(spec),
            )

    def test_extra_and_dropped_keys_round_trip(self) -> None:
        self.register_family(ModelOutputLike)
        out = EncoderOutput(last_hidden_state=1)
        out["extra"] = 2  # a key that is not a field
        leaves, spec = py_pytree.tree_flatten(out)
        self.assertEqual(leaves, [1, 2])
        rebuilt = py_pytree.tree_unflatten(leaves, spec)
        self.assertEqual(
            list(rebuilt.items()), [("last_hidden_state", 1), ("extra", 2)]
        )
        # A mapped value that becomes None keeps its key.
        mapped = py_pytree.tree_map(lambda v: None if v == 1 else v, out)
        self.assertEqual(sorted(mapped.keys()), ["extra", "last_hidden_state"])

    @pytree_impls
    def test_plain_dict_subclass_pairs_constructor(self, pytree: Any) -> None:
        self.register_family(PlainDictBase)
        obj = PlainDictChild([(1, "a"), ("b", [2, 3])])
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(leaves, ["a", 2, 3])
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), PlainDictChild)
        self.assertEqual(rebuilt, obj)
        self.assertEqual(list(rebuilt), [1, "b"])

    def test_keyword_only_dict_constructor(self) -> None:
        class KwDict(PlainDictBase):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs)

        self.register_family(PlainDictBase)
        leaves, spec = py_pytree.tree_flatten(KwDict(a=1, b=2))
        self.assertEqual(py_pytree.tree_unflatten(leaves, spec), KwDict(a=1, b=2))

    def test_unrebuildable_class_names_itself(self) -> None:
        class Stubborn(PlainDictBase):
            def __init__(self, required: int) -> None:
                super().__init__(value=required)

        self.register_family(PlainDictBase)
        leaves, spec = py_pytree.tree_flatten(Stubborn(3))
        with self.assertRaisesRegex(TypeError, r"Cannot rebuild .*Stubborn.*custom"):
            py_pytree.tree_unflatten(leaves, spec)

    def test_key_paths(self) -> None:
        self.register_family(ModelOutputLike)
        out = EncoderOutput(last_hidden_state=torch.ones(1), attentions=(2, [3]))
        path_leaves, _ = py_pytree.tree_flatten_with_path(out)
        self.assertEqual(
            [py_pytree.keystr(path) for path, _ in path_leaves],
            ["['last_hidden_state']", "['attentions'][0]", "['attentions'][1][0]"],
        )
        for path, leaf in path_leaves:
            self.assertIs(py_pytree.key_get(out, path), leaf)
        self.assertIsInstance(path_leaves[0][0][0], py_pytree.MappingKey)


class TestPytreeFamilyDataclass(FamilyTestCase):
    @pytree_impls
    def test_none_fields(self, pytree: Any) -> None:
        self.register_family(PointBase)
        obj = Point3(x=torch.ones(1), y=None, z=(1, None))
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(len(leaves), 3)  # x, 1 and the None leaf inside z
        self.assertEqual(pytree.tree_unflatten(leaves, spec), obj)
        if pytree is py_pytree:
            self.assertExpectedInline(
                repr(spec),
                """\
TreeSpec(Point3, [['x', 'z'], ['y']], [*,
  TreeSpec(tuple, None, [*,
    *])])""",
            )
            self.assertExpectedInline(
                _normalized_dumps(spec),
                """[1, {"type": "Point3", "context": "[[\\"x\\", \\"z\\"], [\\"y\\"]]", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]}]""",  # noqa: B950, RUF100
            )

    @parametrize(
        "options",
        [
            subtest({"frozen": True}, name="frozen"),
            subtest({"slots": True}, name="slots"),
            subtest({"kw_only": True}, name="kw_only"),
            subtest({"frozen": True, "slots": True, "kw_only": True}, name="all"),
        ],
    )
    @pytree_impls
    def test_dataclass_variants(self, pytree: Any, options: dict[str, bool]) -> None:
        @dataclasses.dataclass(**options)
        class Base:
            a: Any
            b: list[Any] = dataclasses.field(default_factory=list)

        @dataclasses.dataclass(**options)
        class Child(Base):
            c: Any = None

        self.register_family(Base)
        obj = Child(a=1, b=[2, 3], c=None)
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(leaves, [1, 2, 3])
        rebuilt = pytree.tree_unflatten([4, 5, 6], spec)
        self.assertIs(type(rebuilt), Child)
        self.assertEqual(rebuilt, Child(a=4, b=[5, 6], c=None))

    def test_init_false_fields_are_recomputed(self) -> None:
        @dataclasses.dataclass
        class Base:
            a: Any
            total: Any = dataclasses.field(init=False, default=None)

            def __post_init__(self) -> None:
                self.total = self.a * 10

        self.register_family(Base)
        obj = Base(2)
        obj.total = "set by hand"
        leaves, spec = py_pytree.tree_flatten(obj)
        self.assertEqual(leaves, [2])
        rebuilt = py_pytree.tree_unflatten([3], spec)
        # Same as dataclasses.replace(obj, a=3): init=False fields come from
        # __post_init__, not from the flattened instance.
        self.assertEqual(rebuilt.total, dataclasses.replace(obj, a=3).total)
        self.assertEqual(rebuilt.total, 30)

    def test_key_paths(self) -> None:
        self.register_family(PointBase)
        obj = Point3(x=1, y=None, z={"k": 2})
        path_leaves, _ = py_pytree.tree_flatten_with_path(obj)
        self.assertEqual(
            [py_pytree.keystr(path) for path, _ in path_leaves], [".x", ".z['k']"]
        )
        for path, leaf in path_leaves:
            self.assertEqual(py_pytree.key_get(obj, path), leaf)
        self.assertIsInstance(path_leaves[0][0][0], py_pytree.GetAttrKey)

    def test_custom_functions(self) -> None:
        @dataclasses.dataclass
        class Base:
            value: Any
            tag: str = "t"

        def flatten(obj: Any) -> tuple[list[Any], Any]:
            return [obj.value], obj.tag

        def unflatten(cls: type, values: Any, tag: Any) -> Any:
            (value,) = values
            return cls(value, tag)

        def flatten_with_keys(obj: Any) -> tuple[list[Any], Any]:
            return [(py_pytree.GetAttrKey("value"), obj.value)], obj.tag

        self.register_family(
            Base,
            flatten_fn=flatten,
            unflatten_fn=unflatten,
            flatten_with_keys_fn=flatten_with_keys,
        )

        @dataclasses.dataclass
        class Child(Base):
            pass

        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten(Child([1, 2], "x"))
            self.assertEqual(leaves, [1, 2])
            self.assertEqual(pytree.tree_unflatten([3, 4], spec), Child([3, 4], "x"))
        self.assertEqual(
            py_pytree.keystr(py_pytree.tree_flatten_with_path(Child(1))[0][0][0]),
            ".value",
        )


class TestPytreeFamilySpecs(FamilyTestCase):
    @pytree_impls
    def test_spec_equality_and_hash(self, pytree: Any) -> None:
        self.register_family(PointBase)
        spec1 = pytree.tree_structure(Point3(1, 2, 3))
        spec2 = pytree.tree_structure(Point3(4, 5, 6))
        spec3 = pytree.tree_structure(PointBase(4, 5))
        spec4 = pytree.tree_structure(Point3(1, None, 3))
        self.assertEqual(spec1, spec2)
        self.assertEqual(hash(spec1), hash(spec2))
        self.assertNotEqual(spec1, spec3)
        self.assertNotEqual(spec1, spec4)

    @pytree_impls
    def test_multi_tree_map_and_flatten_up_to(self, pytree: Any) -> None:
        self.register_family(ModelOutputLike)
        a = EncoderOutput(last_hidden_state=1, attentions=(2, 3))
        b = EncoderOutput(last_hidden_state=10, attentions=(20, 30))
        summed = pytree.tree_map(lambda x, y: x + y, a, b)
        self.assertIs(type(summed), EncoderOutput)
        self.assertEqual(summed.attentions, (22, 33))
        spec = pytree.tree_structure(a)
        self.assertEqual(spec.flatten_up_to(b), [10, 20, 30])
        with self.assertRaises(ValueError):
            spec.flatten_up_to(EncoderOutput(last_hidden_state=1, pooler_output=(2, 3)))

    @pytree_impls
    def test_tree_map_only_and_broadcast(self, pytree: Any) -> None:
        self.register_family(PointBase)
        obj = Point3(1, "a", [2.0, 3])
        self.assertEqual(
            pytree.tree_map_only(int, lambda x: x + 1, obj), Point3(2, "a", [2.0, 4])
        )
        spec = pytree.tree_structure(obj)
        self.assertEqual(pytree._broadcast_to_and_flatten(7, spec), [7, 7, 7, 7])
        self.assertEqual(
            pytree._broadcast_to_and_flatten(Point3(0, 1, 2), spec), [0, 1, 2, 2]
        )

    @skipIfNoCxxPytree
    @pytree_impls
    def test_python_and_cxx_parity(self, pytree: Any) -> None:
        self.register_family(ModelOutputLike)
        self.register_family(PointBase)

        # Defined after the registration and never seen by the other implementation.
        @dataclasses.dataclass
        class LateOutput(EncoderOutput):
            logits: Any = None

        @dataclasses.dataclass
        class LatePoint(Point3):
            w: Any = None

        tree = {
            "out": LateOutput(
                last_hidden_state=1, logits=[2, LatePoint(3, None, 4, 5)]
            ),
            "p": (LatePoint(6), None),
        }
        leaves, spec = pytree.tree_flatten(tree)
        self.assertEqual(leaves, [1, 2, 3, 4, 5, 6, None])
        other = cxx_pytree if pytree is py_pytree else py_pytree
        other_leaves, other_spec = other.tree_flatten(tree)
        self.assertEqual(other_leaves, leaves)
        self.assertEqual(
            py_pytree.treespec_dumps(spec), py_pytree.treespec_dumps(other_spec)
        )
        self.assertEqual(pytree.tree_unflatten(leaves, spec), tree)

    @skipIfNoCxxPytree
    def test_cxx_parity_in_fresh_process(self) -> None:
        # The C++ pytree sees a subclass that was created after the registration
        # and that the Python pytree never resolved.
        script = textwrap.dedent(
            """
            import dataclasses
            import torch.utils._pytree as py_pytree
            import torch.utils._cxx_pytree as cxx_pytree

            @dataclasses.dataclass
            class Base:
                x: object
                y: object = None

            cxx_pytree.register_pytree_family(Base)

            @dataclasses.dataclass
            class Late(Base):
                z: object = None

            assert Late not in py_pytree.SUPPORTED_NODES
            leaves, spec = cxx_pytree.tree_flatten([Late(1, z=2)])
            assert leaves == [1, 2], leaves
            assert cxx_pytree.tree_unflatten([3, 4], spec) == [Late(3, z=4)]
            assert cxx_pytree.tree_map(lambda v: v * 2, Late(1)) == Late(2)
            assert cxx_pytree.tree_leaves(Late(1, 2, 3)) == [1, 2, 3]
            assert not cxx_pytree.tree_is_leaf(Late(1))
            print("ok")
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=False
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip(), "ok")

    @pytree_impls
    def test_is_leaf_called_once_per_node_for_new_subclass(self, pytree: Any) -> None:
        # Regression test (found by test_pytree_hypothesis.py): the C++ pytree
        # used to flatten again after registering a family member it had just
        # met, calling is_leaf a second time on the nodes before it.
        @dataclasses.dataclass
        class Base:
            a: Any = None

        self.register_family(Base)

        @dataclasses.dataclass
        class Fresh(Base):
            b: Any = None

        calls: list[Any] = []
        tree = [Fresh(1, 2)]
        leaves, _ = pytree.tree_flatten(
            tree, is_leaf=lambda x: calls.append(x) or False
        )
        self.assertEqual(leaves, [1, 2])
        self.assertEqual(calls, [tree, tree[0], 1, 2])

    @pytree_impls
    def test_is_leaf_callback(self, pytree: Any) -> None:
        self.register_family(PointBase)
        obj = [Point3(1, 2, 3), PointBase(4)]
        leaves, spec = pytree.tree_flatten(obj, is_leaf=lambda x: type(x) is Point3)
        self.assertEqual(leaves, [obj[0], 4])
        self.assertEqual(pytree.tree_unflatten(leaves, spec), obj)


@skipIfTorchDynamo(
    "re-imports a package that it writes, and deletes from sys.modules, around "
    "every test: a Dynamo-wrapped test can see a module object of an earlier "
    "import (two distinct familypkg.base.Base classes)"
)
class FamilyPackageTestCase(FamilyTestCase):
    """Writes a package ``familypkg`` of family members to a temporary directory on ``sys.path``."""

    def setUp(self) -> None:
        super().setUp()
        self.tmpdir = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmpdir.cleanup)
        pkg = os.path.join(self.tmpdir.name, "familypkg")
        os.makedirs(pkg)
        files = {
            "__init__.py": "",
            "base.py": textwrap.dedent(
                """
                import dataclasses

                @dataclasses.dataclass
                class Base:
                    a: object
                    b: object = None

                @dataclasses.dataclass
                class Unrelated:
                    a: object
                """
            ),
            "outputs.py": textwrap.dedent(
                """
                import dataclasses
                from familypkg.base import Base

                @dataclasses.dataclass
                class Out(Base):
                    c: object = None

                class Holder:
                    @dataclasses.dataclass
                    class Nested(Base):
                        pass
                """
            ),
            "other.py": "SIDE_EFFECT = True\n",
            "lazy.py": textwrap.dedent(
                """
                def __getattr__(name):
                    import familypkg.other
                    raise AttributeError(name)
                """
            ),
            # Takes its time to import and registers a pytree node meanwhile.
            "slow.py": textwrap.dedent(
                """
                import dataclasses
                import time
                import torch.utils._pytree as pt
                from familypkg.base import Base

                time.sleep(0.5)

                @dataclasses.dataclass
                class Exact:
                    a: object

                pt.register_dataclass(Exact)

                @dataclasses.dataclass
                class Slow(Base):
                    pass
                """
            ),
        }
        for name, text in files.items():
            with open(os.path.join(pkg, name), "w") as f:
                f.write(text)
        sys.path.insert(0, self.tmpdir.name)
        self.addCleanup(sys.path.remove, self.tmpdir.name)
        self.addCleanup(self._forget_modules)

    def _forget_modules(self) -> None:
        for name in [m for m in sys.modules if m.split(".")[0] == "familypkg"]:
            del sys.modules[name]

    def _spec_json(self, type_name: str) -> str:
        return (
            f'[1, {{"type": "{type_name}", "context": "[[\\"a\\"], [\\"b\\"]]", '
            '"children_spec": [{"type": null, "context": null, "children_spec": []}]}]'
        )


class TestPytreeFamilySerialization(FamilyPackageTestCase):
    def test_loads_without_lazy_family_imports_nothing(self) -> None:
        @dataclasses.dataclass
        class Local:
            a: Any

        self.register_family(Local)
        with self.assertRaisesRegex(NotImplementedError, "is not registered"):
            py_pytree.treespec_loads(self._spec_json("familypkg.outputs.Out"))
        self.assertNotIn("familypkg", sys.modules)

    def test_same_qualname_members_never_load_as_each_other(self) -> None:
        # Classes made by a factory share their module and qualified name: a
        # spec of one must not load back as another (it is refused instead).
        @dataclasses.dataclass
        class Base:
            x: object

        self.register_family(Base)

        def make(tag: str) -> type:
            @dataclasses.dataclass
            class Made(Base):
                pass

            Made.tag = tag
            return Made

        first = make("first")
        leaves, first_spec = py_pytree.tree_flatten(first(1))
        dumped = py_pytree.treespec_dumps(first_spec)  # unique so far
        self.assertIs(py_pytree.treespec_loads(dumped).type, first)
        second = make("second")
        _, second_spec = py_pytree.tree_flatten(second(1))
        for cls, spec in ((first, first_spec), (second, second_spec)):
            self.assertIs(type(py_pytree.tree_unflatten(leaves, spec)), cls)
            with self.assertRaisesRegex(ValueError, "would not load back"):
                py_pytree.treespec_dumps(spec)
        with self.assertRaisesRegex(ValueError, "Several registered pytree node"):
            py_pytree.treespec_loads(dumped)

    def test_redefined_member_loads_as_the_class_its_module_holds(self) -> None:
        module = types.ModuleType("redefined_members")
        self.addCleanup(sys.modules.pop, module.__name__, None)
        sys.modules[module.__name__] = module
        code = textwrap.dedent(
            """
            import dataclasses

            @dataclasses.dataclass
            class Base:
                x: object

            @dataclasses.dataclass
            class Out(Base):
                pass
            """
        )
        exec(code, module.__dict__)
        self.register_family(module.Base)
        old = module.Out
        py_pytree.tree_flatten(old(1))
        exec("@dataclasses.dataclass\nclass Out(Base):\n    pass\n", module.__dict__)
        new = module.Out
        self.assertIsNot(new, old)
        _, spec = py_pytree.tree_flatten(new(1))
        self.assertIs(
            py_pytree.treespec_loads(py_pytree.treespec_dumps(spec)).type, new
        )
        _, old_spec = py_pytree.tree_flatten(old(1))
        with self.assertRaisesRegex(ValueError, "would not load back"):
            py_pytree.treespec_dumps(old_spec)
        # Deregistering the family forgets the ambiguity with the members.
        py_pytree._deregister_pytree_family(module.Base)
        self.assertNotIn("redefined_members.Out", py_pytree._AMBIGUOUS_SERIALIZED_NAMES)
        py_pytree.register_pytree_family(module.Base)
        _, spec = py_pytree.tree_flatten(new(1))
        self.assertIs(
            py_pytree.treespec_loads(py_pytree.treespec_dumps(spec)).type, new
        )

    def test_loads_resolves_imported_class_family(self) -> None:
        importlib.import_module("familypkg.outputs")
        from familypkg.base import Base

        self.register_family(Base)
        spec = py_pytree.treespec_loads(self._spec_json("familypkg.outputs.Out"))
        self.assertIs(spec.type, sys.modules["familypkg.outputs"].Out)
        with self.assertRaisesRegex(NotImplementedError, "is not registered"):
            py_pytree.treespec_loads(self._spec_json("familypkg.base.Unrelated"))


instantiate_parametrized_tests(TestPytreeFamilyResolution)
instantiate_parametrized_tests(TestPytreeFamilyMapping)
instantiate_parametrized_tests(TestPytreeFamilyDataclass)
instantiate_parametrized_tests(TestPytreeFamilySpecs)


if __name__ == "__main__":
    run_tests()
