# Owner(s): ["oncall: distributed"]
"""DistributedDataParallel on modules that return pytree-family output objects.

DDP flattens a module's output with pytree: with ``static_graph=True`` (first
iteration) and with ``find_unused_parameters=True`` it routes every output tensor
through ``_DDPSink``. An output class that is a pytree leaf hides its tensors from
the sink: with ``static_graph=True`` the delayed all-reduce of the first iteration
is never queued, and with ``find_unused_parameters=True`` an output tensor left
out of the loss keeps the bucket of its parameters from being reduced: either way
the ranks' gradients silently differ. Registering the output classes as a pytree
family (``register_pytree_family``) fixes both.

The stand-in classes below behave like HuggingFace's ``ModelOutput`` and KV caches
where it matters, so the tests need only torch; the tests with the real
transformers classes skip without it. Each rank compares its gradients with a
single-process reference that sees the inputs of every rank.
"""

import dataclasses
import importlib.util
import sys
import unittest
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

import torch.utils._pytree as pytree
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.common_distributed import (
    MultiProcessTestCase,
    requires_gloo,
)
from torch.testing._internal.common_utils import run_tests


try:
    import transformers

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

# transformers 4.31 has no caches (without importing the module: it is slow)
HAS_CACHE_UTILS = (
    HAS_TRANSFORMERS
    and importlib.util.find_spec("transformers.cache_utils") is not None
)

ITERATIONS = 3
DIM = 8


class OutputLike(OrderedDict):
    """Like transformers' ``ModelOutput``: non-None fields are the keys."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


@dataclasses.dataclass
class EncoderOutputLike(OutputLike):
    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclasses.dataclass
class LMOutputLike(OutputLike):
    logits: torch.Tensor | None = None
    aux_logits: torch.Tensor | None = None
    past_key_values: "CacheLike | None" = None


@dataclasses.dataclass
class CacheLike:
    """Like a transformers KV cache: a base of dataclasses."""


@dataclasses.dataclass
class DynamicCacheLike(CacheLike):
    keys: list[torch.Tensor] = dataclasses.field(default_factory=list)
    values: list[torch.Tensor] = dataclasses.field(default_factory=list)


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(DIM, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> EncoderOutputLike:
        h0 = torch.tanh(self.body(x))
        h1 = torch.tanh(self.mid(h0))
        # attentions stays None (not a key); hidden_states is a nested tuple
        return EncoderOutputLike(
            last_hidden_state=h1, pooler_output=self.head(h1), hidden_states=(h0, h1)
        )


def encoder_loss(out: EncoderOutputLike) -> torch.Tensor:
    return (
        out.pooler_output.square().mean()
        + out.hidden_states[0].mean()
        + out["last_hidden_state"].abs().mean()
    )


class TwoHeads(torch.nn.Module):
    """The loss uses ``logits`` only: ``aux_head`` is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(DIM, 16)
        self.head = torch.nn.Linear(16, 4)
        self.aux_head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> LMOutputLike:
        h = torch.relu(self.trunk(x))
        return LMOutputLike(logits=self.head(h), aux_logits=self.aux_head(h))


def logits_loss(out: Any) -> torch.Tensor:
    return out.logits.square().mean()


class Decoder(torch.nn.Module):
    """Returns its keys and values in a cache, as a decoder with use_cache does."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.q = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(layers))
        self.k = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(layers))
        self.v = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(layers))
        self.head = torch.nn.Linear(DIM, 4)

    def forward(self, h: torch.Tensor) -> LMOutputLike:
        cache = DynamicCacheLike()
        for q, k, v in zip(self.q, self.k, self.v):
            keys, values = k(h), v(h)
            cache.keys.append(keys)
            cache.values.append(values)
            attention = torch.softmax(q(h) @ keys.transpose(-1, -2), dim=-1)
            h = h + attention @ values
        return LMOutputLike(logits=self.head(h), past_key_values=cache)


def cache_loss(out: LMOutputLike) -> torch.Tensor:
    cache = out.past_key_values
    return logits_loss(out) + sum(t.mean() for t in cache.keys + cache.values)


if HAS_TRANSFORMERS:

    class BertLikeEncoder(Encoder):
        """``Encoder`` returning transformers' own output class, whose module is
        imported when the model is built, before DDP registers the families."""

        def __init__(self) -> None:
            super().__init__()
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            self.output_class = BaseModelOutputWithPooling

        def forward(self, x: torch.Tensor) -> Any:
            return self.output_class(**super().forward(x))

    class TinyLlama(torch.nn.Module):
        """A tiny Llama whose output carries a ``DynamicCache``."""

        def __init__(self) -> None:
            super().__init__()
            config = transformers.LlamaConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=32,
            )
            config._attn_implementation = "eager"
            self.lm = transformers.LlamaForCausalLM(config)

        def forward(self, ids: torch.Tensor) -> Any:
            return self.lm(
                ids, past_key_values=transformers.DynamicCache(), use_cache=True
            )


def cache_tensors_of(out: Any) -> list[torch.Tensor]:
    # the leaves of a cache are its tensors and its counters (ints)
    leaves = pytree.tree_leaves(out.past_key_values)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def llama_loss(out: Any) -> torch.Tensor:
    cache_tensors = cache_tensors_of(out)
    if not cache_tensors:
        raise AssertionError("the DynamicCache holds no tensors")
    return out.logits.square().mean() + sum(t.mean() for t in cache_tensors)


class DDPModelOutputTest(MultiProcessTestCase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @property
    def world_size(self) -> int:
        return 2

    def _register_stand_ins(self) -> None:
        # in this rank's process; what a library does at import
        for base in (OutputLike, CacheLike):
            pytree.register_pytree_family(base)
            self.addCleanup(pytree._deregister_pytree_family, base)

    def _inputs(self) -> torch.Tensor:
        # the inputs of every rank and iteration, the same in every process
        g = torch.Generator().manual_seed(1)
        return torch.randn(ITERATIONS, self.world_size, 3, DIM, generator=g)

    def _check_gradients(
        self,
        make_model: Callable[[], torch.nn.Module],
        loss_fn: Callable[[Any], torch.Tensor],
        inputs: torch.Tensor,
        check_output: Callable[[Any], None] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        """Train ``ITERATIONS`` steps with DDP and compare with one process."""
        if not dist.is_initialized():
            # destroyed when the rank exits (destroy_pg_upon_exit)
            store = dist.FileStore(self.file_name, self.world_size)
            dist.init_process_group(
                "gloo", store=store, rank=self.rank, world_size=self.world_size
            )
        torch.manual_seed(0)
        reference = make_model()
        torch.manual_seed(0)
        model = DistributedDataParallel(make_model(), **ddp_kwargs)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for it in range(ITERATIONS):
            reference_opt.zero_grad()
            # DDP averages the gradients: the reference loss is the mean of the ranks'
            losses = [loss_fn(reference(x)) for x in inputs[it]]
            (sum(losses) / self.world_size).backward()

            opt.zero_grad()
            out = model(inputs[it, self.rank])
            self.assertIs(type(out), type(reference(inputs[it, self.rank])))
            if check_output is not None:
                check_output(out)
            loss_fn(out).backward()
            for (name, p), ref in zip(
                model.module.named_parameters(), reference.parameters()
            ):
                self.assertEqual(
                    p.grad,
                    ref.grad,
                    atol=1e-6,
                    rtol=1e-5,
                    msg=f"rank {self.rank} iteration {it} {name}",
                )
            opt.step()
            reference_opt.step()

    def assertSunk(self, tensors: list[torch.Tensor]) -> None:
        """DDP saw the tensors: it passed them through its sink."""
        self.assertTrue(tensors)
        for t in tensors:
            self.assertEqual(type(t.grad_fn).__name__, "_DDPSinkBackward")

    @requires_gloo()
    def test_static_graph_model_output(self) -> None:
        self._register_stand_ins()

        def check_output(out: EncoderOutputLike) -> None:
            self.assertEqual(
                list(out.keys()),
                ["last_hidden_state", "pooler_output", "hidden_states"],
            )
            self.assertIsNone(out.attentions)
            self.assertIs(type(out.hidden_states), tuple)

        self._check_gradients(
            Encoder, encoder_loss, self._inputs(), check_output, static_graph=True
        )

    @requires_gloo()
    def test_find_unused_parameters_unused_output(self) -> None:
        # aux_logits is not in the loss: only through the sink does DDP learn
        # that aux_head gets no gradient
        self._register_stand_ins()

        def check_output(out: LMOutputLike) -> None:
            self.assertSunk([out.logits, out.aux_logits])

        self._check_gradients(
            TwoHeads,
            logits_loss,
            self._inputs(),
            check_output,
            find_unused_parameters=True,
        )

    @requires_gloo()
    def test_find_unused_parameters_cache_in_output(self) -> None:
        self._register_stand_ins()

        def check_output(out: LMOutputLike) -> None:
            cache = out.past_key_values
            self.assertIs(type(cache), DynamicCacheLike)
            self.assertEqual(len(cache.keys), 2)
            self.assertSunk([out.logits, *cache.keys, *cache.values])

        for loss_fn in (cache_loss, logits_loss):
            with self.subTest(loss=loss_fn.__name__):
                self._check_gradients(
                    Decoder,
                    loss_fn,
                    self._inputs(),
                    check_output,
                    find_unused_parameters=True,
                )

    @requires_gloo()
    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    def test_static_graph_transformers_model_output(self) -> None:
        def check_output(out: Any) -> None:
            self.assertEqual(
                list(out.keys()),
                ["last_hidden_state", "pooler_output", "hidden_states"],
            )

        self._check_gradients(
            BertLikeEncoder,
            encoder_loss,
            self._inputs(),
            check_output,
            static_graph=True,
        )

    @requires_gloo()
    @unittest.skipIf(not HAS_TRANSFORMERS, "transformers is not installed")
    @unittest.skipIf(not HAS_CACHE_UTILS, "needs transformers with a DynamicCache")
    def test_find_unused_parameters_transformers_cache_in_output(self) -> None:
        # an nn.Module in transformers 4.36 to 4.5x, a plain class since 4.56
        def check_output(out: Any) -> None:
            self.assertIsInstance(out.past_key_values, transformers.DynamicCache)
            self.assertSunk(cache_tensors_of(out))

        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 64, (ITERATIONS, self.world_size, 2, 6), generator=g)
        self._check_gradients(
            TinyLlama, llama_loss, ids, check_output, find_unused_parameters=True
        )


if __name__ == "__main__":
    run_tests()
