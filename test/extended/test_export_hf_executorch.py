# Owner(s): ["oncall: export"]
"""HuggingFace decoders exported with torch.export and decoded by ExecuTorch.

A decode step of a tiny Llama and GPT-2 (random weights, built from configs,
nothing is downloaded), with inputs ``input_ids``, ``attention_mask``,
``position_ids`` and the KV cache, a ``DynamicCache``, is exported with
``torch.export.export`` (a dynamic batch, number of new tokens and past length,
with upper bounds for ExecuTorch's memory planning), lowered with
``to_edge_transform_and_lower`` to the portable kernels or to XNNPACK, saved as a
``.pte`` file and run by ExecuTorch's Python runtime. The runtime takes and
returns flat lists of tensors: the program's pytree specs turn the inputs into
that list and the outputs back into the model's output and its cache, which is
fed to the next step. The first step runs with an empty past.

Every decode is compared token for token with eager ``model.generate()``, for one
prompt and for a left-padded batch of two. Stock torch cannot export the decode
step (it does not flatten the cache); these tests need the patched torch, and
transformers >= 4.56 (caches made of layers). ``nox -s tests-deploy`` installs
executorch; without it, they skip.
"""

from __future__ import annotations

import importlib.util
import inspect
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
    for name in ("transformers", "executorch")
    if importlib.util.find_spec(name) is None
]
if not _MISSING:
    import transformers

    if TorchVersion(transformers.__version__) < "4.56":
        _MISSING.append("transformers>=4.56")

# The upper bounds of the dynamic dimensions, for ExecuTorch's memory planning.
MAX_BATCH, MAX_LENGTH = 4, 64


def _build(name: str) -> Any:
    # With SDPA, lowering fails in torch's run_decompositions: GPT-2 views the
    # attention output, which decomposed has other strides than export recorded
    # ("Cannot view a tensor with shape", pytorch#136543).
    return build(name, attn_implementation="eager")


def _in_forward_order(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    # the order of the exported program's inputs
    order = list(inspect.signature(model.forward).parameters)
    return {name: inputs[name] for name in sorted(inputs, key=order.index)}


def _export(model: Any) -> torch.export.ExportedProgram:
    """The decode step: 2 new tokens after a past of 3, exported with dynamic shapes."""
    cache_name = cache_argument(model)
    with torch.no_grad():
        past = model(input_ids=torch.randint(3, VOCAB, (2, 3)), use_cache=True)
    inputs = _in_forward_order(
        model,
        {
            "input_ids": torch.randint(3, VOCAB, (2, 2)),
            "attention_mask": torch.ones(2, 5, dtype=torch.long),
            "position_ids": torch.arange(3, 5).repeat(2, 1),
            cache_name: past[cache_name],
        },
    )
    Dim = torch.export.Dim
    batch = Dim("batch", max=MAX_BATCH)
    seq, length = Dim("seq", max=MAX_LENGTH), Dim("past", max=MAX_LENGTH)
    shapes = torch.export.ShapesCollection()
    shapes[inputs["input_ids"]] = {0: batch, 1: seq}
    shapes[inputs["position_ids"]] = {0: batch, 1: seq}
    # past + seq, which export derives; bounded too, or ExecuTorch plans its size
    shapes[inputs["attention_mask"]] = {0: batch, 1: Dim.AUTO(max=2 * MAX_LENGTH)}
    # the cache's leaves, walked before any export: register the classes an
    # export registers at its start (docs/design.md, patch 2)
    pytree._update_pytree_families()
    for tensor in pytree.tree_leaves(inputs[cache_name]):
        shapes[tensor] = {0: batch, 2: length}
    with torch.no_grad():
        return torch.export.export(
            model,
            (),
            kwargs=inputs,
            dynamic_shapes=shapes.dynamic_shapes(model, (), inputs),
        )


def _lower(program: torch.export.ExportedProgram, backend: str) -> bytes:
    """The ``.pte`` file of the program: portable kernels, or delegated to XNNPACK."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner,
    )
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    partitioner = [XnnpackPartitioner()] if backend == "xnnpack" else None
    # ExecuTorch's IR check takes len() of the first tensor that split() returns
    # for that of the list, which specializes GPT-2's batch dimension.
    config = EdgeCompileConfig(_check_ir_validity=False)
    edge = to_edge_transform_and_lower(
        program, partitioner=partitioner, compile_config=config
    )
    return edge.to_executorch().buffer


def _prompts() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One prompt of 5 tokens; a batch of prompts of 6 and 3 tokens, left-padded."""
    torch.manual_seed(1)
    prompt = torch.randint(3, VOCAB, (1, 5))
    batch = torch.randint(3, VOCAB, (2, 6))
    batch[1, :3] = PAD
    return [(prompt, torch.ones_like(prompt)), (batch, (batch != PAD).long())]


def _empty_cache(model: Any, batch: int) -> Any:
    """A cache of past length 0, of the structure of the exported step's cache."""
    with torch.no_grad():
        cache = model(input_ids=torch.full((batch, 1), BOS), use_cache=True)[
            cache_argument(model)
        ]
    # New tensors: ExecuTorch wants a contiguous tensor's strides, which a slice
    # of length 0 does not have.
    return pytree.tree_map(
        lambda t: t.new_zeros(batch, t.shape[1], 0, t.shape[3]), cache
    )


@unittest.skipIf(_MISSING, f"needs {', '.join(_MISSING)}")
class TestExecuTorchDecode(TestCase):
    # One export per model, shared by the tests of both backends.
    _programs: dict[str, tuple[Any, torch.export.ExportedProgram]] = {}

    def export(self, name: str) -> tuple[Any, torch.export.ExportedProgram]:
        if name not in self._programs:
            model = _build(name)
            self._programs[name] = (model, _export(model))
        return self._programs[name]

    def decode(
        self,
        model: Any,
        program: torch.export.ExportedProgram,
        method: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Greedy decoding in ExecuTorch, as ``generate()`` does it for these models."""
        cache_name = cache_argument(model)
        cache = _empty_cache(model, input_ids.shape[0])
        # generate(): left padding gets position 1, then count the tokens
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        tokens, new = input_ids, input_ids
        for _ in range(NEW_TOKENS):
            inputs = {
                "input_ids": new,
                "attention_mask": attention_mask,
                "position_ids": positions,
                cache_name: cache,
            }
            flat, spec = pytree.tree_flatten(((), _in_forward_order(model, inputs)))
            self.assertEqual(spec, program.call_spec.in_spec)
            output = pytree.tree_unflatten(
                list(method.execute(flat)), program.call_spec.out_spec
            )
            logits = output.logits[:, -1]
            logits[:, EOS] = float("-inf")  # min_new_tokens
            new = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=1)
            cache = output[cache_name]
            attention_mask = torch.cat([attention_mask, torch.ones_like(new)], dim=1)
            positions = positions[:, -1:] + 1
        return tokens

    @parametrize("backend", ["portable", "xnnpack"])
    @parametrize("name", MODELS)
    def test_decode(self, name: str, backend: str) -> None:
        from executorch.runtime import Runtime

        model, program = self.export(name)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{name}.pte"
            path.write_bytes(_lower(program, backend))
            method = Runtime.get().load_program(path).load_method("forward")
            for input_ids, attention_mask in _prompts():
                expected = model.generate(
                    input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )
                self.assertEqual(expected.shape[1], input_ids.shape[1] + NEW_TOKENS)
                got = self.decode(model, program, method, input_ids, attention_mask)
                self.assertEqual(got.tolist(), expected.tolist())


instantiate_parametrized_tests(TestExecuTorchDecode)


if __name__ == "__main__":
    run_tests()
