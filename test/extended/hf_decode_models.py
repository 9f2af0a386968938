"""The tiny decoders of the runtime decode-loop tests (test_onnx_hf_decode.py,
test_export_hf_executorch.py): a Llama (GQA) and a GPT-2 with random weights."""

from __future__ import annotations

import inspect
from typing import Any

import torch


MODELS = ("llama", "gpt2")
VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
NEW_TOKENS = 10


def build(name: str, **gpt2_options: Any) -> Any:
    """A tiny model with random weights, larger than the default so greedy varies."""
    import transformers

    torch.manual_seed(0)
    tokens = {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS}
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
            **tokens,
        )
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        initializer_range=0.2,
        **tokens,
        **gpt2_options,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def cache_argument(model: Any) -> str:
    """The cache argument: ``cache`` in recent transformers 5.x, else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
