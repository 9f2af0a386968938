"""The main-job demo: export a HuggingFace model whose output is a ``ModelOutput``.

Run it with ``python -m torch_patch.demo`` after ``torch-patch apply``. It builds a
tiny BERT and a tiny GPT-2 (``use_cache=True``) from configs (random weights,
nothing is downloaded), exports them with ``torch.export.export``, runs the
exported programs, saves and reloads them, and shows that the outputs are the
same ``ModelOutput`` subclasses, with the same structure (KV cache included) and
values as the eager models. Then it exports the GPT-2 with
``torch.onnx.export(..., dynamo=True)``, runs it in onnxruntime and prints the
names of the ONNX graph outputs and the largest difference from eager (skipped,
with the command that installs them, when onnx, onnxscript or onnxruntime are
missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import logging
import sys
import time
import warnings


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m torch_patch.demo",
        description=(
            "Export a tiny BERT and a tiny GPT-2 (use_cache=True) built from configs (random "
            "weights, nothing is downloaded) with torch.export.export, run, save and reload the "
            "exported programs, and check that they return the models' own ModelOutput classes "
            "with the eager structure and values; then export the GPT-2 to ONNX (dynamo=True) "
            "and run it in onnxruntime. Needs the patched torch (run `torch-patch apply` "
            "first) and transformers; the ONNX part needs onnx, onnxscript and onnxruntime. "
            "Takes about a minute."
        ),
        epilog="exit status: 0 the exported programs match the eager models, 1 otherwise "
        "(or torch is not patched)",
    )


def main(argv: list[str] | None = None) -> int:
    _parser().parse_args(argv)
    import torch
    import torch.utils._pytree as pytree

    if not hasattr(pytree, "register_pytree_family"):
        print(
            f"error: the torch at {torch.__file__} is not patched "
            "(torch.utils._pytree has no register_pytree_family).\n"
            "Run `torch-patch apply` first, then this demo again "
            "(`torch-patch status` tells what it sees).",
            file=sys.stderr,
        )
        return 1

    import transformers
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    print(
        f"torch {torch.__version__} (patched), transformers {transformers.__version__}"
    )
    torch.manual_seed(0)
    input_ids = torch.randint(0, 99, (2, 7))
    bert = BertModel(
        BertConfig(
            vocab_size=99,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
        )
    ).eval()
    # GPT-2 with use_cache=True returns its KV cache (a DynamicCache under
    # transformers 5.x), which stock torch cannot export either.
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=99,
            bos_token_id=98,
            eos_token_id=98,
        )
    ).eval()
    ok = True
    for name, model, kwargs in (
        ("BertModel", bert, {"attention_mask": torch.ones_like(input_ids)}),
        ("GPT2LMHeadModel", gpt2, {"use_cache": True}),
    ):
        ok &= _export_and_check(name, model, input_ids, kwargs)
    ok &= _onnx_export_and_check(
        "GPT2LMHeadModel", gpt2, input_ids, {"use_cache": True}
    )
    print(
        "OK: the exported programs return the models' own ModelOutput classes."
        if ok
        else "FAILED"
    )
    return 0 if ok else 1


_ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


def _onnx_export_and_check(name: str, model, input_ids, kwargs) -> bool:  # type: ignore[no-untyped-def]
    import torch
    import torch.utils._pytree as pytree

    print(f"\n{name}: torch.onnx.export(..., dynamo=True), run in onnxruntime ...")
    missing = [p for p in _ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        print(
            f"  skipped: {', '.join(missing)} not installed. Install them with\n"
            f"    {sys.executable} -m pip install {' '.join(_ONNX_PACKAGES)}\n"
            "  (`pip install -e '.[test]'` of this repository includes them)."
        )
        return True
    import onnxruntime

    start = time.perf_counter()
    inputs = {"input_ids": input_ids, **kwargs}
    # Keep the output readable: the exporter logs that torchvision's ops are not
    # registered (torchvision is not installed), and stock 2.13.0 warns when it
    # copies a LeafSpec. Neither concerns this demo.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(
        logging.ERROR
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r".*isinstance\(treespec, LeafSpec\)",
            category=FutureWarning,
        )
        eager = model(**inputs)
        onnx_program = torch.onnx.export(
            model, (), kwargs=inputs, dynamo=True, verbose=False
        )
    session = onnxruntime.InferenceSession(
        onnx_program.model_proto.SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    (input_name,) = (i.name for i in session.get_inputs())
    results = session.run(None, {input_name: input_ids.numpy()})
    elapsed = time.perf_counter() - start
    eager_leaves = [t for t in pytree.tree_leaves(eager) if isinstance(t, torch.Tensor)]
    max_diff = max(
        (torch.from_numpy(r) - t).abs().max().item()
        for r, t in zip(results, eager_leaves, strict=True)
    )
    print(f"  ONNX graph inputs: {input_name}")
    print(f"  ONNX graph outputs: {', '.join(o.name for o in session.get_outputs())}")
    print(f"  max |onnx - eager| over {len(results)} tensors: {max_diff:.2e}")
    print(f"  export and run: {elapsed:.1f} s")
    return max_diff < 1e-5


def _export_and_check(name: str, model, input_ids, kwargs) -> bool:  # type: ignore[no-untyped-def]
    import torch
    import torch.utils._pytree as pytree

    print(f"\n{name} (tiny config, random weights): torch.export.export ...")
    exported = torch.export.export(model, (input_ids,), kwargs)
    with torch.no_grad():
        eager = model(input_ids, **kwargs)
    out = exported.module()(input_ids, **kwargs)

    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    reloaded = torch.export.load(buffer).module()(input_ids, **kwargs)

    eager_leaves, eager_spec = pytree.tree_flatten(eager)
    out_leaves, out_spec = pytree.tree_flatten(out)
    max_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(out_leaves, eager_leaves, strict=True)
    )
    print(f"  exported output type: {type(out).__module__}.{type(out).__qualname__}")
    for key, value in out.items():
        print(f"    {key}: {type(value).__qualname__}")
    print(f"  max |exported - eager| over {len(out_leaves)} tensors: {max_diff:.2e}")
    print(
        f"  after torch.export.save/load: {type(reloaded).__qualname__} "
        f"with keys {list(reloaded.keys())}"
    )
    return (
        type(out) is type(eager)
        and type(reloaded) is type(eager)
        and out_spec == eager_spec
        and max_diff < 1e-5
    )


if __name__ == "__main__":
    sys.exit(main())
