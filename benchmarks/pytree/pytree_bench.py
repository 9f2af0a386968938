"""Microbenchmarks of the eager pytree hot path: stock vs patched python pytree vs ``_cxx_pytree``.

Everything is timed in ONE process, interleaved round-robin per (case, op), so the
ratios compare implementations measured in the same time window:

* ``stock``   -- the stock PyTorch v2.13.0 ``torch/utils/_pytree.py``, loaded from its
                 source file (``--baseline FILE``) as the alias module ``_pytree_baseline``.
                 It has its own registries; the benchmark's test classes are registered in it.
* ``patched`` -- ``torch.utils._pytree`` of the torch that ``import torch`` gives.
* ``cxx``     -- ``torch.utils._cxx_pytree`` (optree backed) of the same torch.

How to run (from a PyTorch checkout; the script needs only torch, transformers and
matplotlib are optional)::

    git show v2.13.0:torch/utils/_pytree.py > /tmp/stock_pytree.py
    python benchmarks/pytree/pytree_bench.py --baseline /tmp/stock_pytree.py \\
        --json /tmp/pytree_bench.json --plot /tmp/pytree_bench.png

    # CI smoke (< 60 s) and regression gate: exit 1 if any patched/stock ratio > 1.10
    python benchmarks/pytree/pytree_bench.py --baseline /tmp/stock_pytree.py --quick --check 1.10

Without ``--baseline`` only ``patched`` and ``cxx`` are timed and patched/stock ratios
are ``n/a``. Features of a newer ``torch.utils._pytree`` (``register_pytree_family``) are
feature-detected; on a torch without them the family cases are skipped.

Method: every (case, op) is a group of ``torch.utils.benchmark.Timer`` objects, one per
implementation. Each member is calibrated and warmed up once with ``blocked_autorange``;
then each round times ``--blocks`` blocks of ~``--block-time`` seconds (``Timer.timeit``)
for every member of the group, the order alternating between rounds. The round value of a
member is its fastest block (preemption by other processes only ever adds time), and the
reported value is the median over rounds of the round values. The patched/stock and patched/cxx ratios
are paired: the median over rounds of the per-round ratio (members of a round are timed
milliseconds apart, which cancels most of the drift of a shared machine). ``treespec_loads`` is wrapped in ``functools.lru_cache``
in stock (and in ``_cxx_pytree``); the loads statement calls ``cache_clear()`` of every
cache on the path before each call (the same few-ns overhead in every column), so loads
really parses. The single-call cases that a Timer cannot express (a family type seen for
the first time, registering a family over 200 subclasses) use ``time.perf_counter_ns``
around batches, with GC disabled, in the same round-robin scheme. The scaling table
(t(N=10,000) / t(N=1,000) for a flat list) times every implementation at both sizes in one
group, so that ratio is paired per round as well.

Instruction-count mode (``--instructions``; needs valgrind and x86-64 Linux): the same
(case, op) members, respecting ``--cases`` and ``--quick``, are counted with callgrind
instead of timed, so the ratios do not move with machine load::

    # quick: ~1.5 min (~1 min of it is import torch under valgrind); full: ~5 min
    python benchmarks/pytree/pytree_bench.py --baseline /tmp/stock_pytree.py --quick --instructions
    # both modes in one run (time first, natively; the time table gains a patched/stock Ir column)
    python benchmarks/pytree/pytree_bench.py --baseline /tmp/stock_pytree.py --instructions --with-time \\
        --json /tmp/pytree_bench.json

The script runs itself again, with the same arguments, in ONE process under ``valgrind
--tool=callgrind --instr-atstart=no --collect-atstart=no`` (stock, patched and cxx counted
in the same run; ``PYTHONHASHSEED=0`` unless set). Start-up and ``import torch`` run
uninstrumented and uncounted. Then a callgrind client request (the magic no-op instruction
sequence of ``valgrind.h``, a few bytes of machine code called through ctypes) switches the
instrumentation on, and every measured region is bracketed by client requests that toggle
collection on and off and dump; the dump's total is exactly that region's instruction count,
read back at once. Per member: one counted call estimates the cost, ``max(n, 20)`` uncounted
calls warm up (quickening/specialization), then instructions per call = (count of
``timeit(n)`` - count of ``timeit(0)``) / n, with the time mode's statements (GC off). n, the
``calls`` column, is fixed per (case, op): the largest 1-2-5 step that keeps the group's most
expensive member within ``--ir-target`` instructions (default 1e7, quick 2e6). The one-off
family cases count their batches the same way (minus an empty loop). The same command gives
identical counts; another command line or hash seed changes the heap and dict layout, which
moves a few counts by up to ~15% (e.g. whether ``realloc`` can grow a list in place) but
patched/stock ratios by at most ~0.025. ``--ir-rounds N`` repeats every region N times.
``--callgrind-dir DIR`` keeps the dumps (one per region, tagged with case/op/column) for
``callgrind_annotate``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.benchmark import Compare, Measurement, Timer


# this directory (sys.path[0])
from _callgrind import Callgrind, CALLGRIND_OPTIONS  # usort: skip


try:
    import torch.utils._cxx_pytree as cxx_pytree
except ImportError:  # optree missing or too old
    cxx_pytree = None


HAS_FAMILY = hasattr(pytree, "register_pytree_family")
OPS = (
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_leaves",
    "tree_flatten_with_path",
    "treespec_dumps",
    "treespec_loads",
)


# ---------------------------------------------------------------------------
# implementations
# ---------------------------------------------------------------------------


def load_baseline(path: str):
    """Load a stock ``torch/utils/_pytree.py`` under the alias ``_pytree_baseline``."""
    name = "_pytree_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load baseline pytree from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses needs the module in sys.modules
    spec.loader.exec_module(module)
    return module


def _clear_fns(*fns: Any) -> Callable[[], None]:
    clears = [f.cache_clear for f in fns if hasattr(f, "cache_clear")]

    def clear() -> None:
        for c in clears:
            c()

    return clear


def _identity(x: Any) -> Any:
    return x


# ---------------------------------------------------------------------------
# test types
# ---------------------------------------------------------------------------


def _non_none_fields_as_keys(self: Any) -> None:
    # ModelOutput's __post_init__ in short: its non-None fields become its keys.
    for f in dataclasses.fields(self):
        v = getattr(self, f.name)
        if v is not None:
            self[f.name] = v


class HFLikeBase(OrderedDict):
    """Mimics ``transformers.utils.generic.ModelOutput``: an OrderedDict + dataclass fields."""

    __post_init__ = _non_none_fields_as_keys


@dataclasses.dataclass
class HFLikeOutputExact(HFLikeBase):
    last_hidden_state: Any = None
    past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None


@dataclasses.dataclass
class HFLikeOutputFamily(HFLikeBase):
    last_hidden_state: Any = None
    past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None


class SmallBase(OrderedDict):
    __post_init__ = _non_none_fields_as_keys


@dataclasses.dataclass
class SmallExact(SmallBase):
    a: Any = None
    b: Any = None


@dataclasses.dataclass
class SmallFamily(SmallBase):
    a: Any = None
    b: Any = None


def _mapping_flatten(obj: Any) -> tuple[list[Any], list[Any]]:
    # same as transformers' _model_output_flatten
    return list(obj.values()), list(obj.keys())


def _mapping_unflatten(cls: type, values: Any, context: Any) -> Any:
    # same as transformers' _model_output_unflatten
    return cls(**dict(zip(context, values)))


def register_exact(module: Any, cls: type, flatten=None, unflatten=None) -> None:
    """Exact registration of an OrderedDict+dataclass type, the way transformers does it."""
    module.register_pytree_node(
        cls,
        flatten or _mapping_flatten,
        unflatten or functools.partial(_mapping_unflatten, cls),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=module._dict_flatten_with_keys,
    )


def _has_leaves(module: Any, tree: Any, n: int) -> bool:
    try:
        return len(module.tree_leaves(tree)) == n
    except Exception:  # any failure means "does not see the leaves"
        return False


def ensure_family(base: type, probe: Any, n_leaves: int) -> dict[str, bool]:
    """Make ``base`` a family in the patched python pytree (and _cxx_pytree if it supports it).

    Returns which of patched/cxx now flatten ``probe`` (an instance of a non-exact subclass)
    into ``n_leaves`` leaves.
    """
    ok = {"patched": False, "cxx": False}
    if not HAS_FAMILY:
        return ok
    if not _has_leaves(pytree, probe, n_leaves):
        try:
            pytree.register_pytree_family(base)
        except Exception as e:  # already registered lazily, etc.
            print(f"  note: register_pytree_family({base.__name__}): {e!r}")
    ok["patched"] = _has_leaves(pytree, probe, n_leaves)
    if cxx_pytree is not None:
        if not _has_leaves(cxx_pytree, probe, n_leaves) and hasattr(
            cxx_pytree, "register_pytree_family"
        ):
            try:
                cxx_pytree.register_pytree_family(base)
            except Exception as e:
                print(f"  note: cxx register_pytree_family({base.__name__}): {e!r}")
        ok["cxx"] = _has_leaves(cxx_pytree, probe, n_leaves)
    return ok


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


def _tensors(n: int) -> list[torch.Tensor]:
    return [torch.zeros(()) for _ in range(n)]


def case_list(n: int) -> Any:
    return _tensors(n)


def case_dict(n: int) -> Any:
    t = _tensors(n)
    return {f"k{i}": t[i] for i in range(n)}


def case_nested() -> Any:
    t = iter(_tensors(600))
    return [
        {"a": next(t), "b": (next(t), next(t)), "c": [next(t), next(t), next(t)]}
        for _ in range(100)
    ]


def case_deep(depth: int) -> Any:
    tree: Any = torch.zeros(())
    for _ in range(depth):
        tree = [tree]
    return tree


def _kv_layers(n_layers: int, per_layer: int) -> tuple:
    return tuple(tuple(_tensors(per_layer)) for _ in range(n_layers))


@dataclasses.dataclass
class Variant:
    column: str  # "stock" | "patched" | "cxx" | "patched[family]" | "cxx[family]"
    module: Any
    tree: Any
    leaves: int | None = None  # when it differs from the group's (the scaling group)


@dataclasses.dataclass
class Group:
    case: str
    leaves: int
    variants: list[Variant]
    ops: tuple[str, ...]
    # column renames that produce a second output row from the same group
    family_row: str | None = None


def std_variants(impls: dict[str, Any], tree: Any) -> list[Variant]:
    return [Variant(col, mod, tree) for col, mod in impls.items()]


def hf_variants(
    impls: dict[str, Any], exact_tree: Any, family_tree: Any, fam_ok: dict[str, bool]
) -> list[Variant]:
    out = std_variants(impls, exact_tree)
    if fam_ok.get("patched"):
        out.append(Variant("patched[family]", pytree, family_tree))
    if fam_ok.get("cxx") and "cxx" in impls:
        out.append(Variant("cxx[family]", cxx_pytree, family_tree))
    return out


def build_hf_like(impls: dict[str, Any]) -> Group:
    t = _tensors(49)
    kw = {
        "last_hidden_state": t[0],
        "past_key_values": tuple((t[1 + 2 * i], t[2 + 2 * i]) for i in range(24)),
    }
    exact, family = HFLikeOutputExact(**kw), HFLikeOutputFamily(**kw)
    fam_ok = ensure_family(HFLikeBase, family, 49)
    return Group(
        "hf_like_49",
        49,
        hf_variants(impls, exact, family, fam_ok),
        OPS,
        "hf_like_49 [family]",
    )


def build_transformers(impls: dict[str, Any], stock: Any | None) -> list[Group]:
    try:
        from transformers.modeling_outputs import (
            BaseModelOutputWithPast,
            Seq2SeqLMOutput,
        )
        from transformers.utils import generic as hf_generic
    except Exception as e:  # not installed, or an incompatible version
        print(f"  transformers cases skipped: {e!r}")
        return []

    def cache_field(cls: type) -> str:
        names = [f.name for f in dataclasses.fields(cls)]
        return "cache" if "cache" in names else "past_key_values"

    def family_subclass(cls: type) -> type:
        # A subclass of the real class with transformers' auto-registration removed,
        # so the patched pytree resolves it through the ModelOutput family.
        sub = dataclasses.dataclass(
            type(f"Family{cls.__name__}", (cls,), {"__module__": __name__})
        )
        if sub in getattr(pytree, "SUPPORTED_NODES", {}):
            pytree._deregister_pytree_node(sub)
        if cxx_pytree is not None:
            import optree

            with contextlib.suppress(Exception):  # not registered there
                optree.unregister_pytree_node(sub, namespace="torch")
        return sub

    groups = []
    specs = [
        (
            BaseModelOutputWithPast,
            24,
            2,
            lambda cls, t, kv: {"last_hidden_state": t[0], cache_field(cls): kv},
            1,
        ),
        (
            Seq2SeqLMOutput,
            12,
            4,
            lambda cls, t, kv: {
                "loss": t[0],
                "logits": t[1],
                cache_field(cls): kv,
                "encoder_last_hidden_state": t[2],
            },
            3,
        ),
    ]
    for cls, n_layers, per_layer, make_kw, extra in specs:
        n = n_layers * per_layer + extra
        kv = _kv_layers(n_layers, per_layer)
        t = _tensors(extra)
        exact = cls(**make_kw(cls, t, kv))
        if stock is not None and cls not in stock.SUPPORTED_NODES:
            # transformers' own registration functions, registered in the alias module too
            flat = getattr(hf_generic, "_model_output_flatten", None)
            unflat = getattr(hf_generic, "_model_output_unflatten", None)
            register_exact(
                stock,
                cls,
                flat,
                functools.partial(unflat, output_type=cls) if unflat else None,
            )
        sub = family_subclass(cls)
        family = sub(**make_kw(sub, t, kv))
        fam_ok = ensure_family(hf_generic.ModelOutput, family, n) if HAS_FAMILY else {}
        if not _has_leaves(pytree, exact, n):
            print(f"  {cls.__name__}: patched pytree does not see {n} leaves, skipped")
            continue
        name = f"hf_{cls.__name__}_{n}"
        groups.append(
            Group(
                name,
                n,
                hf_variants(impls, exact, family, fam_ok),
                OPS,
                f"{name} [family]",
            )
        )
    return groups


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def make_stmt(op: str, v: Variant) -> tuple[str, dict[str, Any]]:
    m, tree = v.module, v.tree
    if op == "tree_flatten":
        return "f(x)", {"f": m.tree_flatten, "x": tree}
    if op == "tree_unflatten":
        leaves, spec = m.tree_flatten(tree)
        return "f(l, s)", {"f": m.tree_unflatten, "l": leaves, "s": spec}
    if op == "tree_map":
        return "f(g, x)", {"f": m.tree_map, "g": _identity, "x": tree}
    if op == "tree_leaves":
        return "f(x)", {"f": m.tree_leaves, "x": tree}
    if op == "tree_flatten_with_path":
        return "f(x)", {"f": m.tree_flatten_with_path, "x": tree}
    if op == "tree_is_leaf":
        return "f(x)", {"f": m.tree_is_leaf, "x": tree}
    if op == "treespec_dumps":
        return "f(s)", {"f": m.treespec_dumps, "s": m.tree_structure(tree)}
    if op == "treespec_loads":
        s = m.treespec_dumps(m.tree_structure(tree))
        fns = [m.treespec_loads]
        if m is cxx_pytree:
            fns.append(pytree.treespec_loads)  # cxx loads goes through the python loads
        return "c(); f(j)", {"f": m.treespec_loads, "j": s, "c": _clear_fns(*fns)}
    raise ValueError(op)


def validate(
    op: str, v: Variant, stmt_globals: dict[str, Any], n_leaves: int
) -> str | None:
    """Run the op once and check it does real work; return a reason when it cannot be timed."""
    m, tree = v.module, v.tree
    try:
        if op == "tree_is_leaf":
            return None if m.tree_is_leaf(tree) is True else "not a leaf"
        leaves = m.tree_leaves(tree)
        if len(leaves) != n_leaves:
            return f"sees {len(leaves)} leaves, expected {n_leaves}"
        if op == "tree_flatten":
            m.tree_flatten(tree)
        elif op == "tree_unflatten":
            out = m.tree_unflatten(stmt_globals["l"], stmt_globals["s"])
            if type(out) is not type(tree):
                return f"unflatten gave {type(out).__name__}"
        elif op == "tree_map":
            m.tree_map(_identity, tree)
        elif op == "tree_leaves":
            pass
        elif op == "tree_flatten_with_path":
            kl, _ = m.tree_flatten_with_path(tree)
            if len(kl) != n_leaves:
                return "wrong number of paths"
        elif op == "treespec_dumps":
            m.treespec_dumps(stmt_globals["s"])
        elif op == "treespec_loads":
            spec = m.treespec_loads(stmt_globals["j"])
            if spec != m.tree_structure(tree):
                return "loads(dumps(spec)) != spec"
    except Exception as e:  # the reason is reported
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''}"
    return None


@dataclasses.dataclass
class Result:
    case: str
    op: str
    leaves: int
    rounds: dict[str, list[float]]  # column -> per-round medians (seconds)
    skipped: dict[str, str]
    measurements: dict[str, list[Measurement]] = dataclasses.field(default_factory=dict)
    gated: bool = True
    note: str = ""
    calls: int | None = None  # instruction mode: calls per measured region


def group_members(
    group: Group, op: str
) -> tuple[list[tuple[str, str, dict[str, Any]]], dict[str, str]]:
    """(column, stmt, globals) of every member that passes ``validate``, and why the others do not."""
    members: list[tuple[str, str, dict[str, Any]]] = []
    skipped: dict[str, str] = {}
    for v in group.variants:
        try:
            stmt, g = make_stmt(op, v)
        except Exception as e:  # any failure makes the member n/a
            skipped[v.column] = f"{type(e).__name__}"
            continue
        why = validate(op, v, g, v.leaves or group.leaves)
        if why:
            skipped[v.column] = why
            continue
        members.append((v.column, stmt, g))
    return members, skipped


def run_group(
    group: Group, op: str, rounds: int, block_time: float, blocks: int
) -> Result:
    members, skipped = group_members(group, op)
    timers = [
        (col, Timer(stmt, globals=g, label=op, sub_label=group.case, description=col))
        for col, stmt, g in members
    ]
    res = Result(group.case, op, group.leaves, {c: [] for c, _ in timers}, skipped)
    res.measurements = {c: [] for c, _ in timers}
    # Calibrate (and warm up) every member once with blocked_autorange, then time fixed-size
    # blocks of ~block_time: short blocks let the members alternate quickly, so the paired
    # ratios compare measurements taken milliseconds apart.
    number = {}
    for col, timer in timers:
        per_call = timer.blocked_autorange(
            min_run_time=max(0.005, 3 * block_time)
        ).median
        number[col] = max(1, int(block_time / per_call))
    for r in range(rounds):
        order = timers if r % 2 == 0 else timers[::-1]
        for col, timer in order:
            n_blocks = blocks if number[col] > 1 else min(blocks, 2)
            ms = [timer.timeit(number[col]) for _ in range(n_blocks)]
            # fastest block of the round: a block hit by preemption can only get slower
            res.rounds[col].append(min(m.median for m in ms))
            res.measurements[col].extend(ms)
    return res


def _time_batch(fn: Callable[[Any], Any], objs: list[Any]) -> float:
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for o in objs:
            fn(o)
        t1 = time.perf_counter_ns()
    finally:
        if gc_was:
            gc.enable()
    return (t1 - t0) * 1e-9 / len(objs)


Measure = Callable[
    [Callable[[Any], Any], list[Any]], float
]  # (fn, objs) -> cost of one fn(obj)


def run_family_first_seen(
    impls: dict[str, Any], rounds: int, batch: int, measure: Measure = _time_batch
) -> list[Result]:
    """Flatten an instance of a family subclass never seen before (cold) vs seen before (warm).

    Fresh subclasses are created outside the timed region; each timed call flattens an
    instance of a different, never-flattened subclass, so any per-type cache is cold.
    Stock has no family; its column in the [warm] row is the same 2-leaf class registered
    exactly (what a user had to do before), and the [cold] row has no stock column.
    ``measure`` is ``_time_batch`` (seconds per call) or ``Callgrind.per_call`` (instructions).
    """
    t = _tensors(2)
    stock = impls.get("stock")
    if stock is not None and SmallExact not in stock.SUPPORTED_NODES:
        register_exact(stock, SmallExact)
    fam_ok = ensure_family(SmallBase, SmallFamily(a=t[0], b=t[1]), 2)
    cols = [c for c in ("patched", "cxx") if fam_ok.get(c)]
    mods = {"patched": pytree, "cxx": cxx_pytree}
    cold = Result(
        "family_first_seen_2 [cold]",
        "tree_flatten",
        2,
        {c: [] for c in cols},
        {},
        gated=False,
    )
    warm = Result(
        "family_first_seen_2 [warm]", "tree_flatten", 2, {c: [] for c in cols}, {}
    )
    if stock is not None:
        warm.rounds["stock"] = []
    if not cols:
        return []
    counter = 0
    for r in range(rounds):
        order = cols if r % 2 == 0 else cols[::-1]
        for col in order:
            objs = []
            for _ in range(batch):
                counter += 1
                cls = type(
                    f"SmallFresh{counter}", (SmallFamily,), {"__module__": __name__}
                )
                objs.append(cls(a=t[0], b=t[1]))
            flat = mods[col].tree_flatten
            cold.rounds[col].append(measure(flat, objs))
            warm.rounds[col].append(measure(flat, objs))
        if stock is not None:
            objs = [SmallExact(a=t[0], b=t[1]) for _ in range(batch)]
            stock.tree_flatten(objs[0])
            warm.rounds["stock"].append(measure(stock.tree_flatten, objs))
    ratio = (
        statistics.median(
            a / b for a, b in zip(cold.rounds["patched"], warm.rounds["patched"])
        )
        if "patched" in cols
        else float("nan")
    )
    cold.note = f"per call, batches of {batch} fresh subclasses; patched cold/warm = {ratio:.2f}"
    warm.note = (
        "stock = the same 2-field class registered exactly (stock has no family)"
    )
    return [cold, warm]


def run_first_seen_classes(
    impls: dict[str, Any], rounds: int, batch: int, measure: Measure = _time_batch
) -> list[Result]:
    """Flatten a list of ``batch`` leaves, each an instance of a class never seen before.

    The classes are made with ``type()`` outside the measured region and are held by
    nothing but their instances (like classes made in a loop or a local class), so the
    per-class caches of the patched pytree are cold and the classes go to their weakly
    keyed part. Stock has no per-class cache: its cost is what it pays on every call.
    One measured call flattens one such list; 5 lists per measurement.
    """
    cols = [c for c in ("stock", "patched", "cxx") if c in impls]
    sightings = ("cold", "second sight", "third sight")
    results = [
        Result(
            f"first_seen_leaf_classes_{batch} [{sighting}]",
            "tree_flatten",
            batch,
            {c: [] for c in cols},
            {},
            gated=False,
        )
        for sighting in sightings
    ]
    counter = itertools.count()
    for r in range(rounds):
        for col in cols if r % 2 == 0 else cols[::-1]:
            lists = [
                [
                    type(f"FreshLeaf{next(counter)}", (), {"__module__": __name__})()
                    for _ in range(batch)
                ]
                for _ in range(5)
            ]
            for res in results:
                res.rounds[col].append(measure(impls[col].tree_flatten, lists))
            del lists
    results[
        0
    ].note = f"per call, a list of {batch} instances of {batch} never-seen classes"
    results[
        1
    ].note = "the same lists flattened a second time (the patched pytree caches a class at its second sighting)"
    results[2].note = "the same lists a third time (cached)"
    return results


def run_family_registration(
    impls: dict[str, Any],
    rounds: int,
    reps: int,
    n_sub: int = 200,
    measure: Measure = _time_batch,
) -> list[Result]:
    """Make a base with ``n_sub`` subclasses pytree nodes, then flatten one instance of each.

    patched: one ``register_pytree_family(base)`` + first flatten of each subclass.
    stock:   ``n_sub`` exact ``register_pytree_node`` calls + first flatten of each (the only way
             before the patch). Class creation and deregistration are outside the timed region.
    """
    if not HAS_FAMILY:
        return []
    stock = impls.get("stock")
    t = _tensors(2)
    counter = [0]

    def fresh() -> tuple[type, list[type], list[Any]]:
        counter[0] += 1
        base = type(f"RegBase{counter[0]}", (SmallBase,), {"__module__": __name__})
        leaf_cls = dataclasses.dataclass(
            type(
                f"RegLeaf{counter[0]}",
                (base,),
                {
                    "__module__": __name__,
                    "__annotations__": {"a": Any, "b": Any},
                    "a": None,
                    "b": None,
                },
            )
        )
        subs = [
            type(f"RegSub{counter[0]}_{i}", (leaf_cls,), {"__module__": __name__})
            for i in range(n_sub)
        ]
        return base, subs, [c(a=t[0], b=t[1]) for c in subs]

    def patched_once() -> float:
        base, _subs, objs = fresh()

        def work(_: Any) -> None:
            pytree.register_pytree_family(base)
            for o in objs:
                pytree.tree_flatten(o)

        cost = measure(work, [None])
        if len(pytree.tree_leaves(objs[0])) != 2:
            raise RuntimeError("the family registration did not take effect")
        if hasattr(pytree, "_deregister_pytree_family"):
            pytree._deregister_pytree_family(base)
        return cost

    def stock_once() -> float:
        _base, subs, objs = fresh()
        flat, reg, tf = _mapping_flatten, stock.register_pytree_node, stock.tree_flatten
        unflats = [functools.partial(_mapping_unflatten, c) for c in subs]

        def work(_: Any) -> None:
            for c, u in zip(subs, unflats):
                reg(c, flat, u, serialized_type_name=c.__qualname__)
            for o in objs:
                tf(o)

        cost = measure(work, [None])
        if len(stock.tree_leaves(objs[0])) != 2:
            raise RuntimeError("the exact registrations did not take effect")
        for c in subs:
            stock._deregister_pytree_node(c)
        return cost

    fns = {"patched": patched_once}
    if stock is not None:
        fns["stock"] = stock_once
    res = Result(
        f"register_family_{n_sub}_subclasses",
        "register+flatten",
        2 * n_sub,
        {c: [] for c in fns},
        {},
        gated=False,
    )  # one-off cost, not the same operation in both columns: informational
    res.skipped["cxx"] = "not measured"
    cols = list(fns)
    for r in range(rounds):
        for col in cols if r % 2 == 0 else cols[::-1]:
            res.rounds[col].append(statistics.median(fns[col]() for _ in range(reps)))
    res.note = f"whole operation, median of {reps} per round; stock = {n_sub} exact registrations"
    return [res]


# ---------------------------------------------------------------------------
# instruction counts (--instructions)
# ---------------------------------------------------------------------------

CALLGRIND_ENV = (
    "PYTREE_BENCH_CALLGRIND_OUT"  # set by the parent for its child under callgrind
)
MAX_CALLS = 100_000
WARMUP_CALLS = 20  # uncounted calls before the first measured region (at least n)


def _calls_for(ir_target: float, ir_per_call: float) -> int:
    """The largest of 1, 2, 5, 10, 20, 50, ... calls that stays within ``ir_target`` instructions."""
    n = 1
    while n < MAX_CALLS:
        nxt = n * 5 // 2 if str(n)[0] == "2" else n * 2
        if nxt * ir_per_call > ir_target:
            break
        n = nxt
    return n


def count_group(
    group: Group, op: str, cg: Callgrind, ir_target: float, rounds: int
) -> Result:
    """Instructions per call of every member: (count of ``timeit(n)`` - count of ``timeit(0)``) / n.

    The statements are those the time mode times, run by ``timeit.Timer`` (GC off), so the loop
    and call overhead per call is included exactly as in the time mode. One counted call of each
    member estimates its cost; ``n`` is the same for every member of the group: what fits the
    most expensive member into ``ir_target`` instructions, in 1-2-5 steps. Right before its first
    measured region every member runs ``max(n, up to WARMUP_CALLS)`` calls uncounted, so the
    measured calls run quickened, specialized bytecode (the time mode's calibration does that).
    """
    members, skipped = group_members(group, op)
    timers = [(col, timeit.Timer(stmt, globals=g)) for col, stmt, g in members]
    est: dict[str, int] = {}
    for col, t in timers:
        tag = f"{group.case} {op} {col}"
        one = cg.count(functools.partial(t.timeit, 1), f"{tag} x1")
        est[col] = max(one - cg.count(functools.partial(t.timeit, 0), f"{tag} x0"), 1)
    n = _calls_for(ir_target, max(est.values())) if est else 1
    res = Result(
        group.case, op, group.leaves, {c: [] for c, _ in timers}, skipped, calls=n
    )
    base: dict[str, int] = {}
    for r in range(rounds):
        for col, t in timers if r % 2 == 0 else timers[::-1]:
            tag = f"{group.case} {op} {col}"
            if col not in base:
                t.timeit(max(n, min(WARMUP_CALLS, _calls_for(ir_target, est[col]))))
                base[col] = cg.count(functools.partial(t.timeit, 0), f"{tag} x0")
            ir = cg.count(functools.partial(t.timeit, n), f"{tag} x{n}")
            res.rounds[col].append((ir - base[col]) / n)
    return res


def instruction_child(args: argparse.Namespace) -> int:
    """The run under callgrind (started by ``run_instructions``): count, write JSON, no report."""
    out = os.environ[CALLGRIND_ENV]
    cg = Callgrind(out, keep=args.callgrind_dir is not None)
    impls = make_impls(args)
    groups = build_groups(args, impls)
    ir_target = args.ir_target or (2e6 if args.quick else 1e7)
    t0 = time.perf_counter()
    cg.start()
    overhead = [cg.count(lambda: None, "empty region") for _ in range(3)]
    print(
        f"  callgrind: instrumentation on; target {ir_target:.0e} instructions per region",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for g in groups:
        for op in g.ops:
            res = count_group(g, op, cg, ir_target, args.ir_rounds)
            rows.extend(rows_from_result(res, g.family_row, instructions=True))
            print(
                f"  {g.case:<36} {op:<24} x{res.calls:<6} "
                + "  ".join(f"{c}={_median(v):,.0f}" for c, v in res.rounds.items()),
                flush=True,
            )
    if HAS_FAMILY and (
        not args.cases or "family" in args.cases or "first_seen" in args.cases
    ):
        batch = 20 if args.quick else 50
        first_seen = run_family_first_seen(impls, args.ir_rounds, batch, cg.per_call)
        first_seen += run_first_seen_classes(impls, args.ir_rounds, batch, cg.per_call)
        registration = run_family_registration(
            impls, args.ir_rounds, 1, measure=cg.per_call
        )
        for res in first_seen:
            res.calls = batch
        for res in registration:
            res.calls = 1  # the whole operation once
        for res in first_seen + registration:
            rows.extend(rows_from_result(res, None, instructions=True))
            print(
                f"  {res.case:<36} {res.op:<24} "
                + "  ".join(f"{c}={_median(v):,.0f}" for c, v in res.rounds.items()),
                flush=True,
            )
    info = {
        "ir_target": ir_target,
        "ir_rounds": args.ir_rounds,
        "regions": cg.dumps,
        "region_overhead_ir": overhead,
        "counting_seconds": round(time.perf_counter() - t0, 1),
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
    }
    with open(out + ".json", "w") as f:
        json.dump({"rows": rows, "info": info}, f, default=str)
    return 0


def run_instructions(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run this script with the same arguments under callgrind and return what it counted."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit(
            "--instructions needs valgrind on PATH (e.g. apt-get install valgrind)"
        )
    out_dir = args.callgrind_dir or tempfile.mkdtemp(prefix="pytree_bench_callgrind_")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "callgrind.out")
    cmd = [
        valgrind,
        *CALLGRIND_OPTIONS,
        f"--callgrind-out-file={out}",
        sys.executable,
        os.path.abspath(__file__),
        *argv,
    ]
    env = {**os.environ, CALLGRIND_ENV: out}
    env.setdefault(
        "PYTHONHASHSEED", "0"
    )  # same dict/set layouts in every run: repeatable counts
    version = subprocess.run(
        [valgrind, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"\n# instruction counts ({version}): {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise SystemExit(f"the run under callgrind failed (exit status {rc})")
    with open(out + ".json") as f:
        data = json.load(f)
    if args.callgrind_dir is None:
        shutil.rmtree(out_dir)
    data["info"]["valgrind"] = version
    data["info"]["seconds"] = round(time.perf_counter() - t0, 1)
    return data


# ---------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _paired(a: list[float], b: list[float]) -> float | None:
    if not a or not b:
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def rows_from_result(
    res: Result, family_row: str | None, instructions: bool = False
) -> list[dict[str, Any]]:
    """Output rows of a Result: per-round values in s (time) or instructions per call."""
    key, scale = ("ir_per_call", 1.0) if instructions else ("median_us", 1e6)

    def row(case: str, cols: dict[str, str], gated: bool, note: str) -> dict[str, Any]:
        def get(c: str) -> list[float]:
            return res.rounds.get(cols.get(c, ""), [])

        p, s, x = get("patched"), get("stock"), get("cxx")
        med = {
            c: _median(get(c)) * scale for c in ("stock", "patched", "cxx") if get(c)
        }
        d = {
            "case": case,
            "op": res.op,
            "leaves": res.leaves,
            key: med,
            "columns": cols,
            ("rounds_ir" if instructions else "rounds_us"): {
                c: [v * scale for v in get(c)]
                for c in ("stock", "patched", "cxx")
                if get(c)
            },
            "patched_over_stock": _paired(p, s),
            "patched_over_cxx": _paired(p, x),
        }
        if instructions:
            d["calls"] = res.calls
            d["ir_per_leaf_patched"] = (
                (med["patched"] / res.leaves) if "patched" in med else None
            )
        else:
            d["ns_per_leaf_patched"] = (
                (med["patched"] * 1e3 / res.leaves) if "patched" in med else None
            )
        d.update(
            skipped={c: res.skipped[v] for c, v in cols.items() if v in res.skipped},
            gated=gated,
            note=note,
        )
        return d

    out = [
        row(
            res.case,
            {"stock": "stock", "patched": "patched", "cxx": "cxx"},
            res.gated,
            res.note,
        )
    ]
    if family_row:
        fam_cols = {
            "stock": "stock",
            "patched": "patched[family]",
            "cxx": "cxx[family]",
        }
        if "patched[family]" in res.rounds:
            r = row(
                family_row,
                fam_cols,
                True,
                "stock = exact registration (stock has no family)",
            )
            r["family_over_exact"] = _paired(
                res.rounds["patched[family]"], res.rounds.get("patched", [])
            )
            out.append(r)
        else:
            out.append(
                {
                    "case": family_row,
                    "op": res.op,
                    "leaves": res.leaves,
                    key: {},
                    "skipped": {
                        "patched": res.skipped.get(
                            "patched[family]", "no register_pytree_family"
                        )
                    },
                    "gated": False,
                    "note": "skipped",
                }
            )
    return out


def _values(r: dict[str, Any]) -> dict[str, float]:
    """The per-implementation values of a time row (µs) or an instruction row (instructions)."""
    return r.get("median_us") or r.get("ir_per_call") or {}


def _fmt_us(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "n/a"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _fmt_ir(v: float | None) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:,.0f}"


def format_table(rows: list[dict[str, Any]], instructions: bool = False) -> str:
    """The time table, or with ``instructions`` the instruction table (same layout + calls).

    A time row that carries ``ir_patched_over_stock`` (``--instructions --with-time``) gets
    the instruction ratio in an extra column.
    """
    if instructions:
        head = "| case | op | leaves | stock Ir | patched Ir | cxx Ir | patched/stock | patched/cxx | Ir/leaf (patched) | calls |"
        per_leaf, fmt = "ir_per_leaf_patched", _fmt_ir
    else:
        head = "| case | op | leaves | stock µs | patched µs | cxx µs | patched/stock | patched/cxx | ns/leaf (patched) |"
        per_leaf, fmt = "ns_per_leaf_patched", _fmt_us
    with_ir = not instructions and any("ir_patched_over_stock" in r for r in rows)
    if with_ir:
        head += " patched/stock Ir |"
    n_cols = head.count("|") - 1
    lines = [head, "|" + "---|" * n_cols]
    for r in rows:
        med = _values(r)
        if not med:
            lines.append(
                f"| {r['case']} | {r['op']} | {r['leaves']} | skipped: {r.get('skipped')} |"
                + " |" * (n_cols - 4)
            )
            continue
        npl = r.get(per_leaf)
        p_s = _fmt_ratio(r.get("patched_over_stock"))
        if not r.get("gated", True) and r.get("patched_over_stock") is not None:
            p_s += " (not gated)"
        line = "| {case} | {op} | {leaves} | {s} | {p} | {x} | {ps} | {px} | {npl} |".format(
            case=r["case"],
            op=r["op"],
            leaves=r["leaves"],
            s=fmt(med.get("stock")),
            p=fmt(med.get("patched")),
            x=fmt(med.get("cxx")),
            ps=p_s,
            px=_fmt_ratio(r.get("patched_over_cxx")),
            npl="n/a" if npl is None else f"{npl:.0f}",
        )
        if instructions:
            line += f" {r.get('calls') or 'n/a'} |"
        if with_ir:
            line += f" {_fmt_ratio(r.get('ir_patched_over_stock'))} |"
        lines.append(line)
    return "\n".join(lines)


SCALING_OPS = ("tree_flatten", "tree_unflatten", "tree_map", "tree_leaves")


def build_scaling_group(impls: dict[str, Any]) -> Group:
    """Flat lists of 1,000 and 10,000 tensors as members of ONE group.

    Timed in the same rounds, interleaved, so t(10k)/t(1k) is a paired ratio (median of the
    per-round ratios) like patched/stock, instead of a ratio of two medians taken minutes apart.
    """
    small, big = case_list(1000), case_list(10000)
    variants = []
    for col, mod in impls.items():
        variants.append(Variant(f"{col}@1k", mod, small, 1000))
        variants.append(Variant(f"{col}@10k", mod, big, 10000))
    return Group("scaling_list_1k_10k", 1000, variants, SCALING_OPS)


def ir_scaling(ir_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ir(N=10000) / Ir(N=1000) per call of a flat list, from the list_1000 and list_10000 rows."""
    by_case = {(r["case"], r["op"]): _values(r) for r in ir_rows}
    out = []
    for op in SCALING_OPS:
        small, big = (
            by_case.get(("list_1000", op), {}),
            by_case.get(("list_10000", op), {}),
        )
        for impl in ("stock", "patched", "cxx"):
            if small.get(impl) and big.get(impl):
                out.append(
                    {
                        "op": op,
                        "impl": impl,
                        "ir10k_over_ir1k": big[impl] / small[impl],
                        "ir_per_leaf_1k": small[impl] / 1000,
                        "ir_per_leaf_10k": big[impl] / 10000,
                    }
                )
    return out


def scaling(results: list[Result]) -> list[dict[str, Any]]:
    out = []
    for res in results:
        for impl in ("stock", "patched", "cxx"):
            t1, t10 = res.rounds.get(f"{impl}@1k"), res.rounds.get(f"{impl}@10k")
            if t1 and t10:
                out.append(
                    {
                        "op": res.op,
                        "impl": impl,
                        "t10k_over_t1k": _paired(t10, t1),
                        "ns_per_leaf_1k": _median(t1) * 1e9 / 1000,
                        "ns_per_leaf_10k": _median(t10) * 1e9 / 10000,
                    }
                )
    return out


def _pkg_version(name: str) -> str:
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:
        return "not installed"


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def machine_header(args: argparse.Namespace) -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    h = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_pytree_file": pytree.__file__,
        "optree": _pkg_version("optree"),
        "transformers": _pkg_version("transformers"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "loadavg_before": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "patched_has_register_pytree_family": HAS_FAMILY,
        "baseline": args.baseline,
        "mode": "quick" if args.quick else "full",
        "rounds": args.rounds,
        "block_time_s": args.block_time,
        "blocks_per_round": args.blocks,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    if args.baseline:
        h["baseline_sha256"] = _sha256(args.baseline)
        h["patched_source_identical_to_baseline"] = (
            _sha256(pytree.__file__) == h["baseline_sha256"]
        )
    return h


def plot(
    rows: list[dict[str, Any]],
    path: str,
    key: str = "median_us",
    ylabel: str = "median µs per call",
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written"
        )
        return
    ops = ["tree_flatten", "tree_unflatten", "tree_map", "tree_leaves"]
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.6), squeeze=False)
    for ax, op in zip(axes[0], ops):
        pts = sorted(
            (r["leaves"], r)
            for r in rows
            if r["case"].startswith("list_") and r["op"] == op
        )
        for impl in ("stock", "patched", "cxx"):
            xs = [n for n, r in pts if impl in r.get(key, {})]
            ys = [r[key][impl] for n, r in pts if impl in r.get(key, {})]
            if xs:
                ax.loglog(xs, ys, marker="o", label=impl)
        ax.set_title(f"{op}, flat list")
        ax.set_xlabel("N leaves")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def build_groups(args: argparse.Namespace, impls: dict[str, Any]) -> list[Group]:
    stock = impls.get("stock")
    groups: list[Group] = []
    list_ns = (10, 1000) if args.quick else (10, 100, 1000, 10000)
    dict_ns = (100,) if args.quick else (10, 100, 1000)
    # --quick: the (ms-long, noisy) treespec (de)serialization only on the small cases
    big_ops = (
        tuple(op for op in OPS if not op.startswith("treespec_")) if args.quick else OPS
    )
    for n in list_ns:
        groups.append(
            Group(
                f"list_{n}",
                n,
                std_variants(impls, case_list(n)),
                OPS if n <= 100 else big_ops,
            )
        )
    for n in dict_ns:
        groups.append(Group(f"dict_{n}", n, std_variants(impls, case_dict(n)), big_ops))
    groups.append(
        Group(
            "nested_100x{a,b:(2),c:[3]}",
            600,
            std_variants(impls, case_nested()),
            big_ops,
        )
    )
    if stock is not None:
        register_exact(stock, HFLikeOutputExact)
    register_exact(pytree, HFLikeOutputExact)  # also registers with _cxx_pytree
    groups.append(build_hf_like(impls))
    if not args.quick:
        groups.extend(build_transformers(impls, stock))
    groups.append(
        Group("deep_chain_200", 1, std_variants(impls, case_deep(200)), big_ops)
    )
    groups.append(
        Group(
            "single_leaf",
            1,
            std_variants(impls, torch.zeros(())),
            ("tree_is_leaf", "tree_flatten", "tree_map"),
        )
    )
    if args.cases:
        groups = [g for g in groups if re.search(args.cases, g.case)]
    return groups


def run_group_and_report(group: Group, op: str, args: argparse.Namespace) -> Result:
    """``run_group`` with the run's settings, printing one progress line (median µs per member)."""
    res = run_group(group, op, args.rounds, args.block_time, args.blocks)
    print(
        f"  {group.case:<36} {op:<24} "
        + "  ".join(f"{c}={_median(v) * 1e6:.2f}µs" for c, v in res.rounds.items()),
        flush=True,
    )
    return res


def make_impls(args: argparse.Namespace) -> dict[str, Any]:
    impls: dict[str, Any] = {}
    if args.baseline:
        impls["stock"] = load_baseline(args.baseline)
    impls["patched"] = pytree
    if cxx_pytree is not None:
        impls["cxx"] = cxx_pytree
    return impls


def print_tables(
    rows: list[dict[str, Any]], sc: list[dict[str, Any]], instructions: bool
) -> None:
    """The results table, the flat-list scaling and family/exact tables of one mode."""
    if instructions:
        print(
            "\n## Instructions per call (callgrind Ir: (count of n calls - count of 0 calls) / n; "
            "n = calls, fixed per case; ratios of counts)\n"
        )
    else:
        print(
            "\n## Results (µs per call: median over rounds of the fastest block per round; ratios paired per round)\n"
        )
    print(format_table(rows, instructions))
    if sc and instructions:
        print(
            "\n## Scaling, flat list: Ir(N=10000) / Ir(N=1000) per call (10 = linear)\n"
        )
        print(
            "| op | impl | Ir(10k)/Ir(1k) | Ir/leaf @1k | Ir/leaf @10k |\n|---|---|---|---|---|"
        )
        for s in sc:
            print(
                f"| {s['op']} | {s['impl']} | {s['ir10k_over_ir1k']:.2f} | {s['ir_per_leaf_1k']:.0f} | {s['ir_per_leaf_10k']:.0f} |"
            )
    elif sc:
        print(
            "\n## Scaling, flat list: t(N=10000) / t(N=1000), paired per round (10 = linear)\n"
        )
        print(
            "| op | impl | t(10k)/t(1k) | ns/leaf @1k | ns/leaf @10k |\n|---|---|---|---|---|"
        )
        for s in sc:
            print(
                f"| {s['op']} | {s['impl']} | {s['t10k_over_t1k']:.2f} | {s['ns_per_leaf_1k']:.0f} | {s['ns_per_leaf_10k']:.0f} |"
            )
    fam = [r for r in rows if r.get("family_over_exact") is not None]
    if fam:
        what = "instructions" if instructions else "paired"
        print(
            f"\n## Family handler vs exact registration (patched python pytree, {what})\n"
        )
        print("| case | op | family/exact |\n|---|---|---|")
        for r in fam:
            print(f"| {r['case']} | {r['op']} | {r['family_over_exact']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline", metavar="FILE", help="a stock torch/utils/_pytree.py (v2.13.0)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="CI smoke: few cases, small N (< 60 s)"
    )
    parser.add_argument(
        "--check",
        type=float,
        metavar="RATIO",
        help="exit 1 listing every case whose paired patched/stock ratio > RATIO "
        "(with --instructions: also every instruction ratio)",
    )
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of time (with --instructions only: instructions) vs N (needs matplotlib)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="round-robin rounds per (case, op) (default 40, quick 10)",
    )
    parser.add_argument(
        "--block-time",
        type=float,
        default=0.001,
        help="target duration of one timed block, s (default 0.001)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=5,
        help="blocks per implementation per round; the round value is the fastest (default 5)",
    )
    parser.add_argument(
        "--cases", metavar="REGEX", help="only run cases whose name matches"
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="do not print torch.utils.benchmark.Compare tables",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per call under valgrind's callgrind instead of timing "
        "(stock vs patched in one run under callgrind; stable on a loaded machine)",
    )
    parser.add_argument(
        "--with-time",
        action="store_true",
        help="with --instructions: run the time mode too (first, natively) and report both",
    )
    parser.add_argument(
        "--ir-target",
        type=float,
        metavar="N",
        help="instructions per measured region; calls per case = N / instructions of one call "
        "of its most expensive member, in 1-2-5 steps, >= 1 (default 1e7, quick 2e6)",
    )
    parser.add_argument(
        "--ir-rounds",
        type=int,
        default=1,
        help="measured regions per implementation in instruction mode (default 1)",
    )
    parser.add_argument(
        "--callgrind-dir",
        metavar="DIR",
        help="keep the callgrind dumps (one per region, for callgrind_annotate) in DIR",
    )
    args = parser.parse_args(argv)
    if args.check is not None and not args.baseline:
        parser.error("--check needs --baseline (the ratios are patched/stock)")
    if args.with_time and not args.instructions:
        parser.error("--with-time goes with --instructions")
    if args.ir_rounds < 1:
        parser.error("--ir-rounds must be >= 1")
    if os.environ.get(CALLGRIND_ENV):
        return instruction_child(args)
    if args.instructions and shutil.which("valgrind") is None:
        parser.error(
            "--instructions needs valgrind on PATH (e.g. apt-get install valgrind)"
        )
    args.rounds = args.rounds or (10 if args.quick else 40)
    timed = not args.instructions or args.with_time

    t_start = time.perf_counter()
    impls = make_impls(args)
    header = machine_header(args)
    if not timed:
        for k in ("rounds", "block_time_s", "blocks_per_round"):
            del header[k]
    print("# pytree microbenchmark")
    for k, v in header.items():
        print(f"- {k}: {v}")
    if not HAS_FAMILY:
        print(
            "- note: torch.utils._pytree has no register_pytree_family; family cases skipped"
        )

    results: list[Result] = []
    rows: list[dict[str, Any]] = []
    scaling_results = []
    if timed:
        groups = build_groups(args, impls)
        for g in groups:
            for op in g.ops:
                res = run_group_and_report(g, op, args)
                results.append(res)
                rows.extend(rows_from_result(res, g.family_row))
        if HAS_FAMILY and (
            not args.cases or "family" in args.cases or "first_seen" in args.cases
        ):
            for res in run_family_first_seen(
                impls, args.rounds, batch=20 if args.quick else 50
            ):
                results.append(res)
                rows.extend(rows_from_result(res, None))
            for res in run_first_seen_classes(
                impls, args.rounds, batch=20 if args.quick else 50
            ):
                results.append(res)
                rows.extend(rows_from_result(res, None))
            for res in run_family_registration(
                impls, args.rounds, reps=1 if args.quick else 3
            ):
                results.append(res)
                rows.extend(rows_from_result(res, None))
        if not args.quick and (
            not args.cases or re.search(args.cases, "scaling_list_1k_10k")
        ):
            sg = build_scaling_group(impls)
            for op in sg.ops:
                scaling_results.append(run_group_and_report(sg, op, args))
    ir_rows: list[dict[str, Any]] = []
    if args.instructions:
        ir = run_instructions(args, sys.argv[1:] if argv is None else argv)
        ir_rows = ir["rows"]
        header["instructions"] = ir["info"]
        by_case = {(r["case"], r["op"]): r for r in ir_rows}
        for r in rows:
            if (r["case"], r["op"]) in by_case:
                r["ir_patched_over_stock"] = by_case[(r["case"], r["op"])].get(
                    "patched_over_stock"
                )
    header["loadavg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    header["total_seconds"] = round(time.perf_counter() - t_start, 1)

    if not args.no_compare:
        ms = [m for res in results for ml in res.measurements.values() for m in ml]
        if ms:
            Compare(Measurement.merge(ms)).print()

    sc = scaling(scaling_results)
    if rows:
        print_tables(rows, sc, instructions=False)
    ir_sc = ir_scaling(ir_rows)
    if ir_rows:
        print_tables(ir_rows, ir_sc, instructions=True)
    report_rows = rows or ir_rows
    notes = dict.fromkeys(
        (r["case"], r["note"]) for r in report_rows if r.get("note") and _values(r)
    )
    if notes:
        print("\nNotes:")
        for case, note in notes:
            print(f"- {case}: {note}")
    skipped = [
        (r["case"], r["op"], r["skipped"]) for r in report_rows if r.get("skipped")
    ]
    if skipped:
        print("\nNot timed (n/a):" if rows else "\nNot counted (n/a):")
        for case, op, why in skipped:
            print(f"- {case} / {op}: {why}")
    if args.instructions:
        info = header["instructions"]
        print(
            f"\ninstruction counts: {info['regions']} callgrind regions, {info['seconds']} s under callgrind"
        )
    print(
        f"\nloadavg after: {header['loadavg_after']}; total {header['total_seconds']} s"
    )

    if args.json:
        out = {"header": header, "rows": rows, "scaling": sc}
        if args.instructions:
            out.update(instruction_rows=ir_rows, instruction_scaling=ir_sc)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"JSON written to {args.json}")
    if args.plot:
        if rows:
            plot(rows, args.plot)
        else:
            plot(ir_rows, args.plot, key="ir_per_call", ylabel="instructions per call")

    if args.check is not None:
        bad = [
            (r, kind)
            for kind, rs in (("", rows), (" (instructions)", ir_rows))
            for r in rs
            if r.get("gated", True)
            and r.get("patched_over_stock") is not None
            and r["patched_over_stock"] > args.check
        ]
        if bad:
            print(
                f"\nCHECK FAILED: {len(bad)} case(s) with patched/stock > {args.check}:"
            )
            for r, kind in bad:
                print(f"  {r['case']} / {r['op']}{kind}: {r['patched_over_stock']:.3f}")
            return 1
        print(f"\nCHECK OK: every gated patched/stock ratio <= {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
