"""What pytree families cost code that does not use them: stock vs patched ``torch.utils._cxx_pytree``.

Both implementations are timed in ONE process, interleaved:

* ``stock``   -- a stock PyTorch v2.13.0 ``torch/utils/_cxx_pytree.py`` (``--baseline FILE``),
                 loaded as the alias module ``_cxx_pytree_baseline``. It calls the same optree
                 registry (namespace ``"torch"``) as the real module, so both flatten every tree
                 the same way.
* ``patched`` -- ``torch.utils._cxx_pytree`` of the torch that ``import torch`` gives.

The states are entered in this order (each one stays in force for the next):

1. ``fresh``: only the built-in lazy families exist (transformers not imported);
2. ``family``: a family is registered and has members, none of them in the trees;
3. ``transformers``: ``import transformers`` (the lazy ``ModelOutput`` and ``Cache``
   families become live); skipped when transformers is not installed.

In every state, the flat list of 1,000 tensors, the dict of 1,000 and the nested case are
gated (``--check RATIO`` exits 1 if a paired patched/stock ratio exceeds RATIO). The last
table is informational: flattening trees that hold family members (patched, derived
registrations) against the same trees whose classes are registered exactly (stock).

How to run (from a PyTorch checkout)::

    git show v2.13.0:torch/utils/_cxx_pytree.py > /tmp/stock_cxx_pytree.py
    python benchmarks/pytree/cxx_pytree_bench.py --baseline /tmp/stock_cxx_pytree.py --check 1.02

Method: each (state, case, op) calibrates a loop count so that one block takes about
``--block-time`` seconds, then runs ``--rounds`` rounds; a round times ``--blocks`` blocks of
each implementation (the order alternating between rounds) and keeps the fastest block of
each. The ratio of a round is patched/stock of those; the reported ratio is the median over
rounds (the two members of a round are timed milliseconds apart, which cancels most drift).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import statistics
import sys
import time
import timeit
from typing import Any, TYPE_CHECKING

import torch
import torch.utils._cxx_pytree as cxx_pytree
import torch.utils._pytree as py_pytree


if TYPE_CHECKING:
    from collections.abc import Callable


OPS: dict[str, Callable[[Any, Any], Any]] = {
    "tree_flatten": lambda m, t: m.tree_flatten(t),
    "tree_leaves": lambda m, t: m.tree_leaves(t),
    "tree_map": lambda m, t: m.tree_map(_identity, t),
}


def _identity(x: Any) -> Any:
    return x


def load_baseline(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("_cxx_pytree_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "register_pytree_family"):
        raise SystemExit(
            f"{path} is not a stock _cxx_pytree.py (it has register_pytree_family)"
        )
    return module


def gated_cases() -> dict[str, Any]:
    return {
        "list_1000": [torch.ones(1) for _ in range(1000)],
        "dict_1000": {f"k{i}": torch.ones(1) for i in range(1000)},
        "nested_100x{a,b:(2),c:[3]}": [
            {
                "a": torch.ones(1),
                "b": (torch.ones(1), torch.ones(1)),
                "c": [torch.ones(1)] * 3,
            }
            for _ in range(100)
        ],
    }


def time_pair(
    fns: dict[str, Callable[[], Any]], rounds: int, blocks: int, block_time: float
) -> dict[str, Any]:
    """Median per-call times (µs) and the paired median ratio patched/stock."""
    timers = {name: timeit.Timer(fn) for name, fn in fns.items()}
    number = 1
    while timers["stock"].timeit(number) < block_time / 2 and number < 1 << 20:
        number *= 2
    for t in timers.values():
        t.timeit(number)  # warm up
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    ratios = []
    order = list(fns)
    for r in range(rounds):
        best = {}
        for name in order if r % 2 == 0 else reversed(order):
            best[name] = (
                min(timers[name].timeit(number) for _ in range(blocks)) / number
            )
            per_call[name].append(best[name])
        ratios.append(best["patched"] / best["stock"])
    return {
        "us": {name: statistics.median(v) * 1e6 for name, v in per_call.items()},
        "ratio": statistics.median(ratios),
    }


def time_ops(
    state: str,
    case: str,
    stock: Any,
    stock_tree: Any,
    patched_tree: Any,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Time every op of OPS, stock on ``stock_tree`` vs patched on ``patched_tree``."""
    rows = []
    for op, call in OPS.items():
        fns = {
            "stock": lambda call=call: call(stock, stock_tree),
            "patched": lambda call=call: call(cxx_pytree, patched_tree),
        }
        res = time_pair(fns, args.rounds, args.blocks, args.block_time)
        rows.append({"state": state, "case": case, "op": op, **res})
        print(
            f"  {state:<13} {case:<28} {op:<13} stock {res['us']['stock']:8.1f} us"
            f"  patched {res['us']['patched']:8.1f} us  ratio {res['ratio']:.3f}",
            flush=True,
        )
    return rows


def run_state(
    state: str, stock: Any, args: argparse.Namespace, rows: list[dict[str, Any]]
) -> None:
    for case, tree in gated_cases().items():
        expected = stock.tree_leaves(tree)
        if cxx_pytree.tree_leaves(tree) != expected:
            raise SystemExit(f"{state}/{case}: stock and patched disagree")
        rows += time_ops(state, case, stock, tree, tree, args)


def member_rows(stock: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Trees of family members (patched) vs the same trees of exactly registered twins (stock)."""

    @dataclasses.dataclass
    class FamilyOutput:
        a: Any = None
        b: Any = None

    @dataclasses.dataclass
    class ExactOutput:
        a: Any = None
        b: Any = None

    cxx_pytree.register_pytree_family(FamilyOutput)
    # 100 subclasses each, as an output-class hierarchy has. The twins are
    # registered with the flatten function that a dataclass family derives.
    fam = [
        dataclasses.make_dataclass(f"F{i}", [], bases=(FamilyOutput,))
        for i in range(100)
    ]
    exact = [
        dataclasses.make_dataclass(f"E{i}", [], bases=(ExactOutput,))
        for i in range(100)
    ]
    flatten = functools.partial(py_pytree._dataclass_flatten, ("a", "b"))
    for cls in exact:
        cxx_pytree.register_pytree_node(
            cls, flatten, functools.partial(py_pytree._dataclass_unflatten, cls)
        )
    rows = []
    trees = {
        "100 members x 2 tensors": (
            [c(torch.ones(1), torch.ones(1)) for c in fam],
            [c(torch.ones(1), torch.ones(1)) for c in exact],
        )
    }
    for case, (fam_tree, exact_tree) in trees.items():
        if (
            len(cxx_pytree.tree_leaves(fam_tree)) != 200
            or len(stock.tree_leaves(exact_tree)) != 200
        ):
            raise SystemExit(f"{case}: the members or their twins were not flattened")
        rows += time_ops("members", case, stock, exact_tree, fam_tree, args)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline",
        required=True,
        metavar="FILE",
        help="a stock torch/utils/_cxx_pytree.py (v2.13.0)",
    )
    parser.add_argument(
        "--check",
        type=float,
        metavar="RATIO",
        help="exit 1 listing every gated case whose paired patched/stock ratio > RATIO",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=120,
        help="rounds per (state, case, op) (default 120)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=3,
        help="blocks per implementation per round (default 3)",
    )
    parser.add_argument(
        "--block-time",
        type=float,
        default=0.002,
        help="target duration of one block, s (default 0.002)",
    )
    args = parser.parse_args(argv)

    if "transformers" in sys.modules:
        raise SystemExit(
            "run this in a fresh process: transformers is already imported"
        )
    t0 = time.perf_counter()
    stock = load_baseline(args.baseline)
    print(f"# _cxx_pytree: stock ({args.baseline}) vs patched ({cxx_pytree.__file__})")
    print(
        f"- torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus"
    )
    rows: list[dict[str, Any]] = []
    run_state("fresh", stock, args, rows)

    @dataclasses.dataclass
    class UnusedBase:
        x: Any = None

    cxx_pytree.register_pytree_family(UnusedBase)
    for i in range(20):
        dataclasses.make_dataclass(f"UnusedMember{i}", [], bases=(UnusedBase,))
    run_state("family", stock, args, rows)

    if importlib.util.find_spec("transformers") is not None:
        import transformers.modeling_outputs

        if importlib.util.find_spec("transformers.cache_utils") is not None:
            import transformers.cache_utils  # noqa: F401
        run_state("transformers", stock, args, rows)
    else:
        print("- transformers is not installed: state 'transformers' skipped")
    gated = list(rows)
    rows += member_rows(stock, args)

    print("\n| state | case | op | stock µs | patched µs | patched/stock |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['state']} | {r['case']} | {r['op']} | {r['us']['stock']:.1f} "
            f"| {r['us']['patched']:.1f} | {r['ratio']:.3f} |"
        )
    print(
        "\n(members: stock = the same trees with exactly registered classes; not gated)"
    )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.check is not None:
        bad = [r for r in gated if r["ratio"] > args.check]
        for r in bad:
            print(
                f"CHECK FAILED: {r['state']}/{r['case']}/{r['op']}: {r['ratio']:.3f} > {args.check}"
            )
        if bad:
            return 1
        print(f"check passed: every gated patched/stock ratio <= {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
