"""Dynamo compile time of code that calls the Python pytree: base vs head torch.

Dynamo inlines ``torch.utils._pytree`` (with special cases for ``_get_node_type``
and ``tree_is_leaf``), so a change to the pytree hot path also changes how long
``torch.compile`` takes to trace code that uses it. Two torch builds cannot be
imported in one process, so this script runs each build in child processes,
alternating between them, and reports the median compile time of each and the
paired ratio.

Each implementation is given as ``NAME=PYTHON`` or ``NAME=PYTHON:PYTHONPATH``::

    python benchmarks/pytree/compile_time_bench.py \\
        --impl base=/path/to/base-venv/bin/python \\
        --impl head=/path/to/head-venv/bin/python

    # a dev tree that shadows a stock venv's torch through PYTHONPATH
    python benchmarks/pytree/compile_time_bench.py \\
        --impl stock=/path/to/stock-venv/bin/python \\
        --impl patched=/path/to/stock-venv/bin/python:$HOME/torch-dev

The first implementation is the baseline of the ratios. The measured function
maps over a pytree of 100 tensors (``tree_map``) and over a list of 100 tensors
(``tree_flatten`` / ``tree_unflatten``); every measurement resets Dynamo first
and compiles with ``backend="eager"``, so only tracing time is measured.

Before timing, each implementation's torch is fingerprinted (sha256 of the
sources this benchmark exercises: ``torch/utils/*pytree*.py`` and
``torch/_dynamo/**/*.py``), without importing it. If two implementations have
the same fingerprint, they are the same build (for example a venv whose torch
was patched in place, passed as the stock baseline): the script refuses with
exit status 2, unless ``--allow-same`` (a deliberate noise measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _child(repeats: int, callgrind_out: str | None = None) -> None:
    import torch
    import torch.utils._pytree as pytree

    def fn(tree):
        mapped = pytree.tree_map(lambda t: t + 1, tree)
        leaves, spec = pytree.tree_flatten(mapped["list"])
        return mapped, pytree.tree_unflatten([x * 2 for x in leaves], spec)

    tree = {
        "list": [torch.ones(2) for _ in range(50)],
        "nested": [
            {"a": torch.ones(2), "b": (torch.ones(2), torch.ones(2))} for _ in range(16)
        ],
        "tuple": tuple(torch.ones(2) for _ in range(2)),
    }
    if len(pytree.tree_leaves(tree)) != 100:
        raise RuntimeError("the benchmark tree must have 100 leaves")
    cg = None
    if callgrind_out is not None:
        from _callgrind import Callgrind  # this directory (sys.path[0])

        cg = Callgrind(callgrind_out)
    times = []
    for i in range(repeats + 1):  # the first compile also warms up imports
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        if cg is None:
            start = time.perf_counter()
            compiled(tree)
            times.append(time.perf_counter() - start)
        elif i == 0:
            compiled(tree)  # uninstrumented
            cg.start()
        else:
            times.append(cg.count(lambda: compiled(tree), f"compile {i}"))
    print(
        json.dumps(
            {"times": times[1:] if cg is None else times, "torch": torch.__file__}
        )
    )


def _fingerprint() -> None:
    """Print the torch this interpreter would import and a sha256 over the sources the
    benchmark exercises (without importing torch)."""
    import hashlib
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        print(json.dumps({"error": f"no torch importable by {sys.executable}"}))
        return
    root = Path(spec.origin).parent
    files = sorted(root.glob("utils/*pytree*.py")) + sorted(
        root.glob("_dynamo/**/*.py")
    )
    h = hashlib.sha256()
    for f in files:
        h.update(
            f.relative_to(root).as_posix().encode()
            + b"\0"
            + hashlib.sha256(f.read_bytes()).digest()
        )
    pytree_src = (root / "utils" / "_pytree.py").read_text(
        encoding="utf-8", errors="replace"
    )
    print(
        json.dumps(
            {
                "torch": str(root),
                "fingerprint": h.hexdigest(),
                "files": len(files),
                "has_register_pytree_family": "def register_pytree_family("
                in pytree_src,
            }
        )
    )


def _env(pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    return env


def _run(
    python: str,
    pythonpath: str | None,
    repeats: int,
    *,
    fingerprint: bool = False,
    valgrind: str | None = None,
) -> dict:
    args = ["--fingerprint"] if fingerprint else ["--child", "--repeats", str(repeats)]
    cmd = [python, os.path.abspath(__file__), *args]
    env = _env(pythonpath)
    with tempfile.TemporaryDirectory(prefix="compile_time_bench_") as tmp:
        if valgrind is not None and not fingerprint:
            from _callgrind import CALLGRIND_OPTIONS  # this directory (sys.path[0])

            out = os.path.join(tmp, "callgrind.out")
            cmd = [valgrind, *CALLGRIND_OPTIONS, f"--callgrind-out-file={out}", *cmd]
            cmd += ["--callgrind-out", out]
            env.setdefault("PYTHONHASHSEED", "0")  # repeatable dict/set layouts
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            f"error: {python} {' '.join(args)} failed (exit {proc.returncode}):\n"
            f"{proc.stderr.strip()}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--impl",
        action="append",
        default=[],
        metavar="NAME=PYTHON[:PYTHONPATH]",
        help="an implementation to time (repeat; the first is the baseline)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="child processes per implementation"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="compiles per child process"
    )
    parser.add_argument(
        "--allow-same",
        action="store_true",
        help="time implementations even if they are the same build (a noise measurement)",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the instructions of each compile under valgrind's callgrind instead of "
        "timing it (stable on a loaded machine; about 2 min per child process)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--callgrind-out", help=argparse.SUPPRESS)
    parser.add_argument("--fingerprint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.repeats, args.callgrind_out)
        return 0
    if args.fingerprint:
        _fingerprint()
        return 0
    if len(args.impl) < 2:
        parser.error("give at least two --impl NAME=PYTHON[:PYTHONPATH]")
    valgrind = None
    if args.instructions:
        valgrind = shutil.which("valgrind")
        if valgrind is None:
            parser.error(
                "--instructions needs valgrind on PATH (e.g. apt-get install valgrind)"
            )
    impls = []
    for spec in args.impl:
        name, sep, rest = spec.partition("=")
        if not sep or not rest:
            parser.error(f"--impl {spec!r}: expected NAME=PYTHON[:PYTHONPATH]")
        python, _, pythonpath = rest.partition(":")
        impls.append((name, python, pythonpath or None))
    if len({name for name, _, _ in impls}) != len(impls):
        parser.error("every --impl needs its own NAME")

    seen: dict[str, str] = {}
    for name, python, pythonpath in impls:
        fp = _run(python, pythonpath, 0, fingerprint=True)
        if "error" in fp:
            print(f"error: --impl {name}: {fp['error']}", file=sys.stderr)
            return 2
        print(
            f"{name}: torch at {fp['torch']} (sources {fp['fingerprint'][:12]}, "
            f"register_pytree_family: {'yes' if fp['has_register_pytree_family'] else 'no'})",
            file=sys.stderr,
        )
        same = seen.get(fp["fingerprint"])
        if same is not None:
            msg = (
                f"--impl {same} and --impl {name} run identical pytree and Dynamo sources "
                f"(sha256 {fp['fingerprint'][:12]}), so their ratio would compare a build with "
                f"itself. Was a venv patched in place and then given as the stock baseline? Use a "
                f"venv with stock torch for the baseline."
            )
            if not args.allow_same:
                print(f"error: {msg} (--allow-same times them anyway)", file=sys.stderr)
                return 2
            print(f"warning: {msg} (timing anyway: --allow-same)", file=sys.stderr)
        seen.setdefault(fp["fingerprint"], name)

    medians: dict[str, list[float]] = {name: [] for name, _, _ in impls}
    for r in range(args.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for name, python, pythonpath in order:
            result = _run(python, pythonpath, args.repeats, valgrind=valgrind)
            medians[name].append(statistics.median(result["times"]))
            value = (
                f"{medians[name][-1]:,.0f} instructions"
                if valgrind
                else f"{medians[name][-1] * 1e3:.1f} ms"
            )
            print(
                f"round {r + 1}/{args.rounds} {name}: {value} ({result['torch']})",
                file=sys.stderr,
            )
    base = impls[0][0]
    what = "median compile Ir" if valgrind else "median compile ms"
    print(f"{'impl':<12} {what:>18} {'ratio to ' + base:>14}")
    for name, _, _ in impls:
        paired = statistics.median(
            a / b for a, b in zip(medians[name], medians[base], strict=True)
        )
        median = statistics.median(medians[name])
        shown = f"{median:,.0f}" if valgrind else f"{median * 1e3:.1f}"
        print(f"{name:<12} {shown:>18} {paired:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
