# Owner(s): ["module: onnx"]
"""HuggingFace decoders exported to ONNX and decoded by the runtimes users deploy to.

A decode step of a tiny Llama and GPT-2 (random weights, built from configs,
nothing is downloaded) is exported with a plain ``torch.onnx.export(model, (),
kwargs=..., dynamo=True)``: inputs ``input_ids``, ``attention_mask``,
``position_ids`` and the KV cache, a ``DynamicCache``, with a dynamic batch, number
of new tokens and past length, so that the first step runs with an empty past.
No ``input_names`` or ``output_names`` are given: the graph inputs and outputs are
named after their pytree key paths (``logits``, ``past_key_values.layers.0.keys``,
and ``past_key_values.layers.0.keys_1`` for the returned cache), and the runtimes
find them by these names:

* optimum-onnx's ``ORTModelForCausalLM`` (``model.onnx`` and the model's
  ``config.json`` in a folder) runs ``generate()``, with and without IO binding;
* onnxruntime-genai runs its own greedy search, from a ``genai_config.json``
  whose name templates are the key-path names (see ``_genai_config``).

Every decode is compared token for token with eager ``model.generate()``, for one
prompt and for a padded batch of two. Stock torch cannot export the decode step
(it does not flatten the cache); these tests need the patched torch, and
transformers >= 4.56 (caches made of layers). ``nox -s tests-deploy`` installs
the runtimes; without them, their tests skip.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)
from torch.torch_version import TorchVersion

from hf_decode_models import (  # next to this file (on sys.path under pytest and python)
    BOS,
    build,
    cache_argument,
    EOS,
    MODELS,
    NEW_TOKENS,
    PAD,
    VOCAB,
)


_MISSING = [
    name
    for name in ("transformers", "onnx", "onnxscript", "onnxruntime")
    if importlib.util.find_spec(name) is None
]
if not _MISSING:
    import transformers

    if TorchVersion(transformers.__version__) < "4.56":
        _MISSING.append("transformers>=4.56")
HAS_OPTIMUM = (
    importlib.util.find_spec("optimum") is not None
    and importlib.util.find_spec("optimum.onnxruntime") is not None
)
HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None

def _step_inputs(model: Any) -> dict[str, Any]:
    """Decode-step inputs: 2 new tokens after a past of 3, in ``forward``'s order.

    The exporter gives ``dynamic_shapes`` axis names to the graph inputs in that
    order, and GPT-2 takes its cache before the mask.
    """
    cache_name = cache_argument(model)
    with torch.no_grad():
        past = model(input_ids=torch.randint(3, VOCAB, (2, 3)), use_cache=True)
    inputs = {
        "input_ids": torch.randint(3, VOCAB, (2, 2)),
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
        "position_ids": torch.arange(3, 5).repeat(2, 1),
        cache_name: past[cache_name],
    }
    order = list(inspect.signature(model.forward).parameters)
    return {name: inputs[name] for name in sorted(inputs, key=order.index)}


def _export(model: Any) -> Any:
    """The decode step as an ONNXProgram: dynamic batch, new tokens and past length."""
    inputs = _step_inputs(model)
    batch, seq, past = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
    shapes = torch.export.ShapesCollection()
    shapes[inputs["input_ids"]] = {0: batch, 1: seq}
    shapes[inputs["position_ids"]] = {0: batch, 1: seq}
    # past + seq, which export derives
    shapes[inputs["attention_mask"]] = {0: batch, 1: torch.export.Dim.AUTO}
    # the cache's leaves, walked before any export: register the classes an
    # export registers at its start (docs/design.md, patch 2)
    pytree._update_pytree_families()
    for tensor in pytree.tree_leaves(inputs[cache_argument(model)]):
        shapes[tensor] = {0: batch, 2: past}
    with torch.no_grad():
        return torch.onnx.export(
            model,
            (),
            kwargs=inputs,
            dynamic_shapes=shapes.dynamic_shapes(model, (), inputs),
            dynamo=True,
            verbose=False,
        )


def _prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One prompt of 5 tokens; a batch of prompts of 6 and 3 tokens, left-padded."""
    torch.manual_seed(1)
    prompt = torch.randint(3, VOCAB, (1, 5))
    batch = torch.randint(3, VOCAB, (2, 6))
    batch[1, :3] = PAD
    return prompt, batch, (batch != PAD).long()


def _generate(model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Greedy decoding of NEW_TOKENS tokens (EOS is suppressed until then)."""
    return model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
    )


def _genai_config(model: Any, cache_name: str) -> dict[str, Any]:
    """onnxruntime-genai's ``genai_config.json`` for the exported decode step.

    The name templates are the key-path names of the cache: ``%d`` is the layer.
    The returned cache has the key paths of the input cache, hence ``_1``. The
    graph returns a new cache at every step: ``past_present_share_buffer`` off.
    """
    config = model.config
    heads = config.num_attention_heads
    layers = f"{cache_name}.layers.%d"
    return {
        "model": {
            # "decoder": a generic decoder-only model; "gpt2" expects other inputs
            "type": "llama" if config.model_type == "llama" else "decoder",
            "vocab_size": config.vocab_size,
            "context_length": 256,
            "pad_token_id": PAD,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "decoder": {
                "filename": "model.onnx",
                "hidden_size": config.hidden_size,
                "head_size": config.hidden_size // heads,
                "num_attention_heads": heads,
                "num_key_value_heads": getattr(config, "num_key_value_heads", heads),
                "num_hidden_layers": config.num_hidden_layers,
                "session_options": {},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": f"{layers}.keys",
                    "past_value_names": f"{layers}.values",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": f"{layers}.keys_1",
                    "present_value_names": f"{layers}.values_1",
                },
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": 256,
            "past_present_share_buffer": False,
        },
    }


@unittest.skipIf(_MISSING, f"needs {', '.join(_MISSING)}")
class _DecodeTestCase(TestCase):
    # One export per model, shared by the tests of the same model.
    _exported: dict[str, tuple[Any, Any]] = {}

    def export(self, name: str) -> tuple[Any, Any]:
        """The eager model and its exported decode step."""
        if name not in self._exported:
            model = build(name)
            self._exported[name] = (model, _export(model))
        return self._exported[name]

    def save(self, name: str) -> tuple[Any, Path]:
        """The eager model, and a temporary folder with ``model.onnx`` and its config."""
        model, onnx_program = self.export(name)
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        path = Path(folder.name)
        onnx_program.save(str(path / "model.onnx"))
        model.config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
        return model, path


class TestDecodeStepNames(_DecodeTestCase):
    @parametrize("name", MODELS)
    def test_key_path_names(self, name: str) -> None:
        """The names the runtimes below look up."""
        model, onnx_program = self.export(name)
        graph = onnx_program.model.graph
        cache = [
            f"{cache_argument(model)}.layers.{i}.{kind}"
            for i in range(2)
            for kind in ("keys", "values")
        ]
        self.assertEqual(
            sorted(v.name for v in graph.inputs),
            sorted(["input_ids", "attention_mask", "position_ids", *cache]),
        )
        self.assertEqual(
            [v.name for v in graph.outputs],
            ["logits", *(f"{n}_1" for n in cache)],
        )


@unittest.skipIf(not HAS_OPTIMUM, "needs optimum-onnx")
class TestOptimumORTModel(_DecodeTestCase):
    @parametrize("use_io_binding", [False, True])
    @parametrize("name", MODELS)
    def test_generate(self, name: str, use_io_binding: bool) -> None:
        from optimum.onnxruntime import ORTModelForCausalLM

        model, path = self.save(name)
        ort_model = ORTModelForCausalLM.from_pretrained(
            path, use_io_binding=use_io_binding
        )
        self.assertTrue(ort_model.can_use_cache)
        prompt, batch, mask = _prompts()
        for input_ids, attention_mask in (
            (prompt, torch.ones_like(prompt)),
            (batch, mask),
        ):
            expected = _generate(model, input_ids, attention_mask)
            self.assertEqual(expected.shape[1], input_ids.shape[1] + NEW_TOKENS)
            self.assertEqual(
                _generate(ort_model, input_ids, attention_mask).tolist(),
                expected.tolist(),
            )


@unittest.skipIf(not HAS_GENAI, "needs onnxruntime-genai")
class TestONNXRuntimeGenAI(_DecodeTestCase):
    @parametrize("name", MODELS)
    def test_generate(self, name: str) -> None:
        import numpy as np
        import onnxruntime_genai as og

        model, path = self.save(name)
        (path / "genai_config.json").write_text(
            json.dumps(_genai_config(model, cache_argument(model)), indent=2)
        )
        genai_model = og.Model(str(path))
        prompt, batch, mask = _prompts()
        # onnxruntime-genai masks the pad tokens at the end of a sequence, not at
        # the start: it gets the batch right-padded, eager left-padded.
        right_padded = batch.clone()
        right_padded[1] = torch.cat([batch[1, 3:], batch[1, :3]])
        for input_ids, attention_mask, genai_ids in (
            (prompt, torch.ones_like(prompt), prompt),
            (batch, mask, right_padded),
        ):
            expected = _generate(model, input_ids, attention_mask)[:, -NEW_TOKENS:]
            params = og.GeneratorParams(genai_model)
            length = input_ids.shape[1] + NEW_TOKENS
            params.set_search_options(
                batch_size=input_ids.shape[0], max_length=length, min_length=length
            )
            generator = og.Generator(genai_model, params)
            generator.append_tokens(genai_ids.numpy().astype(np.int32))
            while not generator.is_done():
                generator.generate_next_token()
            got = [
                generator.get_sequence(i)[-NEW_TOKENS:].tolist()
                for i in range(input_ids.shape[0])
            ]
            self.assertEqual(got, expected.tolist())


instantiate_parametrized_tests(TestDecodeStepNames)
instantiate_parametrized_tests(TestOptimumORTModel)
instantiate_parametrized_tests(TestONNXRuntimeGenAI)


if __name__ == "__main__":
    run_tests()
