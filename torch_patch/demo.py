"""The main-job demo: export a HuggingFace model whose output is a ``ModelOutput``.

Run it with ``python -m torch_patch.demo`` after ``torch-patch apply``. It builds a
tiny BERT from a config (random weights, nothing is downloaded), exports it with
``torch.export.export``, runs the exported program, saves and reloads it, and
shows that the output is the same ``ModelOutput`` subclass with the same keys
and values as the eager model.
"""

from __future__ import annotations

import io
import sys


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.utils._pytree as pytree

    if not hasattr(pytree, "register_pytree_family"):
        print(
            f"error: the torch at {torch.__file__} is not patched "
            "(torch.utils._pytree has no register_pytree_family).\n"
            "Run `torch-patch apply` first, then this demo again.",
            file=sys.stderr,
        )
        return 1

    import transformers
    from transformers import BertConfig, BertModel

    print(f"torch {torch.__version__} (patched), transformers {transformers.__version__}")
    config = BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
    )
    torch.manual_seed(0)
    model = BertModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 7))
    attention_mask = torch.ones_like(input_ids)

    print("exporting BertModel (tiny config, random weights) with torch.export.export ...")
    exported = torch.export.export(
        model, (input_ids,), {"attention_mask": attention_mask}
    )
    with torch.no_grad():
        eager = model(input_ids, attention_mask=attention_mask)
    out = exported.module()(input_ids, attention_mask=attention_mask)

    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    reloaded = torch.export.load(buffer).module()(input_ids, attention_mask=attention_mask)

    max_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(eager), strict=True)
    )
    output_type = f"{type(out).__module__}.{type(out).__qualname__}"
    print(f"exported output type: {output_type}")
    print(f"keys: {list(out.keys())}")
    print(f"max |exported - eager|: {max_diff:.2e}")
    print(
        "after torch.export.save/load: "
        f"{type(reloaded).__qualname__} with keys {list(reloaded.keys())}"
    )
    ok = (
        type(out) is type(eager)
        and type(reloaded) is type(eager)
        and list(out.keys()) == list(eager.keys())
        and max_diff < 1e-5
    )
    print("OK: the exported program returns the model's own ModelOutput class." if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
