"""torch.export of one decode step, end to end: this torch against a stock torch.

Each model (tiny, random weights, from its config) is exported the way users call
it: ``torch.export.export(model, (), kwargs)`` with the cache in ``kwargs``, and
``Dim.AUTO`` for every tensor dimension and int of the cache, so that the program
takes the caches of later steps. A torch without
``register_pytree_family`` (stock) gets a hand-written registration of the cache
classes, the one a library or user writes today: each attribute that holds a
setting (a bool, str, None, class, device or dtype) is context, the others are
children.

Two builds of torch cannot share a process: each round runs this script in a
child of this interpreter and of ``--stock-python``, one after the other, and
each child times ``--repeats`` exports of each model after one to warm up. A
cell is the median over rounds of the ratio of the same round (which cancels
most of the drift of a shared machine). ``--check RATIO`` exits 1 if a model's
ratio exceeds RATIO.

Example::

    .venv/bin/python benchmarks/export/export_decode_bench.py \\
        --stock-python .venv-stock/bin/python --check 1.05
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any


MODELS = ("llama", "gemma2", "t5")


def _register_by_hand() -> None:
    """What stock torch needs before it can export a transformers cache."""
    from transformers import cache_utils

    import torch
    import torch.utils._pytree as pytree

    settings = (bool, str, type(None), type, torch.device, torch.dtype)

    def register(cls: type) -> None:
        def flatten_with_keys(obj: Any) -> tuple[list[Any], Any]:
            # settings are the context; tensors, counters (ints, which export
            # may wrap), lists and layers are children
            names = [n for n, v in vars(obj).items() if not isinstance(v, settings)]
            rest = {n: v for n, v in vars(obj).items() if n not in names}
            children = [(pytree.GetAttrKey(n), getattr(obj, n)) for n in names]
            return children, (names, rest)

        def flatten(obj: Any) -> tuple[list[Any], Any]:
            children, context = flatten_with_keys(obj)
            return [child for _, child in children], context

        def unflatten(children: Any, context: Any) -> Any:
            obj = object.__new__(cls)
            vars(obj).update(context[1], **dict(zip(context[0], children)))
            return obj

        pytree.register_pytree_node(
            cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys
        )

    for name in ("DynamicCache", "EncoderDecoderCache", "DynamicLayer"):
        register(getattr(cache_utils, name))
    register(cache_utils.DynamicSlidingWindowLayer)


def _model(name: str) -> tuple[Any, dict[str, Any], str]:
    """The model, the keyword arguments of a decode step, and the cache's keyword."""
    import transformers

    import torch

    torch.manual_seed(0)
    small = {"vocab_size": 128, "num_attention_heads": 4}
    if name == "t5":
        config = transformers.T5Config(
            d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=128
        )
        model = transformers.T5ForConditionalGeneration(config).eval()
        source = torch.randint(3, 100, (2, 6))
        with torch.no_grad():
            encoder = model.get_encoder()(input_ids=source).last_hidden_state
        encoder_outputs = (encoder,)
        start = {"encoder_outputs": encoder_outputs, "use_cache": True}
        ids_name = "decoder_input_ids"
    else:
        layers = {"num_hidden_layers": 2, "num_key_value_heads": 2}
        sizes = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
        if name == "llama":
            config = transformers.LlamaConfig(**small, **sizes, **layers)
            model = transformers.LlamaForCausalLM(config).eval()
        else:
            config = transformers.Gemma2Config(
                **small, **sizes, **layers, sliding_window=8
            )
            model = transformers.Gemma2ForCausalLM(config).eval()
        start = {"use_cache": True}
        ids_name = "input_ids"
    # transformers 5.x names it `cache`; `past_key_values` went into **kwargs
    parameters = inspect.signature(model.forward).parameters
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randint(3, 100, (2, n), generator=generator) for n in (3, 1)]
    with torch.no_grad():
        cache = model(**{**start, ids_name: steps[0]}).past_key_values
    return model, {**start, ids_name: steps[1], cache_name: cache}, cache_name


def _auto(x: Any) -> Any:
    """Dim.AUTO for each tensor dimension and int of ``x``, in the form every torch
    takes: the shapes of a registered class's children."""
    import torch
    import torch.utils._pytree as pytree

    if isinstance(x, torch.Tensor):
        return dict.fromkeys(range(x.dim()), torch.export.Dim.AUTO)
    if type(x) is int:
        return torch.export.Dim.AUTO
    if isinstance(x, (list, tuple)):
        return type(x)(map(_auto, x))
    if type(x) is dict:
        return {k: _auto(v) for k, v in x.items()}
    node = pytree.SUPPORTED_NODES.get(type(x))
    return None if node is None else [_auto(c) for c in node.flatten_fn(x)[0]]


def _none(x: Any) -> Any:
    """No dynamic dimension in ``x``."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda _: None, x)


def child(models: list[str], repeats: int) -> dict[str, float]:
    """Seconds per export of each model (median of ``repeats``)."""
    import torch
    import torch.utils._pytree as pytree

    warnings.simplefilter("ignore")
    if not hasattr(pytree, "register_pytree_family"):
        _register_by_hand()
    medians = {}
    for name in models:
        model, first, cache_name = _model(name)
        if hasattr(pytree, "_update_pytree_families"):  # as export does, for _auto
            pytree._update_pytree_families()
        shapes = {
            k: _auto(v) if k == cache_name else _none(v) for k, v in first.items()
        }
        times = []
        for _ in range(repeats + 1):
            kwargs = copy.deepcopy(first)
            start = time.perf_counter()
            torch.export.export(model, (), kwargs, dynamic_shapes=shapes)
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times[1:])  # the first warms up
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock-python", required=True, help="a stock torch's python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="exports per child")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--check", type=float, metavar="RATIO")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.models, args.repeats)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {"patched": [], "stock": []}
    for r in range(args.rounds):
        for kind, python in (("patched", sys.executable), ("stock", args.stock_python)):
            command = [python, __file__, "--child", "--stock-python", "-"]
            command += ["--repeats", str(args.repeats), "--models", *args.models]
            out = subprocess.run(command, check=True, capture_output=True, text=True)
            runs[kind].append(json.loads(out.stdout.splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds}: {kind} done", file=sys.stderr)
    print("| model | patched s | stock s | patched/stock |\n|---|---|---|---|")
    failed = []
    for name in args.models:
        patched = [run[name] for run in runs["patched"]]
        stock = [run[name] for run in runs["stock"]]
        ratio = statistics.median(p / s for p, s in zip(patched, stock))
        print(
            f"| {name} | {statistics.median(patched):.3f} | "
            f"{statistics.median(stock):.3f} | {ratio:.2f} |"
        )
        if args.check is not None and ratio > args.check:
            failed.append(f"{name} {ratio:.2f}")
    if failed:
        print(f"above {args.check}: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
