# Owner(s): ["oncall: distributed"]
"""DistributedDataParallel(static_graph=True) on a module returning a HuggingFace ``ModelOutput``.

With ``static_graph=True`` DDP flattens the module's output with pytree and routes every output tensor through
``_DDPSink``, whose backward triggers the delayed all-reduce of the first iteration. If the output class is a pytree
leaf (stock torch + transformers 4.31.0, which does not register its outputs), the tensors inside bypass the sink and
gradients silently stay unsynchronized. The ``transformers.utils.generic:ModelOutput`` family fixes this.

The test starts two gloo ranks on localhost itself (plain subprocesses) and compares their gradients with a
single-process reference.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

try:
    import transformers  # noqa: F401

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False
try:
    import transformers.cache_utils  # noqa: F401

    HAS_CACHE_UTILS = True
except ImportError:
    HAS_CACHE_UTILS = False


WORLD_SIZE = 2
ITERATIONS = 3

# Shared by the ranks and the single-process reference.
MODEL_SRC = textwrap.dedent(
    """
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 16)
            self.mid = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            h0 = torch.tanh(self.body(x))
            h1 = torch.tanh(self.mid(h0))
            # attentions stays None (not a key); hidden_states is a nested tuple
            return BaseModelOutputWithPooling(last_hidden_state=h1, pooler_output=self.head(h1), hidden_states=(h0, h1))


    def loss_fn(out):
        return out.pooler_output.square().mean() + out.hidden_states[0].mean() + out["last_hidden_state"].abs().mean()


    def make_model():
        torch.manual_seed(0)
        return Net()


    def make_inputs(world_size, iterations):
        g = torch.Generator().manual_seed(1)
        return torch.randn(iterations, world_size, 3, 8, generator=g)
    """
)

# A tiny Llama whose output carries a DynamicCache (an nn.Module in
# transformers 4.36 to 4.5x); the loss uses the cache tensors too, so their
# gradients must flow through DDP's handling of the output.
LLAMA_MODEL_SRC = textwrap.dedent(
    """
    import torch
    import torch.utils._pytree as pytree
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            )
            config._attn_implementation = "eager"
            self.lm = LlamaForCausalLM(config)

        def forward(self, ids):
            return self.lm(ids, past_key_values=DynamicCache(), use_cache=True)


    def loss_fn(out):
        cache_tensors = pytree.tree_leaves(out.past_key_values)
        assert cache_tensors, "the DynamicCache holds no tensors"
        return out.logits.square().mean() + sum(t.mean() for t in cache_tensors)


    def make_model():
        torch.manual_seed(0)
        return Net()


    def make_inputs(world_size, iterations):
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, 64, (iterations, world_size, 2, 6), generator=g)
    """
)

WORKER_SRC = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size, iterations, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    namespace = {}
    exec(os.environ["DDP_TEST_MODEL_SRC"], namespace)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    ddp_kwargs = json.loads(os.environ["DDP_TEST_DDP_KWARGS"])
    model = DistributedDataParallel(namespace["make_model"](), **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = namespace["make_inputs"](world_size, iterations)
    grads, types = [], []
    for it in range(iterations):
        opt.zero_grad()
        out = model(inputs[it, rank])
        types.append([f"{type(out).__module__}.{type(out).__qualname__}", list(out.keys())])
        namespace["loss_fn"](out).backward()
        grads.append({name: p.grad.clone() for name, p in model.module.named_parameters()})
        opt.step()
    torch.save(grads, os.path.join(out_dir, f"grads{rank}.pt"))
    with open(os.path.join(out_dir, f"types{rank}.json"), "w") as f:
        json.dump(types, f)
    dist.destroy_process_group()
    """
)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
@unittest.skipIf(not dist.is_available() or not dist.is_gloo_available(), "gloo is not available")
class TestDDPModelOutput(TestCase):
    def _reference(self, model_src):
        namespace = {}
        exec(model_src, namespace)  # noqa: S102 - same source as the ranks run, trusted test code
        model = namespace["make_model"]()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        inputs = namespace["make_inputs"](WORLD_SIZE, ITERATIONS)
        grads = []
        for it in range(ITERATIONS):
            opt.zero_grad()
            # DDP averages the ranks' gradients: the reference loss is the mean of the per-rank losses
            loss = sum(namespace["loss_fn"](model(inputs[it, r])) for r in range(WORLD_SIZE)) / WORLD_SIZE
            loss.backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            opt.step()
        out = model(inputs[0, 0])
        return grads, type(out), list(out.keys())

    def _run_ranks(self, out_dir, model_src, ddp_kwargs):
        env = os.environ.copy()
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            DDP_TEST_MODEL_SRC=model_src,
            DDP_TEST_DDP_KWARGS=json.dumps(ddp_kwargs),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            OMP_NUM_THREADS="1",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER_SRC, str(rank), str(WORLD_SIZE), str(ITERATIONS), out_dir],
                env=env,
                cwd=out_dir,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(WORLD_SIZE)
        ]
        failures = []
        for rank, proc in enumerate(procs):
            try:
                output, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                output, _ = proc.communicate()
                failures.append(f"rank {rank} timed out:\n{output}")
                continue
            if proc.returncode != 0:
                failures.append(f"rank {rank} exited with {proc.returncode}:\n{output}")
        if failures:
            self.fail("\n".join(failures))

    def _check_ranks_match_reference(self, model_src, ddp_kwargs, keys=None):
        ref_grads, out_type, ref_keys = self._reference(model_src)
        if keys is not None:
            self.assertEqual(ref_keys, keys)
        with tempfile.TemporaryDirectory() as out_dir:
            self._run_ranks(out_dir, model_src, ddp_kwargs)
            rank_grads = [torch.load(os.path.join(out_dir, f"grads{r}.pt")) for r in range(WORLD_SIZE)]
            rank_types = []
            for r in range(WORLD_SIZE):
                with open(os.path.join(out_dir, f"types{r}.json")) as f:
                    rank_types.append(json.load(f))
        expected_type = f"{out_type.__module__}.{out_type.__qualname__}"
        for r in range(WORLD_SIZE):
            for it in range(ITERATIONS):
                # DDP hands back the same ModelOutput subclass with the same keys
                self.assertEqual(rank_types[r][it], [expected_type, ref_keys])
                self.assertEqual(rank_grads[r][it].keys(), ref_grads[it].keys())
                for name, ref in ref_grads[it].items():
                    self.assertEqual(
                        rank_grads[r][it][name], ref, atol=1e-6, rtol=1e-5, msg=f"rank {r} iteration {it} {name}"
                    )

    def test_static_graph_gradients_match_single_process(self):
        self._check_ranks_match_reference(
            MODEL_SRC, {"static_graph": True}, ["last_hidden_state", "pooler_output", "hidden_states"]
        )

    @unittest.skipIf(not HAS_CACHE_UTILS, "transformers < 4.36 has no Cache classes")
    def test_find_unused_parameters_with_cache_output(self):
        # The output's DynamicCache is flattened by DDP to find the tensors it
        # returns; before transformers 4.56 the cache is an nn.Module.
        self._check_ranks_match_reference(LLAMA_MODEL_SRC, {"find_unused_parameters": True})


if __name__ == "__main__":
    run_tests()
