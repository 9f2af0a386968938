# Owner(s): ["module: pytree"]

"""Concurrency tests of pytree families: threads that flatten while families and
exact registrations change, boundaries (``_update_pytree_families()``, what an
export or a load runs first) in several threads, imports in other threads.
Time-bounded and thread-scheduled, so they stay in this repository's suites (not
sent upstream).
"""

import dataclasses
import importlib
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
)


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from test_pytree_family import (  # noqa: E402
    _PYTREE_MODULES,
    cxx_pytree,
    FamilyTestCase,
    skipIfNoCxxPytree,
)
from test_pytree_family_lazy import FamilyPackageTestCase  # noqa: E402


class TestPytreeFamilyThreads(FamilyTestCase):
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
        # Two threads cross a boundary and flatten the same new family member
        # at the same time: both must see a node, in every round.
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
                py_pytree._update_pytree_families()
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

    def test_stress_registration_while_flattening(self) -> None:
        # 8 threads for a bounded time: two (de)register a family and an exact
        # node, six flatten, unflatten and map with both pytrees, on members of
        # a family that stays registered (some of them created on the way, and
        # registered by a boundary), of the toggled family and plain containers.
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
                        cxx_pytree.optree.unregister_pytree_node(Exact, namespace="torch")
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
            try:
                while time.monotonic() < deadline:
                    py_pytree.register_pytree_family(ToggledBase)
                    py_pytree._deregister_pytree_family(ToggledBase)
            except Exception as e:
                errors.append(f"toggle_family: {type(e).__name__}: {e}")

        def toggle_exact() -> None:
            try:
                while time.monotonic() < deadline:
                    py_pytree.register_pytree_node(
                        Exact,
                        lambda e: ([e.v], None),
                        lambda v, _: Exact(next(iter(v))),
                    )
                    deregister_exact()
            except Exception as e:
                errors.append(f"toggle_exact: {type(e).__name__}: {e}")

        def work(seed: int) -> None:
            n = 0
            try:
                while time.monotonic() < deadline:
                    pytree = _PYTREE_MODULES[(seed + n) % len(_PYTREE_MODULES)]
                    member_cls = StableBase
                    if n % 5 == 0:
                        member_cls = dataclasses.make_dataclass(
                            f"New{seed}_{n}", [], bases=(StableBase,)
                        )
                        py_pytree._update_pytree_families()
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


    def test_member_is_never_a_leaf_while_registrations_churn(self) -> None:
        # Two threads create 200 members of a family, register them at a boundary
        # and replace each one's derived registration with an exact one, as fast
        # as they can, with a switch interval of 1 us; six others flatten the
        # newest member with both pytrees: never a leaf. When the churn ends,
        # each class has the exact registration, as after a sequential run.
        @dataclasses.dataclass
        class Base:
            x: Any
            y: Any = None

        newest: list[type] = [dataclasses.make_dataclass("Churned", [], bases=(Base,))]
        self.register_family(Base)
        created: list[type] = []
        switch = sys.getswitchinterval()
        self.addCleanup(sys.setswitchinterval, switch)
        sys.setswitchinterval(1e-6)
        done = threading.Event()  # set when the churn ends
        errors: list[str] = []
        flattens = [0] * 6

        def churn(i: int) -> None:
            try:
                while len(created) < 200 and not errors:
                    cls = dataclasses.make_dataclass(f"Churned{i}", [], bases=(Base,))
                    py_pytree._update_pytree_families()
                    newest[0] = cls
                    py_pytree.register_pytree_node(
                        cls,
                        lambda m: ([m.x, m.y], type(m)),
                        lambda v, c: c(*v),
                    )
                    created.append(cls)
            except Exception:
                errors.append(traceback.format_exc())

        def flatten(i: int) -> None:
            pytree = _PYTREE_MODULES[i % len(_PYTREE_MODULES)]
            while not done.is_set():
                leaves = pytree.tree_leaves(newest[0](1, 2))
                flattens[i] += 1
                if leaves != [1, 2]:
                    errors.append(f"{pytree.__name__}: {leaves}")
                    return

        churners = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
        threads = churners + [
            threading.Thread(target=flatten, args=(i,)) for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in churners:
            t.join(timeout=120)
        done.set()
        for t in threads:
            t.join(timeout=60)
        self.assertFalse(any(t.is_alive() for t in threads), "a thread hangs")
        self.assertFalse(errors, "\n".join(errors[:3]))
        self.assertGreater(min(flattens), 100)
        self.assertGreaterEqual(len(created), 200)
        for cls in created:  # exact, in both pytrees, as after a sequential run
            self.assertIsNone(py_pytree._family_of(py_pytree.SUPPORTED_NODES[cls]))
            for pytree in _PYTREE_MODULES:
                leaves, spec = pytree.tree_flatten(cls(3, 4))
                self.assertEqual(pytree.tree_unflatten(leaves, spec), cls(3, 4))


class TestPytreeFamilyLazyThreads(FamilyPackageTestCase):
    FILES = {
        **FamilyPackageTestCase.FILES,
        # Takes its time to import and registers a pytree node meanwhile.
        "slow.py": """
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
            """,
    }

    def test_import_in_another_thread_does_not_deadlock(self) -> None:
        # One thread imports a module that registers a pytree node while it is
        # imported; others cross boundaries meanwhile, which resolve a family
        # named in that module and wait for its import. The registry lock is
        # never held across an import, so all of them finish, with no error.
        self.register_family("familypkg.slow:Slow")
        errors: list[str] = []
        done = threading.Event()

        def run(fn: Any) -> None:
            try:
                fn()
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

        def boundaries() -> None:
            while not done.is_set():
                py_pytree._update_pytree_families()

        def import_slow() -> None:
            importlib.import_module("familypkg.slow")
            done.set()

        threads = [
            threading.Thread(target=run, args=(import_slow,)),
            threading.Thread(target=run, args=(boundaries,)),
            threading.Thread(target=run, args=(boundaries,)),
        ]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=30)
        self.assertFalse(any(t.is_alive() for t in threads), "deadlock")
        self.assertEqual(errors, [], "\n".join(errors))
        py_pytree._update_pytree_families()
        self.assertIs(
            py_pytree.treespec_loads(self.spec_json("familypkg.slow.Slow")).type,
            sys.modules["familypkg.slow"].Slow,
        )

    def test_loads_while_lazy_families_change(self) -> None:
        self.register_family("familypkg.base:Base")
        importlib.import_module("familypkg.outputs")
        deadline = time.monotonic() + 2.0
        errors: list[str] = []
        loads = [0]

        def toggle() -> None:
            while time.monotonic() < deadline:
                py_pytree.register_pytree_family("familypkg.other:Thing")
                py_pytree._deregister_pytree_family("familypkg.other:Thing")

        def load() -> None:
            spec_json = self.spec_json("familypkg.outputs.Out")
            while time.monotonic() < deadline:
                try:
                    spec = py_pytree.treespec_loads(spec_json)
                    if spec.type is not sys.modules["familypkg.outputs"].Out:
                        errors.append(f"loaded {spec.type}")
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                loads[0] += 1

        threads = [threading.Thread(target=toggle)] + [
            threading.Thread(target=load) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertEqual(errors[:3], [], "\n".join(errors[:3]))
        self.assertGreater(loads[0], 100)


instantiate_parametrized_tests(TestPytreeFamilyThreads)


if __name__ == "__main__":
    run_tests()
