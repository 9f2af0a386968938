"""Microbenchmarks of the Python pytree: stock vs patched vs ``_cxx_pytree``, one process.

The stock ``torch/utils/_pytree.py`` of the same release (``--baseline``) is loaded as
the module ``_pytree_stock`` next to the ``torch.utils._pytree`` and ``_cxx_pytree``
that ``import torch`` gives. Each (tree, op) is timed with ``torch.utils.benchmark``'s
``Timer``, the implementations interleaved, and patched/stock is the median of the
ratios of the rounds. Instructions are counted with ``Timer.collect_callgrind``: its
child process takes a minute to import torch under valgrind, so one child counts all
statements. The family trees use ``register_pytree_family`` if the patched pytree has
it; stock registers their classes exactly, as libraries do without families.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import timeit
from collections import OrderedDict
from typing import Any, TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch.utils.benchmark import Compare, Measurement, Timer


if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

try:
    import torch.utils._cxx_pytree as cxx_pytree
except ImportError:  # optree is missing or too old
    cxx_pytree = None

HERE = os.path.dirname(os.path.abspath(__file__))
HAS_FAMILY = hasattr(pytree, "register_pytree_family")
OPS = ("tree_flatten", "tree_unflatten", "tree_map", "tree_leaves")
STMT = {"tree_unflatten": "f(l, s)", "tree_map": "f(g, x)"}  # the others: f(x)


def load_alias(name: str, path: str) -> Any:
    """Import the source file ``path`` as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses looks its module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _t(n: int) -> list[torch.Tensor]:
    return [torch.zeros(()) for _ in range(n)]


class OutputBase(OrderedDict):
    """Like transformers' ``ModelOutput``: a dataclass whose non-None fields are items."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


@dataclasses.dataclass
class Output(OutputBase):
    last_hidden_state: Any = None
    past_key_values: Any = None
    attentions: Any = None


@dataclasses.dataclass
class CacheBase:
    """Like transformers' ``Cache``: a base class of dataclasses."""


@dataclasses.dataclass
class Layer(CacheBase):
    keys: Any = None
    values: Any = None


@dataclasses.dataclass
class Cache(CacheBase):
    layers: list[Layer] = dataclasses.field(default_factory=list)


def _nested() -> list[dict[str, Any]]:
    return [{"a": a, "b": (b, c), "c": [d, e, f]} for a, b, c, d, e, f in [_t(6)] * 100]


def _chain(depth: int) -> Any:
    return [_chain(depth - 1)] if depth else torch.zeros(())


FIRST_SIGHT = "50 leaves of 50 new classes, first sight"
NESTED = "100 x `{a: t, b: (t, t), c: [t, t, t]}`"
CASES: dict[str, tuple[int, Callable[[], Any]]] = {
    "list of 10": (10, lambda: _t(10)),
    "list of 1,000": (1000, lambda: _t(1000)),
    "list of 10,000": (10000, lambda: _t(10000)),
    "dict of 1,000": (1000, lambda: {f"k{i}": t for i, t in enumerate(_t(1000))}),
    NESTED: (600, _nested),
    "ModelOutput-like, 24 layers (family)": (
        49,
        lambda: Output(torch.zeros(()), tuple(tuple(_t(2)) for _ in range(24))),
    ),
    "cache-like, 24 layers (family)": (48, lambda: Cache([Layer(*_t(2))] * 24)),
    "chain of 200 nested lists": (1, lambda: _chain(200)),
    "single tensor": (1, lambda: torch.zeros(())),
    FIRST_SIGHT: (50, lambda: [type("New", (), {})() for _ in range(50)]),
}
NOT_GATED = ("(family)", "first sight")  # opted in, or a one-off cost


def goal(case: str, op: str) -> float:
    """The most that patched/stock may be, gated by ``--check`` without a RATIO."""
    if case.endswith("(family)"):  # stock: the same classes, registered by hand
        return 0.50
    if case in ("list of 10", "list of 1,000", "dict of 1,000", NESTED):
        return {"tree_flatten": 0.45, "tree_map": 0.50}.get(op, 1.00)
    return 1.00


def make_impls(baseline: str | None, cxx: bool = True) -> dict[str, Any]:
    """The implementations: families in the patched pytree, exact classes in stock."""
    stock = load_alias("_pytree_stock", baseline) if baseline else None
    for m in (stock, None if HAS_FAMILY else pytree):
        if m is not None:
            flatten = lambda d: (list(d.values()), list(d))  # noqa: E731
            m.register_pytree_node(
                Output, flatten, lambda v, k: Output(**dict(zip(k, v)))
            )
            m.register_dataclass(Layer)
            m.register_dataclass(Cache)
    if HAS_FAMILY:
        pytree.register_pytree_family(OutputBase)
        pytree.register_pytree_family(CacheBase)
    impls = {"stock": stock, "patched": pytree, "cxx": cxx_pytree if cxx else None}
    return {k: v for k, v in impls.items() if v is not None}


# Statements, timing, counting and the report (cxx_pytree_bench.py uses them too)


@dataclasses.dataclass
class Member:
    """A statement of implementation ``impl`` in the group (``case``, ``op``)."""

    case: str
    op: str
    impl: str
    stmt: str
    make_globals: Callable[[int], dict[str, Any]]  # for n calls

    @property
    def key(self) -> tuple[str, str]:
        return (self.case, self.op)

    def timer(self, n: int) -> timeit.Timer:
        return timeit.Timer(self.stmt, globals=self.make_globals(n))

    def one_call(self) -> float:
        return min(self.timer(1).timeit(1) for _ in range(3))


def op_member(key: tuple, impl: str, m: Any, tree: Any, fresh: Any = None) -> Member:
    """``op`` of ``m`` on ``tree``, or on a new ``fresh()`` tree at every call."""
    op = key[1]

    def make_globals(n: int) -> dict[str, Any]:
        if fresh is not None:
            return {"f": m.tree_flatten, "x": iter([fresh() for _ in range(n)])}
        if op == "tree_unflatten":
            leaves, spec = m.tree_flatten(tree)
            return {"f": m.tree_unflatten, "l": leaves, "s": spec}
        return {"f": getattr(m, op), "g": lambda x: x, "x": tree}

    stmt = "f(next(x))" if fresh is not None else STMT.get(op, "f(x)")
    return Member(*key, impl, stmt, make_globals)


def members_of(cases: dict, impls: dict[str, Any]) -> tuple[list[Member], list[str]]:
    """Members of every (case, op), and notes on the implementations skipped."""
    members, notes = [], []
    for case, (leaves, make) in cases.items():
        tree, fresh = make(), make if case == FIRST_SIGHT else None
        # never time an implementation that misses leaves (a class it takes for a leaf)
        ok = [i for i, m in impls.items() if len(m.tree_leaves(tree)) == leaves]
        notes += [f"{case}: {i} misses leaves, not timed" for i in impls if i not in ok]
        for op in ("tree_flatten",) if fresh else OPS:
            members += [op_member((case, op), i, impls[i], tree, fresh) for i in ok]
    return members, notes


def time_members(items: list, rounds: int, block: float) -> tuple[dict, list]:
    """Seconds per call of every member in every round, a group's members interleaved.

    An item that is not a Member is a step that changes the state, run in its turn.
    """
    per_round: dict[tuple[str, str], dict[str, list[float]]] = {}
    measurements: list[Measurement] = []
    for key, group in itertools.groupby(items, key=lambda m: getattr(m, "key", m)):
        if callable(key):
            key()
            continue
        ms = list(group)
        print(f"  timing {key[0]}: {key[1]}", file=sys.stderr, flush=True)
        number = {m.impl: max(1, int(block / m.one_call())) for m in ms}  # and warm up
        per_round[key] = {m.impl: [] for m in ms}
        for r in range(rounds):
            for m in ms if r % 2 == 0 else ms[::-1]:
                n, g = number[m.impl], {"sub_label": m.case, "description": m.impl}
                # 3 x n calls, each n after Timer.timeit's max(n // 100, 2) warm-up calls
                g["globals"] = m.make_globals(4 * n + 6)
                timer = Timer(m.stmt, label=m.op, **g)
                best = min((timer.timeit(n) for _ in range(3)), key=lambda x: x.median)
                per_round[key][m.impl].append(best.median)
                measurements.append(best)
    return per_round, measurements


def _callgrind_env() -> None:
    """``collect_callgrind`` starts ``python`` from PATH: make it this interpreter."""
    os.environ["PATH"] = os.path.dirname(sys.executable) + ":" + os.environ["PATH"]
    os.environ.setdefault("PYTHONHASHSEED", "0")


def _step(change: Callable[[], Any], warm_ups: list[Callable[[], Any]]) -> None:
    change()
    for w in warm_ups:
        w()


def callgrind_jobs(items: list, calls: list[int | None]) -> Iterator[Callable[[], Any]]:
    """The jobs that ``measure`` counts, made in its child process.

    An item is a Member, run ``calls[i]`` times by ``timeit``, or a step that changes
    the state for the members after it (``calls[i]`` is None; it warms them up again).
    The warm-up of ``collect_callgrind`` runs the first job, and the second is
    ``timeit(0)``, the overhead of a job. Every member is warmed up once, uncounted,
    with globals of its own (fresh trees stay fresh).
    """
    jobs, warm_ups = [lambda: None, functools.partial(timeit.Timer().timeit, 0)], [[]]
    for item, n in zip(items, calls, strict=True):
        if n is None:
            warm_ups.append([])
            jobs.append(functools.partial(_step, item, warm_ups[-1]))
        else:
            jobs.append(functools.partial(item.timer(n).timeit, n))
            warm_ups[-1].append(functools.partial(item.timer(n).timeit, n))
    _step(lambda: None, warm_ups[0])
    return iter(jobs)


def callgrind_child(baseline: str, cases: list[str], calls: list[int]) -> Iterator:
    if __name__ == "__main__":  # the parent: collect_callgrind checks the setup
        return itertools.repeat(lambda: None)
    members, _ = members_of({c: CASES[c] for c in cases}, make_impls(baseline, False))
    return callgrind_jobs(members, calls)


def measure(items: list, args: Any, module: str, child: dict, gated: Callable) -> tuple:
    """Time ``items`` (Members and steps), and count their instructions (stock and
    patched only) in one child process, whose ``module.callgrind_child(**child, calls)``
    makes the jobs. Returns the rows of the table and the Measurements."""
    keys = dict.fromkeys(m.key for m in items if isinstance(m, Member))
    per_round, measurements = ({}, [])
    if args.time:
        per_round, measurements = time_members(items, args.rounds, 1e-3)
    if not args.count:
        return make_rows(keys, per_round, {}, gated), measurements
    todo = [i for i in items if not isinstance(i, Member) or i.impl != "cxx"]
    calls: list[int | None] = [None] * len(todo)  # None: a step
    target = 3e-4 if args.quick else 1e-3  # seconds of work per job
    for k, m in enumerate(todo):
        if isinstance(m, Member):
            times = per_round.get(m.key, {}).get(m.impl) or [m.one_call()]
            calls[k] = max(1, round(target / statistics.median(times)))
    child["calls"] = calls
    # collect_callgrind runs the setup in this process too, to check it
    sys.modules.setdefault(module, sys.modules["__main__"])
    _callgrind_env()
    setup = f"import sys; sys.path.insert(0, {HERE!r}); import {module} as b\n"
    setup += f"jobs = b.callgrind_child(**{child!r})"
    print(f"  counting {len(calls)} jobs under callgrind", file=sys.stderr, flush=True)
    stats = Timer("next(jobs)()", setup=setup).collect_callgrind(
        number=1, repeats=len(calls) + 1, collect_baseline=False
    )
    c = [s.counts(denoise=True) for s in stats]
    ir = {(*m.key, m.impl): (x - c[0]) / n for m, x, n in zip(todo, c[1:], calls) if n}
    return make_rows(keys, per_round, ir, gated), measurements


def header(title: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """Print the title, and versions, machine, load and mode as ``- key: value``."""
    timed = f"time: {args.rounds} rounds"
    modes = [args.quick and "quick", args.time and timed, args.count and "instructions"]
    info = {
        "torch": f"{torch.__version__} ({os.path.dirname(torch.__file__)})",
        "python": platform.python_version(),
        "machine": f"{platform.platform()}, {os.cpu_count()} cpus",
        "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "mode": ", ".join(m for m in modes if m),
        **extra,
    }
    print(f"**{title}**\n")
    for k, v in info.items():
        print(f"- {k}: {v}", flush=True)
    return info


def _sha256(path: str | None) -> str | None:
    with open(path or os.devnull, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest() if path else None


def make_rows(keys: Iterable, per_round: dict, ir: dict, gated: Callable) -> list:
    """A row per (case, op): seconds and instructions per call, and patched/stock."""
    rows = []
    for case, op in keys:
        t = per_round.get((case, op), {})
        n = {i: ir[case, op, i] for i in ("stock", "patched") if (case, op, i) in ir}
        ratios = [x / y for x, y in zip(t.get("patched", []), t.get("stock", []))]
        row = {"case": case, "op": op, "gated": gated(case), "goal": goal(case, op)}
        row["instructions"] = n
        row["seconds"] = {i: statistics.median(v) for i, v in t.items()}
        row["time_ratio"] = statistics.median(ratios) if ratios else None
        row["ir_ratio"] = n["patched"] / n["stock"] if len(n) == 2 else None
        rows.append(row)
    return rows


def _cell(row: dict[str, Any] | None) -> str:  # patched/stock: time / instructions
    ratios = (row["time_ratio"], row["ir_ratio"]) if row else ()
    return " / ".join("–" if x is None else f"{x:.2f}" for x in ratios)


def _us(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e6:,.0f}" if x >= 1e-4 else f"{x * 1e6:.3g}"


def _gate(row: dict[str, Any]) -> float:  # instructions if counted, else time
    ratio = row["time_ratio"] if row["ir_ratio"] is None else row["ir_ratio"]
    return ratio or 0.0


def report(info: dict, rows: list, args: Any, notes: list, ms: list) -> int:
    """Print the table (and Compare's), write the JSON; the exit status of ``--check``."""
    info["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    info["total"] = f"{time.perf_counter() - args.t0:.0f} s"
    print(f"- loadavg_after: {info['loadavg_after']}\n- total: {info['total']}\n")
    impls = list(dict.fromkeys(i for r in rows for i in r["seconds"]))
    print(f"patched/stock: time / instructions; µs per call: {' / '.join(impls)}\n")
    ops = list(dict.fromkeys(r["op"] for r in rows))
    print(f"| tree | {' | '.join(ops)} | {ops[0]} µs |\n|" + "---|" * (len(ops) + 2))
    for case in dict.fromkeys(r["case"] for r in rows):
        by_op = {r["op"]: r for r in rows if r["case"] == case}
        cells = [_cell(by_op.get(o)) for o in ops]
        us = " / ".join(_us(by_op[ops[0]]["seconds"].get(i)) for i in impls)
        print(f"| {case} | {' | '.join(cells)} | {us} |")
    print("".join(f"\n- {note}" for note in notes))
    if args.compare:
        Compare(ms).print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": info, "rows": rows}, f, indent=1)
    if args.check is None:
        return 0
    limit = lambda r: args.check or r["goal"]  # noqa: E731
    over = [r for r in rows if round(_gate(r), 2) > limit(r)]  # the printed ratio
    bad = [r for r in over if r["gated"] or not args.check]
    for r in bad:
        print(f"CHECK FAILED: {r['case']} / {r['op']}: {_gate(r):.3f} > {limit(r)}")
    bound = args.check or "their goals (goal() in pytree_bench.py)"
    print(f"check: {len(bad)} patched/stock ratio(s) above {bound}")
    return 1 if bad else 0


def parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options of both scripts."""
    p = argparse.ArgumentParser(
        description=doc,
        epilog="Instructions are counted if valgrind is installed. collect_callgrind "
        "runs `python` from PATH: the script puts its interpreter's bin/ first there.",
    )
    p.add_argument("--only", choices=("time", "instructions"), help="skip the other")
    p.add_argument(
        "--quick", action="store_true", help="1/4 of the rounds, 0.3 ms jobs"
    )
    p.add_argument("--rounds", type=int, default=rounds, help=f"(default {rounds})")
    gate = "exit 1 if a patched/stock ratio (instructions, else time) is above its "
    gate += "goal, or, given R, one of a tree that opts into nothing is above R"
    p.add_argument("--check", type=float, nargs="?", const=0, help=gate, metavar="R")
    p.add_argument("--compare", action="store_true", help="print Compare tables too")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    args.t0, args.time = time.perf_counter(), args.only != "instructions"
    args.count = args.only != "time" and bool(shutil.which("valgrind"))
    if args.only != "time" and not args.count:
        print("valgrind not found: no instruction counts", file=sys.stderr)
    args.rounds = max(1, args.rounds // 4) if args.quick else args.rounds
    return args


# --compile-time: two torch builds, so two processes


def _compiled(tree: dict[str, Any]) -> Any:
    mapped = pytree.tree_map(lambda t: t + 1, tree)
    leaves, spec = pytree.tree_flatten(mapped["list"])
    return mapped, pytree.tree_unflatten([x * 2 for x in leaves], spec)


COMPILE = "torch._dynamo.reset(); torch.compile(f, backend='eager', fullgraph=True)(x)"
TREE = {"list": _t(50), "nested": [{"a": a, "b": [b, c]} for a, b, c in [_t(3)] * 16]}


def compile_child(repeats: int) -> float:
    """Seconds per compile (mean of ``repeats``), or the instructions of one if 0."""
    if repeats:
        timer = Timer(COMPILE, globals={"f": _compiled, "x": TREE})
        return timer.timeit(repeats).median
    _callgrind_env()
    setup = f"import sys; sys.path.insert(0, {HERE!r}); import pytree_bench as b\n"
    setup += "f, x = b._compiled, b.TREE"
    return Timer(COMPILE, setup=setup).collect_callgrind(1).counts(denoise=True)


def compile_time(args: argparse.Namespace) -> int:
    """Dynamo compile time of pytree calls, this torch vs the stock one of PYTHON."""
    python = {"stock": args.compile_time, "patched": sys.executable}
    env = {"stock": dict(os.environ), "patched": os.environ}
    env["stock"].pop("PYTHONPATH", None)  # a dev tree there is the patched torch

    def child(impl: str, code: str) -> Any:
        code = f"import sys; sys.path.insert(0, {HERE!r}); import pytree_bench as b; {code}"
        cmd = [python[impl], "-c", code]
        return json.loads(subprocess.check_output(cmd, env=env[impl]).splitlines()[-1])

    files = {i: child(i, "print(b.json.dumps(b.pytree.__file__))") for i in python}
    extra = {f"{i}_pytree": f"{f} (sha256 {_sha256(f)})" for i, f in files.items()}
    info = header("torch.compile of pytree calls: stock vs patched", args, **extra)
    if _sha256(files["stock"]) == _sha256(files["patched"]):
        print(f"error: {args.compile_time} has the same _pytree.py", file=sys.stderr)
        return 2
    rounds: dict[str, list[float]] = {i: [] for i in python}
    for r in range(args.rounds if args.time else 0):
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for i in python if r % 2 == 0 else list(python)[::-1]:
            rounds[i].append(child(i, "print(b.compile_child(3))"))
    case = "tree_map over 100 tensors; flatten, unflatten of 50"
    per_round = {(case, "torch.compile"): {i: v for i, v in rounds.items() if v}}
    with concurrent.futures.ThreadPoolExecutor() as pool:  # one core each
        counts = pool.map(child, python, ["print(b.compile_child(0))"] * args.count * 2)
    ir = {(case, "torch.compile", i): n for i, n in zip(python, counts)}
    return report(info, make_rows(list(per_round), per_round, ir, bool), args, [], [])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=30)
    stock = "the stock _pytree.py: `torch-patch stock-file torch/utils/_pytree.py`"
    p.add_argument("--baseline", metavar="FILE", help=stock)
    p.add_argument("--cases", metavar="REGEX", help="only the trees matching REGEX")
    other = "instead, torch.compile time vs the stock torch of PYTHON (use --rounds 5)"
    p.add_argument("--compile-time", metavar="PYTHON", help=other)
    args = parse(p, argv)
    if args.compile_time:
        return compile_time(args)
    same = _sha256(pytree.__file__) == _sha256(args.baseline)
    info = header(
        "pytree microbenchmarks: stock vs patched vs _cxx_pytree",
        args,
        baseline=args.baseline,
        baseline_sha256=_sha256(args.baseline),
        patched_has_register_pytree_family=HAS_FAMILY,
        patched_source_identical_to_baseline=same,
    )
    names = [c for c in CASES if re.search(args.cases or "", c)]
    members, notes = members_of({c: CASES[c] for c in names}, make_impls(args.baseline))
    args.count = args.count and args.baseline is not None
    child = {"baseline": args.baseline, "cases": names}
    gated = lambda case: not case.endswith(NOT_GATED)  # noqa: E731
    rows, measurements = measure(members, args, "pytree_bench", child, gated)
    notes.append("not gated by --check RATIO: family trees, one-off costs")
    return report(info, rows, args, notes, measurements)


if __name__ == "__main__":
    sys.exit(main())
