# Owner(s): ["module: pytree"]

"""Tests for pytree families (``register_pytree_family``).

A family is a base class registered once: the base and all of its subclasses,
present and future, become pytree nodes, while exact registrations keep
precedence. A subclass created after the registration becomes one where torch
needs it, at its next boundary (export, load, DDP), which these tests call as
``_update_pytree_families()``. See ``torch.utils._pytree.register_pytree_family``.
"""

import contextlib
import dataclasses
import gc
import re
import subprocess
import sys
import textwrap
import types
import unittest
import warnings
import weakref
from collections import defaultdict, namedtuple, OrderedDict, UserDict
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
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


T = TypeVar("T")


def _normalized_dumps(spec: Any) -> str:
    # Serialized type names contain this module's name, which is "__main__"
    # or "test_pytree_family" depending on how the file is run.
    return py_pytree.treespec_dumps(spec).replace(f"{__name__}.", "")


class ModelOutputLike(OrderedDict):
    """A stand-in for HuggingFace ``ModelOutput``: an ``OrderedDict`` whose
    dataclass subclasses hold their non-None fields as items too."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


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


class UserDictBase(UserDict):
    pass


class UserDictChild(UserDictBase):
    pass


class ReadOnlyMapping(Mapping):
    """A mapping that is neither a dict nor a UserDict, built from pairs."""

    def __init__(self, pairs: Any = ()) -> None:
        self._data = dict(pairs)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def boundary() -> None:
    """What torch does at the start of an export or a load."""
    py_pytree._update_pytree_families()


class FamilyTestCase(TestCase):
    def setUp(self) -> None:
        super().setUp()
        # The classes of earlier tests, which their cleanups deregistered, are
        # garbage: gone before this test's boundaries walk the subclasses (a
        # class that is alive is registered, and shares its name with this
        # test's class of its parametrization). A dynamo-wrapped run keeps them
        # alive in Dynamo's caches: a test that dumps a spec of its own classes
        # names them once per parametrization.
        py_pytree.treespec_loads.cache_clear()
        gc.collect()

    def register_family(self, base: Any, **kwargs: Any) -> None:
        py_pytree.register_pytree_family(base, **kwargs)
        self.addCleanup(py_pytree._deregister_pytree_family, base)

    def register_node(
        self, registrar: Any, cls: type, *args: Any, **kwargs: Any
    ) -> None:
        # Either module's register_pytree_node registers with both pytrees.
        registrar.register_pytree_node(cls, *args, **kwargs)
        self.addCleanup(py_pytree._deregister_pytree_node, cls)
        if cxx_pytree is not None:
            self.addCleanup(
                cxx_pytree.optree.unregister_pytree_node, cls, namespace="torch"
            )


class TestPytreeFamilyAPI(FamilyTestCase):
    @skipIfNoCxxPytree
    def test_public_api(self) -> None:
        # One registry: a family registered through either module is a family of both.
        for pytree in _PYTREE_MODULES:
            self.assertIn("register_pytree_family", pytree.__all__)
        self.assertIs(
            cxx_pytree.register_pytree_family, py_pytree.register_pytree_family
        )

    def test_rejects_builtin_and_invalid_bases(self) -> None:
        for base in (object, dict, OrderedDict, list, tuple, defaultdict):
            with self.assertRaisesRegex(ValueError, "builtin type"):
                py_pytree.register_pytree_family(base)
        with self.assertRaisesRegex(ValueError, "builtin type"):
            py_pytree.register_pytree_family(namedtuple("Point", ["x", "y"]))
        with self.assertRaisesRegex(TypeError, "expects a class"):
            py_pytree.register_pytree_family(3)  # type: ignore[arg-type]

    def test_argument_pairs(self) -> None:
        with self.assertRaisesRegex(ValueError, "pass flatten_fn with unflatten_fn"):
            py_pytree.register_pytree_family(PointBase, flatten_fn=lambda x: ([], None))
        with self.assertRaisesRegex(ValueError, "to_dumpable_context"):
            py_pytree.register_pytree_family(PointBase, to_dumpable_context=str)
        self.assertTrue(py_pytree.tree_is_leaf(PointBase(1)))

    def test_double_registration_and_unknown_deregistration(self) -> None:
        self.register_family(PointBase)
        with self.assertRaisesRegex(
            ValueError, "already registered as a pytree family"
        ):
            py_pytree.register_pytree_family(PointBase)
        with self.assertRaisesRegex(ValueError, "not registered as a pytree family"):
            py_pytree._deregister_pytree_family(Point3)


class TestPytreeFamilyResolution(FamilyTestCase):
    @pytree_impls
    def test_not_opted_in_stays_leaf(self, pytree: Any) -> None:
        @dataclasses.dataclass
        class Opaque:
            x: Any

        class OpaqueDict(dict):
            pass

        for obj in (Opaque(1), OpaqueDict(a=1), PlainDictChild(a=1), Point3(1, 2)):
            leaves, _ = pytree.tree_flatten([obj])
            self.assertEqual(len(leaves), 1)
            self.assertIs(leaves[0], obj)
            self.assertTrue(pytree.tree_is_leaf(obj))

    @pytree_impls
    def test_subclasses_present_and_future(self, pytree: Any) -> None:
        self.register_family(PointBase)

        @dataclasses.dataclass
        class Point4(Point3):  # defined after the registration
            w: Any = None

        # a leaf, as without a family, until torch's next boundary
        self.assertTrue(pytree.tree_is_leaf(Point4(1)))
        boundary()
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

        boundary()
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(Special(1, 2)), [1, 2])
        # Registered exactly after it became a family member, as transformers
        # does in ModelOutput.__init_subclass__.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.register_node(
                registrar,
                Special,
                lambda p: ([p.x], p.y),
                lambda values, y: Special(next(iter(values)), y),
                serialized_type_name="test.Special",
            )
        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten(Special(1, 2))
            self.assertEqual(leaves, [1])
            self.assertEqual(pytree.tree_unflatten([5], spec), Special(5, 2))
        with self.assertRaisesRegex(ValueError, "already registered as pytree node"):
            py_pytree.register_pytree_node(
                Special, lambda p: ([], None), lambda v, c: Special(0)
            )

    def test_deregistering_a_member_makes_it_a_leaf(self) -> None:
        # As for any class: code that replaces a library's registration with
        # its own (onnx-diagnostic does, for transformers' caches and outputs)
        # removes it, checks that it is gone, and registers its own.
        @dataclasses.dataclass
        class Base:
            x: Any

        @dataclasses.dataclass
        class Member(Base):
            y: Any = None

        self.register_family(Base)
        for exact in (False, True):
            if exact:
                py_pytree.register_pytree_node(
                    Member,
                    lambda m: ([m.y], m.x),
                    lambda values, x: Member(x, next(iter(values))),
                    serialized_type_name="test.Member",
                )
            self.assertEqual(
                py_pytree.tree_leaves(Member(1, 2)), [2] if exact else [1, 2]
            )
            # The Python pytree only, as its docstring says (exporters then
            # unregister the class from optree themselves); the C++ pytree
            # refuses in between, naming the fix.
            py_pytree._deregister_pytree_node(Member)
            self.assertNotIn(Member, py_pytree.SUPPORTED_NODES)
            self.assertNotIn("test.Member", py_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)
            obj = Member(1, 2)
            # (2.15's removes it from both)
            if cxx_pytree is not None and cxx_pytree._follows_python_pytree(Member):
                with self.assertRaisesRegex(ValueError, "unregister it from the C"):
                    cxx_pytree.tree_leaves(obj)
                cxx_pytree.optree.unregister_pytree_node(Member, namespace="torch")
            for pytree in _PYTREE_MODULES:  # a leaf in both
                self.assertEqual(pytree.tree_leaves(obj), [obj])
            # the caller's own registration, in both pytrees
            self.register_node(
                py_pytree, Member, lambda m: ([m.x], m.y), lambda v, y: Member(*v, y)
            )
            for pytree in _PYTREE_MODULES:
                self.assertEqual(pytree.tree_leaves(obj), [1])
            boundary()  # an exact registration stays
            self.assertEqual(py_pytree.tree_leaves(obj), [1])
            self.doCleanups()
            self.register_family(Base)
        # Without one, the member is derived again at the next boundary.
        py_pytree._deregister_pytree_node(Member)
        if cxx_pytree is not None and cxx_pytree._follows_python_pytree(Member):
            cxx_pytree.optree.unregister_pytree_node(Member, namespace="torch")
        boundary()
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(Member(1, 2)), [1, 2])

    def test_replacing_a_registration_never_shows_a_leaf(self) -> None:
        # Flatten at every line that registering and deregistering run: a
        # member is a node in both pytrees at each of them, with the old
        # registration or the new one.
        @dataclasses.dataclass
        class Base:
            x: Any

        @dataclasses.dataclass
        class Member(Base):
            y: Any = None

        self.register_family(Base)
        obj = Member(1, 2)
        files = {py_pytree.__file__, getattr(cxx_pytree, "__file__", None)}
        seen: set[int] = set()

        def check(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code.co_filename in files:
                for pytree in _PYTREE_MODULES:
                    seen.add(len(pytree.tree_leaves(obj)))
            return check

        for registrar in _PYTREE_MODULES:
            sys.settrace(check)
            try:
                registrar.register_pytree_node(
                    Member, lambda m: ([m.x], m.y), lambda v, y: Member(*v, y)
                )
            finally:
                sys.settrace(None)
            self.assertEqual(seen, {1, 2})
            seen.clear()
            py_pytree._deregister_pytree_node(Member)  # and back to the family
            if cxx_pytree is not None:
                with contextlib.suppress(ValueError):  # 2.15 unregisters it too
                    cxx_pytree.optree.unregister_pytree_node(Member, namespace="torch")
            py_pytree._deregister_pytree_family(Base)
            py_pytree.register_pytree_family(Base)

    def test_exact_registration_before_family_is_kept(self) -> None:
        @dataclasses.dataclass
        class Exact(PointBase):
            pass

        self.register_node(
            py_pytree,
            Exact,
            lambda p: ([p.y], p.x),
            lambda values, x: Exact(x, next(iter(values))),
        )
        self.register_family(PointBase)
        self.assertEqual(py_pytree.tree_leaves(Exact(1, 2)), [2])

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
        @dataclasses.dataclass(init=False)
        class Base:
            pass

        class NT(namedtuple("NT", ["a", "b"])):
            __slots__ = ()

        class FamilyNT(namedtuple("FamilyNT", ["a", "b"]), Base):
            pass

        self.register_family(Base)
        _, spec = py_pytree.tree_flatten(NT(1, 2))
        self.assertIs(spec.type, namedtuple)
        self.assertIs(spec.context, NT)
        # A namedtuple that is also a family member keeps the namedtuple rule.
        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten(FamilyNT(1, [2]))
            self.assertEqual(leaves, [1, 2])
            self.assertEqual(pytree.tree_unflatten([3, 4], spec), FamilyNT(3, [4]))

    def test_registration_writes_nothing_on_the_class(self) -> None:
        @dataclasses.dataclass
        class Base:
            def __init_subclass__(cls, tag: str = "", **kwargs: Any) -> None:
                super().__init_subclass__(**kwargs)
                cls.tag = tag

        @dataclasses.dataclass
        class Early(Base, tag="early"):
            x: Any

        namespaces = [dict(vars(Base)), dict(vars(Early))]
        py_pytree.register_pytree_family(Base)

        @dataclasses.dataclass
        class Late(Base, tag="late"):
            x: Any

        boundary()
        self.assertEqual([dict(vars(Base)), dict(vars(Early))], namespaces)
        self.assertEqual((Early.tag, Late.tag), ("early", "late"))
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves([Early(1), Late(2)]), [1, 2])
        py_pytree._deregister_pytree_family(Base)
        objs = [Early(1), Late(2)]
        for pytree in _PYTREE_MODULES:
            self.assertEqual(pytree.tree_leaves(objs), objs)

    def test_family_members_are_freed_with_their_family(self) -> None:
        # A class created and dropped between two boundaries is never registered;
        # a registered member is kept alive, as by register_pytree_node, until
        # the family is deregistered.
        @dataclasses.dataclass
        class Base:
            x: Any

        py_pytree.register_pytree_family(Base)
        refs = []
        for i in range(20):
            cls = dataclasses.make_dataclass(f"Member{i}", [], bases=(Base,))
            if i % 2:
                gc.collect()  # the class of the last round is gone before it
                boundary()
                for pytree in _PYTREE_MODULES:
                    self.assertEqual(pytree.tree_leaves(cls(1)), [1])
            refs.append(weakref.ref(cls))
            del cls
        gc.collect()
        self.assertEqual([r() is not None for r in refs], [False, True] * 10)
        py_pytree._deregister_pytree_family(Base)
        gc.collect()
        self.assertEqual([r for r in refs if r() is not None], [])

    def test_plain_base_is_refused_with_the_fix(self) -> None:
        class Output:
            pass

        with self.assertRaisesRegex(
            TypeError,
            r"register_pytree_family: .*Output is neither a dataclass nor a mapping; "
            r"decorate it with @dataclasses.dataclass, or pass flatten_fn and "
            r"unflatten_fn\.",
        ):
            py_pytree.register_pytree_family(Output)
        self.assertNotIn("__init_subclass__", Output.__dict__)
        # With functions, any base will do.
        self.register_family(
            Output,
            flatten_fn=lambda o: ([o.x], None),
            unflatten_fn=lambda cls, values, _: cls(*values),
        )

        class Holder(Output):
            def __init__(self, x: Any) -> None:
                self.x = x

        boundary()
        for pytree in _PYTREE_MODULES:
            leaves, spec = pytree.tree_flatten(Holder(1))
            self.assertEqual(leaves, [1])
            self.assertEqual(pytree.tree_unflatten([2], spec).x, 2)

    def test_torch_types_are_refused(self) -> None:
        for base in (torch.Tensor, torch.nn.Module, torch.Size):
            self.addCleanup(  # a family that is accepted breaks every pytree call
                lambda b: b in py_pytree._PYTREE_FAMILIES
                and py_pytree._deregister_pytree_family(b),
                base,
            )
            with self.assertRaisesRegex(
                ValueError, "is a builtin type or a torch type.*base class of your own"
            ):
                py_pytree.register_pytree_family(base)
        self.assertEqual(py_pytree.tree_leaves(torch.ones(1) + 1), [torch.ones(1) * 2])

    def test_metaclass_hooks_are_not_called(self) -> None:
        # Membership follows the MRO and type.__subclasses__, never a
        # metaclass's __subclasscheck__ or __subclasses__.
        class Meta(type):
            def __subclasscheck__(cls, subclass: type) -> bool:
                raise RuntimeError("__subclasscheck__ called")

            def __subclasses__(cls) -> list[type]:
                raise RuntimeError("__subclasses__ called")

        @dataclasses.dataclass
        class Base(metaclass=Meta):
            x: Any = None

        @dataclasses.dataclass
        class Early(Base):
            y: Any = None

        self.register_family(Base)

        @dataclasses.dataclass
        class Late(Early):
            z: Any = None

        boundary()
        for pytree in _PYTREE_MODULES:
            self.assertEqual(
                pytree.tree_leaves([Early(1, 2), Late(3, 4, 5)]), [1, 2, 3, 4, 5]
            )

    def test_spec_survives_a_nearer_family(self) -> None:
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
        self.assertEqual(py_pytree.tree_unflatten(leaves, spec), [Leafy(1, 2)])
        self.assertEqual(py_pytree.treespec_dumps(spec), dumped)

    @pytree_impls
    def test_is_leaf_callback(self, pytree: Any) -> None:
        self.register_family(PointBase)
        obj = [Point3(1, 2, 3), PointBase(4)]
        leaves, spec = pytree.tree_flatten(obj, is_leaf=lambda x: type(x) is Point3)
        self.assertEqual(leaves, [obj[0], 4])
        self.assertEqual(pytree.tree_unflatten(leaves, spec), obj)


class TestPytreeFamilyMapping(FamilyTestCase):
    @pytree_impls
    def test_model_output_like_none_fields(self, pytree: Any) -> None:
        self.register_family(ModelOutputLike)
        out = EncoderOutput(
            last_hidden_state=torch.ones(2), hidden_states=(torch.zeros(1), 3)
        )
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
    def test_plain_dict_subclass_constructor(self, pytree: Any) -> None:
        # One convention: the constructor takes the items as pairs. An error of
        # the class's own constructor is the one the caller gets.
        class KwDict(PlainDictBase):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs)

        self.register_family(PlainDictBase)
        obj = PlainDictChild([(1, "a"), ("b", [2, 3])])
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(len(leaves), 3)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), type(obj))
        self.assertEqual(list(rebuilt.items()), list(obj.items()))
        leaves, spec = pytree.tree_flatten(KwDict(a=1))
        with self.assertRaisesRegex(TypeError, "takes 1 positional argument"):
            pytree.tree_unflatten(leaves, spec)

    @pytree_impls
    def test_dataclass_fields_that_are_not_items_are_refused(self, pytree: Any) -> None:
        # A dataclass dict subclass whose fields are not also its items would
        # flatten to no leaves and come back with its fields None.
        self.register_family(PlainDictBase)

        @dataclasses.dataclass
        class Out(PlainDictBase):
            logits: Any = None

        boundary()
        with self.assertRaisesRegex(
            TypeError,
            r"Cannot flatten .*Out .*: its field 'logits' is not one of its items",
        ):
            pytree.tree_flatten(Out(logits=torch.ones(1)))
        self.assertEqual(pytree.tree_leaves(Out()), [])

    @pytree_impls
    def test_a_field_that_is_not_its_item_is_refused(self, pytree: Any) -> None:
        # A ModelOutput-like field and its item are one value: rebuilding would
        # set the attribute to the item.
        self.register_family(ModelOutputLike)
        out = EncoderOutput(last_hidden_state=1)
        object.__setattr__(out, "last_hidden_state", 2)  # as setattr would not
        with self.assertRaisesRegex(
            TypeError, "its field 'last_hidden_state' is not its item"
        ):
            pytree.tree_flatten(out)

    @pytree_impls
    def test_a_field_that_is_a_copy_of_its_tuple_item(self, pytree: Any) -> None:
        # Dynamo rebuilds an object made before a graph break with a copy of a
        # tuple for each reference to it: the same elements, nothing to lose.
        self.register_family(ModelOutputLike)
        out = EncoderOutput(attentions=(torch.ones(1), (torch.zeros(1),)))
        item = out["attentions"]
        object.__setattr__(out, "attentions", (item[0], (*item[1],)))
        self.assertIsNot(out.attentions[1], item[1])
        leaves, spec = pytree.tree_flatten(out)
        self.assertEqual(len(leaves), 2)
        self.assertIs(leaves[1], item[1][0])
        object.__setattr__(out, "attentions", (item[0], (torch.zeros(1),)))
        with self.assertRaisesRegex(TypeError, "its field 'attentions' is not"):
            pytree.tree_flatten(out)

    @pytree_impls
    def test_overridden_keys_keep_values_with_their_keys(self, pytree: Any) -> None:
        class SortedKeys(PlainDictBase):
            def keys(self) -> Any:
                return sorted(super().keys())

        self.register_family(PlainDictBase)
        obj = SortedKeys(b=1, a=2)
        leaves, spec = pytree.tree_flatten(obj)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertEqual(dict(rebuilt.items()), {"a": 2, "b": 1})
        if pytree is py_pytree:
            paths = [
                (py_pytree.keystr(p), v)
                for p, v in py_pytree.tree_leaves_with_path(obj)
            ]
            self.assertEqual(sorted(paths), [("['a']", 2), ("['b']", 1)])

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

    @pytree_impls
    def test_user_dict_round_trip(self, pytree: Any) -> None:
        self.register_family(UserDictBase)

        class Late(UserDictChild):  # defined after the registration
            pass

        boundary()
        t = torch.ones(2)
        for obj in (
            UserDictBase({"a": t, "b": [1, 2]}),
            UserDictChild({2: t, "b": (None,)}),
            Late(a=t, b={"c": 1}),
        ):
            leaves, spec = pytree.tree_flatten(obj)
            self.assertIs(leaves[0], t)
            self.assertFalse(pytree.tree_is_leaf(obj))
            rebuilt = pytree.tree_unflatten(leaves, spec)
            self.assertIs(type(rebuilt), type(obj))
            self.assertEqual(list(rebuilt.items()), list(obj.items()))
            mapped = pytree.tree_map(lambda v: v * 2 if v is t else v, obj)
            self.assertIs(type(mapped), type(obj))
            self.assertEqual(mapped[next(iter(obj))], t * 2)

    @pytree_impls
    def test_read_only_mapping_round_trip(self, pytree: Any) -> None:
        # any collections.abc.Mapping, not only dict and UserDict subclasses
        self.register_family(ReadOnlyMapping)
        obj = ReadOnlyMapping([("x", 1), ("y", [2, 3])])
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(leaves, [1, 2, 3])
        rebuilt = pytree.tree_unflatten([4, 5, 6], spec)
        self.assertIs(type(rebuilt), ReadOnlyMapping)
        self.assertEqual(dict(rebuilt), {"x": 4, "y": [5, 6]})

    def test_user_dict_key_paths(self) -> None:
        self.register_family(UserDictBase)
        obj = UserDictChild({"ids": torch.ones(1), 3: (torch.zeros(1),)})
        path_leaves, _ = py_pytree.tree_flatten_with_path(obj)
        self.assertEqual(
            [path for path, _ in path_leaves],
            [
                (py_pytree.MappingKey("ids"),),
                (py_pytree.MappingKey(3), py_pytree.SequenceKey(0)),
            ],
        )
        self.assertEqual(
            [py_pytree.keystr(path) for path, _ in path_leaves], ["['ids']", "[3][0]"]
        )
        for path, leaf in path_leaves:
            self.assertIs(py_pytree.key_get(obj, path), leaf)

    @pytree_impls
    def test_user_dict_unrebuildable_raises(self, pytree: Any) -> None:
        class Stubborn(UserDictBase):
            def __init__(self, required: int) -> None:
                super().__init__(value=required)

        class Wrapping(UserDictBase):
            # takes pairs and keywords but wraps every value: rebuilding would
            # silently give other items
            def __init__(self, data: Any = (), **kwargs: Any) -> None:
                super().__init__({k: [v] for k, v in dict(data, **kwargs).items()})

        self.register_family(UserDictBase)
        for obj, keys in ((Stubborn(3), "['value']"), (Wrapping(a=1), "['a']")):
            leaves, spec = pytree.tree_flatten(obj)
            with self.assertRaisesRegex(
                TypeError,
                rf"Cannot rebuild .*{type(obj).__name__} \(a member of the pytree "
                rf"family .*UserDictBase\): it does not hold the items "
                rf"{re.escape(keys)} it was rebuilt with",
            ):
                pytree.tree_unflatten(leaves, spec)


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

        self.register_family(Base)

        @dataclasses.dataclass(**options)
        class Child(Base):  # created after the registration
            c: Any = None

        boundary()
        obj = Child(a=1, b=[2, 3], c=None)
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(leaves, [1, 2, 3])
        rebuilt = pytree.tree_unflatten([4, 5, 6], spec)
        self.assertIs(type(rebuilt), Child)
        self.assertEqual(rebuilt, Child(a=4, b=[5, 6], c=None))

    @pytree_impls
    def test_init_false_fields_are_children(self, pytree: Any) -> None:
        @dataclasses.dataclass
        class Base:
            a: Any
            total: Any = dataclasses.field(init=False, default=None)

            def __post_init__(self) -> None:
                self.total = self.a * 2

        self.register_family(Base)
        obj = Base(2)
        obj.total = 5  # set by hand, not by __post_init__
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(leaves, [2, 5])
        rebuilt = pytree.tree_unflatten([3, 7], spec)
        self.assertEqual((rebuilt.a, rebuilt.total), (3, 7))

    def test_key_paths(self) -> None:
        self.register_family(PointBase)
        obj = Point3(x=1, y=None, z={"k": 2})
        path_leaves, _ = py_pytree.tree_flatten_with_path(obj)
        self.assertEqual(
            [py_pytree.keystr(path) for path, _ in path_leaves], [".x", ".z['k']"]
        )
        for path, leaf in path_leaves:
            self.assertEqual(py_pytree.key_get(obj, path), leaf)

    def test_custom_functions(self) -> None:
        @dataclasses.dataclass
        class Base:
            value: Any
            tag: str = "t"

        def unflatten(cls: type, values: Any, tag: Any) -> Any:
            (value,) = values
            return cls(value, tag)

        self.register_family(
            Base,
            flatten_fn=lambda obj: ([obj.value], obj.tag),
            unflatten_fn=unflatten,
            flatten_with_keys_fn=lambda obj: (
                [(py_pytree.GetAttrKey("value"), obj.value)],
                obj.tag,
            ),
        )

        @dataclasses.dataclass
        class Child(Base):
            pass

        boundary()
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
        self.assertEqual(spec1, spec2)
        self.assertEqual(hash(spec1), hash(spec2))
        self.assertNotEqual(spec1, pytree.tree_structure(PointBase(4, 5)))
        self.assertNotEqual(spec1, pytree.tree_structure(Point3(1, None, 3)))

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

        @dataclasses.dataclass
        class LateOutput(EncoderOutput):
            logits: Any = None

        @dataclasses.dataclass
        class LatePoint(Point3):
            w: Any = None

        for cls in (LateOutput, LatePoint):
            cls.__qualname__ += "_" + pytree.__name__.rpartition(".")[2]
        boundary()
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
    def test_cxx_pytree_imported_after_the_registration(self) -> None:
        script = textwrap.dedent(
            """
            import dataclasses
            import torch.utils._pytree as py_pytree

            @dataclasses.dataclass
            class Base:
                x: object
                y: object = None

            @dataclasses.dataclass
            class Early(Base):
                z: object = None

            py_pytree.register_pytree_family(Base)
            import torch.utils._cxx_pytree as cxx_pytree

            @dataclasses.dataclass
            class Late(Base):
                z: object = None

            py_pytree._update_pytree_families()  # as export or load would
            for cls in (Early, Late):
                leaves, spec = cxx_pytree.tree_flatten([cls(1, z=2)])
                assert leaves == [1, 2], leaves
                assert cxx_pytree.tree_unflatten([3, 4], spec) == [cls(3, z=4)]
            print("ok")
            """
        )
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=False
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip(), "ok")


class TestPytreeFamilySerialization(FamilyTestCase):
    def test_a_name_maps_to_one_class(self) -> None:
        # A class defined again has the module and qualified name of the earlier
        # one: the name is the later one's, which its module holds, and a spec
        # of the earlier one does not dump.
        module = types.ModuleType("redefined_members")
        self.addCleanup(sys.modules.pop, module.__name__, None)
        sys.modules[module.__name__] = module
        code = "@dataclasses.dataclass\nclass Out(Base):\n    pass\n"
        exec(
            "import dataclasses\n@dataclasses.dataclass\nclass Base:\n    x: object\n",
            module.__dict__,
        )
        self.register_family(module.Base)
        exec(code, module.__dict__)
        boundary()
        old = module.Out
        old_spec = py_pytree.tree_structure(old(1))
        exec(code, module.__dict__)
        boundary()
        new_spec = py_pytree.tree_structure(module.Out(1))
        dumped = py_pytree.treespec_dumps(new_spec)
        self.assertIs(py_pytree.treespec_loads(dumped).type, module.Out)
        with self.assertRaisesRegex(
            ValueError,
            r"redefined_members.Out names more than one class, which a spec cannot "
            r"tell apart: <class 'redefined_members.Out'>, <class "
            r"'redefined_members.Out'>\. Define each class once",
        ):
            py_pytree.treespec_dumps(old_spec)
        self.assertIs(type(py_pytree.tree_unflatten([2], old_spec)), old)

    def test_classes_made_by_a_factory_share_no_name(self) -> None:
        # Neither is the class its name names: neither dumps, the name loads as
        # neither (a spec of one would load as the other).
        def make(scale: int) -> type:
            @dataclasses.dataclass
            class Scaled(PointBase):
                def scaled(self) -> Any:
                    return self.x * scale

            return Scaled

        self.register_family(PointBase)
        one, hundred = make(1), make(100)
        boundary()
        spec = py_pytree.tree_structure(one(1))
        error = r"\.make\.<locals>\.Scaled names more than one class"
        with self.assertRaisesRegex(ValueError, error):
            py_pytree.treespec_dumps(spec)
        dumped = py_pytree.treespec_dumps(py_pytree.tree_structure(PointBase(1)))
        with self.assertRaisesRegex(ValueError, error):
            py_pytree.treespec_loads(
                dumped.replace("PointBase", f"{hundred.__qualname__}")
            )


class TestPytreeFamilyLostState(FamilyTestCase):
    """A derived flatten carries all of a member's state or refuses, naming it."""

    def assertRefused(self, pytree: Any, obj: Any, reason: str) -> None:
        with self.assertRaisesRegex(
            TypeError,
            rf"Cannot flatten [\w.<>]*{type(obj).__qualname__} \(a member of the "
            rf"pytree family [\w.<>]+\): {reason}\. Register it with "
            r"register_pytree_node, or the family with flatten_fn and unflatten_fn\.",
        ):
            pytree.tree_flatten([obj])

    @pytree_impls
    def test_attribute_set_after_construction(self, pytree: Any) -> None:
        self.register_family(PointBase)
        obj = Point3(1, 2, 3)
        obj.note = "kept nowhere"  # type: ignore[attr-defined]
        self.assertRefused(
            pytree, obj, "its attribute 'note' is not a field, and would be lost"
        )
        del obj.note  # type: ignore[attr-defined]
        self.assertEqual(pytree.tree_leaves(obj), [1, 2, 3])

    @pytree_impls
    def test_mapping_attributes_are_carried_not_structure(self, pytree: Any) -> None:
        # As a tokenizer's output keeps its encodings: the rebuilt object gets
        # them back, but the spec is its keys only: two objects with the same
        # keys have equal specs, whatever they hold besides, and a spec
        # serializes without them (a loaded one rebuilds what the constructor
        # makes from the items).
        class SlotDict(PlainDictBase):
            __slots__ = ("tag",)

        self.register_family(UserDictBase)
        self.register_family(PlainDictBase)
        boundary()
        for cls in (UserDictChild, PlainDictChild, SlotDict):
            obj, other = cls(a=1), cls(a=5)
            if cls is SlotDict:
                obj.tag, other.tag = object(), "other"
            else:
                obj.source, other.source = object(), "other"  # type: ignore[attr-defined]
            state = "tag" if cls is SlotDict else "source"
            mapped = pytree.tree_map(lambda v: v + 1, obj)
            self.assertIs(type(mapped), cls)
            self.assertEqual(dict(mapped), {"a": 2})
            self.assertIs(getattr(mapped, state), getattr(obj, state))
            spec = pytree.tree_structure(obj)
            self.assertEqual(spec, pytree.tree_structure(other))
            self.assertEqual(hash(spec), hash(pytree.tree_structure(other)))
            loaded = py_pytree.treespec_loads(
                py_pytree.treespec_dumps(py_pytree.tree_structure(obj))
            )
            self.assertEqual(loaded, py_pytree.tree_structure(obj))
            self.assertFalse(hasattr(py_pytree.tree_unflatten([3], loaded), state))

    @pytree_impls
    def test_mapping_attribute_holding_a_tensor_is_refused(self, pytree: Any) -> None:
        # It is no item: export would take it as a constant of the example.
        self.register_family(PlainDictBase)
        obj = PlainDictChild(a=1)
        obj.mask = [torch.ones(2)]  # type: ignore[attr-defined]
        self.assertRefused(
            pytree, obj, "its attribute 'mask' holds a tensor, and is no item"
        )

    @pytree_impls
    def test_slots_are_state(self, pytree: Any) -> None:
        @dataclasses.dataclass(slots=True)
        class SlotsBase:
            x: Any

        @dataclasses.dataclass
        class Member(SlotsBase):  # has a __dict__ too
            y: Any = None

        class Cached(SlotsBase):
            __slots__ = ("cache",)

        self.register_family(SlotsBase)
        boundary()
        member, cached = Member(1, 2), Cached(1)
        for obj in (member, cached):  # the fields only: a round trip
            leaves, spec = pytree.tree_flatten(obj)
            rebuilt = pytree.tree_unflatten(leaves, spec)
            self.assertEqual((type(rebuilt), rebuilt.x), (type(obj), 1))
        member.note = "set on a member"  # type: ignore[attr-defined]
        self.assertRefused(
            pytree, member, "its attribute 'note' is not a field, and would be lost"
        )
        cached.cache = "filled"
        self.assertRefused(
            pytree, cached, "its attribute 'cache' is not a field, and would be lost"
        )

    @pytree_impls
    def test_what_python_sets_is_not_state(self, pytree: Any) -> None:
        @dataclasses.dataclass
        class Pair(PointBase, Generic[T]):
            pass

        self.register_family(PointBase)
        boundary()
        obj = Pair[int](1, 2)  # typing sets __orig_class__ on it
        self.assertIn("__orig_class__", vars(obj))
        leaves, spec = pytree.tree_flatten(obj)
        self.assertEqual(pytree.tree_unflatten(leaves, spec), Pair(1, 2))

    @pytree_impls
    def test_default_factory(self, pytree: Any) -> None:
        class Counts(defaultdict):  # type: ignore[type-arg]
            pass

        self.register_family(Counts)
        for factory in (int, None):  # its constructor takes no items
            self.assertRefused(
                pytree, Counts(factory, a=1), "its default_factory would be lost"
            )

    @pytree_impls
    def test_items_that_disagree_with_indexing(self, pytree: Any) -> None:
        class Hiding(PlainDictBase):
            def items(self) -> Any:
                return [(k, v) for k, v in super().items() if not k.startswith("_")]

        class Scaling(PlainDictBase):
            def items(self) -> Any:
                return [(k, v * 10) for k, v in super().items()]

        self.register_family(PlainDictBase)
        for obj in (Hiding(a=1, _b=2), Scaling(a=1)):
            self.assertRefused(
                pytree, obj, r"its items\(\) do not hold what indexing it gives"
            )

    @pytree_impls
    def test_init_and_post_init_do_not_run_again(self, pytree: Any) -> None:
        # A member is rebuilt from its state, as copy.copy rebuilds it: an
        # __init__ or __post_init__ that transforms its fields runs once.
        self.register_family(PointBase)

        class Tripled(PointBase):  # not decorated
            def __init__(self, x: Any, y: Any = None) -> None:
                super().__init__(x * 3, y)

        @dataclasses.dataclass
        class Doubled(PointBase):
            def __post_init__(self) -> None:
                self.x = self.x * 2

        @dataclasses.dataclass
        class WithInitVar(PointBase):
            scale: dataclasses.InitVar[int] = 1

            def __post_init__(self, scale: int) -> None:
                self.x = self.x * scale

        boundary()
        for obj, x in ((Tripled(1), 3), (Doubled(1), 2), (WithInitVar(1, None, 5), 5)):
            leaves, spec = pytree.tree_flatten(obj)
            self.assertEqual(leaves, [x])
            rebuilt = pytree.tree_unflatten(leaves, spec)
            self.assertIs(type(rebuilt), type(obj))
            self.assertEqual((rebuilt.x, rebuilt.y), (x, None))
            self.assertEqual(pytree.tree_map(lambda v: v + 1, obj).x, x + 1)

    @pytree_impls
    def test_fields_made_after_the_first_flatten(self, pytree: Any) -> None:
        # @dataclass applied to a member that was flattened before: its new
        # field is flattened too, not left out by names kept from before.
        self.register_family(PointBase)

        class Late(PointBase):
            z: Any = None

        boundary()
        self.assertEqual(pytree.tree_leaves(Late(1, 2)), [1, 2])
        dataclasses.dataclass(Late)
        leaves, spec = pytree.tree_flatten(Late(1, 2, 3))
        self.assertEqual(leaves, [1, 2, 3])
        self.assertEqual(pytree.tree_unflatten(leaves, spec), Late(1, 2, 3))


instantiate_parametrized_tests(TestPytreeFamilyResolution)
instantiate_parametrized_tests(TestPytreeFamilyLostState)
instantiate_parametrized_tests(TestPytreeFamilyMapping)
instantiate_parametrized_tests(TestPytreeFamilyDataclass)
instantiate_parametrized_tests(TestPytreeFamilySpecs)


if __name__ == "__main__":
    run_tests()
