# Owner(s): ["oncall: export"]
"""A HuggingFace decode step saved with torch.export.save, loaded in a fresh
process and decoded there, as docs/deploy.md's save-and-load recipe does.

The step takes a token, its attention mask and the cache (a ``DynamicCache``)
and returns the next greedy token and the cache. It is exported from a prompt's
cache with ``Dim.AUTO`` and saved with its example inputs; a fresh process that
ran ``import torch, transformers`` loads it, takes the prompt's token, mask and
cache from ``ep.example_inputs`` (nothing is unpickled) and decodes. The tokens
must be those of eager ``model.generate()``. Under transformers 4.57 the mask
code calls a custom autograd Function (vmapped indexing), which the saved
program holds as a ``flat_apply`` node. Needs transformers >= 4.56 (caches made
of layers).
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from hf_decode_models import build, cache_argument, MODELS, NEW_TOKENS

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


# transformers >= 4.56: caches made of layers (4.31.0 has no cache_utils at all)
HAS_CACHE_LAYERS = (
    importlib.util.find_spec("transformers") is not None
    and importlib.util.find_spec("transformers.cache_utils") is not None
)
if HAS_CACHE_LAYERS:
    from transformers import cache_utils

    HAS_CACHE_LAYERS = hasattr(cache_utils, "DynamicLayer")

PROMPT = [1, 64, 8, 31, 90]

LOAD_AND_DECODE = """
import json, sys
import torch, transformers

ep = torch.export.load(sys.argv[1])
step = ep.module()
(token, mask, cache), _ = ep.example_inputs
tokens = [token.item()]
with torch.no_grad():
    for _ in range(int(sys.argv[2]) - 1):
        token, cache = step(token, mask, cache)
        mask = torch.cat([mask, mask[:, -1:]], dim=1)
        tokens.append(token.item())
print(json.dumps({"cache": type(cache).__name__, "tokens": tokens}))
"""


class Step(torch.nn.Module):
    """A token, its mask and the cache in; the next greedy token and the cache out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.cache = cache_argument(model)

    def forward(self, input_ids, attention_mask, cache):  # type: ignore[no-untyped-def]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=True,
            **{self.cache: cache},
        )
        return out.logits[:, -1:].argmax(-1), out[self.cache]


@unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
class TestExportHFSaveDecode(TestCase):
    @parametrize("name", MODELS)
    def test_save_load_and_decode_in_a_fresh_process(self, name: str) -> None:
        model = build(name)
        step = Step(model)
        prompt = torch.tensor([PROMPT])
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.ones(1, len(PROMPT) + 1, dtype=torch.long)
            auto = torch.export.Dim.AUTO
            ep = torch.export.export(
                step,
                (token, mask, out[step.cache]),
                dynamic_shapes=(None, {1: auto}, auto),
            )
            eager = model.generate(
                prompt,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
            )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "step.pt2")
            torch.export.save(ep, path)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    textwrap.dedent(LOAD_AND_DECODE),
                    path,
                    str(NEW_TOKENS),
                ],
                capture_output=True,
                text=True,
                cwd=tmp,
                timeout=300,
            )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        result = json.loads(proc.stdout.splitlines()[-1])
        self.assertEqual(result["cache"], "DynamicCache")
        self.assertEqual(result["tokens"], eager[0, len(PROMPT) :].tolist())


instantiate_parametrized_tests(TestExportHFSaveDecode)

if __name__ == "__main__":
    run_tests()
