# Owner(s): ["oncall: export"]
"""torch.export, torch._dynamo.export and torch.compile with pytree families.

The families are stand-ins for HuggingFace outputs and caches (see
``pytree_family_stand_ins.py``), so these tests need only torch. The tests with
the real classes are ``test/extended/test_export_hf_model_output.py`` and
``test_export_hf_kv_cache.py``; they skip without transformers.
"""

import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import unittest
from collections import OrderedDict, UserDict
from typing import Any

import torch
import torch.utils._pytree as py_pytree
from torch._dynamo.testing import CompileCounter
from torch.export import Dim
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    skipIfTorchDynamo,
    subtest,
    TestCase,
)


try:
    from .pytree_family_stand_ins import (
        BaseModelOutputLike,
        BaseOutputLike,
        BatchFeatureLike,
        BatchLike,
        CacheLike,
        CausalLMOutputLike,
        DynamicCacheLike,
        ModelOutputLike,
        Seq2SeqLMOutputLike,
        SlidingWindowCacheLike,
        UNetOutputLike,
    )
except ImportError:
    from pytree_family_stand_ins import (
        BaseModelOutputLike,
        BaseOutputLike,
        BatchFeatureLike,
        BatchLike,
        CacheLike,
        CausalLMOutputLike,
        DynamicCacheLike,
        ModelOutputLike,
        Seq2SeqLMOutputLike,
        SlidingWindowCacheLike,
        UNetOutputLike,
    )


# the stand-ins module's name, as in the serialized specs
STAND_INS = ModelOutputLike.__module__


pytree_modules = {"py": py_pytree}
if py_pytree._cxx_pytree_dynamo_traceable:
    import torch.utils._cxx_pytree as cxx_pytree

    pytree_modules["cxx"] = cxx_pytree

parametrize_pytree = parametrize(
    "pytree", [subtest(module, name=name) for name, module in pytree_modules.items()]
)
parametrize_strict = parametrize(
    "strict", [subtest(True, name="strict"), subtest(False, name="nonstrict")]
)

VOCAB = 16
DIM = 8
LAYERS = 2


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(DIM, DIM)
        self.mid = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> BaseModelOutputLike:
        h0 = torch.tanh(self.body(x))
        h1 = torch.tanh(self.mid(h0))
        # attentions stays None, so it is not a key
        return BaseModelOutputLike(last_hidden_state=h1, hidden_states=(h0, h1))


class Head(torch.nn.Module):
    """Takes an encoder output (an output class as an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, VOCAB)

    def forward(
        self, encoder_output: BaseModelOutputLike, labels: torch.Tensor
    ) -> CausalLMOutputLike:
        logits = self.proj(
            encoder_output.last_hidden_state + encoder_output["hidden_states"][0]
        )
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return CausalLMOutputLike(loss=loss, logits=logits)


class UNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, sample: torch.Tensor) -> UNetOutputLike:
        return UNetOutputLike(sample=sample + self.conv(sample))


class Decoder(torch.nn.Module):
    """A tiny attention decoder that updates the cache it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        # separate projections: contiguous keys and values in every step's cache
        self.q = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.k = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.v = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, past_key_values: DynamicCacheLike
    ) -> CausalLMOutputLike:
        h = self.embed(input_ids)
        for layer in range(LAYERS):
            q, k, v = (proj[layer](h).unsqueeze(1) for proj in (self.q, self.k, self.v))
            keys, values = past_key_values.update(layer, k, v)
            attention = torch.softmax(q @ keys.transpose(-1, -2) / DIM**0.5, dim=-1)
            h = h + (attention @ values).squeeze(1)
        return CausalLMOutputLike(logits=self.head(h), past_key_values=past_key_values)


class Seq2SeqDecoder(Decoder):
    """Returns ``Seq2SeqLMOutputLike``, defined after the family was registered."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, past_key_values: DynamicCacheLike
    ) -> Seq2SeqLMOutputLike:
        out = super().forward(input_ids, past_key_values)
        return Seq2SeqLMOutputLike(
            logits=out.logits,
            past_key_values=out.past_key_values,
            encoder_last_hidden_state=out.logits.sum(-1),
        )


class Batcher(torch.nn.Module):
    """Takes a tokenizer-like batch and returns a processor-like one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)

    def forward(self, batch: BatchLike) -> BatchFeatureLike:
        h = self.embed(batch["input_ids"]) * batch["attention_mask"].unsqueeze(-1)
        return BatchFeatureLike({"hidden": h, "pooled": (h.sum(1),)})


def _batch(seed: int = 3) -> BatchLike:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    return BatchLike(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))


def _prefill(model: Decoder, cache_cls: type, length: int = 5) -> DynamicCacheLike:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        out = model(torch.randint(0, VOCAB, (2, length), generator=g), cache_cls())
    return out.past_key_values


def _encoder_output() -> BaseModelOutputLike:
    with torch.no_grad():
        return Encoder()(torch.randn(2, 3, DIM))


def _tokens(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (2, 1), generator=g) for _ in range(n)]


def _decoder_dynamic_shapes(cache: DynamicCacheLike) -> dict[str, Any]:
    # a family member is given by its children: [keys, values] for the cache
    length = Dim("length", min=2, max=64)
    per_layer = [{2: length} for _ in cache.keys]
    return {"input_ids": None, "past_key_values": [per_layer, per_layer]}


def _export(mod: torch.nn.Module, args: tuple, strict: bool, **kwargs: Any):
    return torch.export.export(mod, copy.deepcopy(args), strict=strict, **kwargs)


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _format_serialized(node: dict[str, Any], depth: int = 0) -> str:
    """One line per node of a serialized spec: its type and context, or * for a leaf."""
    line = "  " * depth + (f"{node['type']} {node['context']}" if node["type"] else "*")
    children = [_format_serialized(c, depth + 1) for c in node["children_spec"]]
    return "\n".join([line, *children])


def _spec_types(spec: py_pytree.TreeSpec) -> list[type]:
    """The node types of a spec, depth first."""
    if spec.is_leaf():
        return []
    return [spec.type] + [t for child in spec.children() for t in _spec_types(child)]


class TestExportPytreeFamily(TestCase):
    def setUp(self) -> None:
        super().setUp()
        torch._dynamo.reset()
        torch.manual_seed(0)
        # The stand-ins defined after their families' registration are nodes
        # from torch's next boundary; the eager tests below start after one.
        py_pytree._update_pytree_families()

    def assertSameTree(self, actual: Any, expected: Any) -> None:
        actual_leaves, actual_spec = py_pytree.tree_flatten(actual)
        expected_leaves, expected_spec = py_pytree.tree_flatten(expected)
        self.assertEqual(actual_spec, expected_spec)
        self.assertEqual(len(actual_leaves), len(expected_leaves))
        for a, e in zip(actual_leaves, expected_leaves):
            self.assertIsInstance(a, torch.Tensor)
            self.assertEqual(a, e, atol=1e-6, rtol=1e-5)

    @parametrize_strict
    def test_export_model_output(self, strict: bool) -> None:
        mod, x = Encoder(), torch.randn(2, 3, DIM)
        expected = mod(x)
        ep = _export(mod, (x,), strict)
        out_spec = ep.call_spec.out_spec
        self.assertIs(out_spec.type, BaseModelOutputLike)
        self.assertEqual(out_spec.context, ["last_hidden_state", "hidden_states"])
        self.assertEqual(out_spec.num_leaves, 3)
        actual = ep.module()(x)
        self.assertIs(type(actual), BaseModelOutputLike)
        self.assertEqual(list(actual.keys()), ["last_hidden_state", "hidden_states"])
        self.assertIsNone(actual.attentions)
        self.assertIs(type(actual.hidden_states), tuple)
        self.assertEqual(actual.last_hidden_state, expected.last_hidden_state)
        self.assertSameTree(actual, expected)

    @parametrize_strict
    def test_export_diffusers_like_output(self, strict: bool) -> None:
        mod, sample = UNet(), torch.randn(1, 3, 4, 4)
        expected = mod(sample)
        ep = _export(mod, (sample,), strict)
        self.assertIs(ep.call_spec.out_spec.type, UNetOutputLike)
        actual = ep.module()(sample)
        self.assertIs(type(actual), UNetOutputLike)
        self.assertIsInstance(actual, BaseOutputLike)
        self.assertEqual(actual[0], expected.sample)
        self.assertEqual(actual.sample, expected["sample"])

    @parametrize_strict
    def test_export_subclass_defined_after_registration(self, strict: bool) -> None:
        # a subclass of the registered base, defined here, long after registration
        @dataclasses.dataclass
        class ClassifierOutputLike(ModelOutputLike):
            loss: torch.Tensor | None = None
            logits: torch.Tensor | None = None
            extra: tuple | None = None

        class Classifier(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(DIM, 4)

            def forward(self, x: torch.Tensor) -> ClassifierOutputLike:
                y = self.lin(x)
                return ClassifierOutputLike(logits=y, extra=(y.sum(), y * 2))

        mod, x = Classifier(), torch.randn(3, DIM)
        expected = mod(x)
        ep = _export(mod, (x,), strict)
        self.assertIs(ep.call_spec.out_spec.type, ClassifierOutputLike)
        actual = ep.module()(x)
        self.assertIs(type(actual), ClassifierOutputLike)
        self.assertEqual(list(actual.keys()), ["logits", "extra"])
        self.assertIsNone(actual.loss)
        self.assertSameTree(actual, expected)

        # Seq2SeqLMOutputLike and SlidingWindowCacheLike were defined after the
        # registration too, at import of the stand-ins module
        dec = Seq2SeqDecoder()
        cache = _prefill(dec, SlidingWindowCacheLike, length=6)
        token = _tokens(1)[0]
        expected = dec(token, copy.deepcopy(cache))
        ep = _export(dec, (token, cache), strict)
        self.assertEqual(
            _spec_types(ep.call_spec.out_spec),
            [Seq2SeqLMOutputLike, SlidingWindowCacheLike, list, list],
        )
        actual = ep.module()(token, copy.deepcopy(cache))
        self.assertIs(type(actual), Seq2SeqLMOutputLike)
        self.assertIs(type(actual.past_key_values), SlidingWindowCacheLike)
        self.assertEqual(actual.past_key_values.get_seq_length(), 4)
        self.assertSameTree(actual, expected)

    @parametrize(
        "entry_point",
        ["export", "export_nonstrict", "draft_export", "dynamo_export"],
    )
    def test_each_entry_point_registers_new_members(self, entry_point: str) -> None:
        # A member created since the last boundary, as input and output: each
        # entry point registers it before it flattens anything.
        @dataclasses.dataclass
        class NewOutput(ModelOutputLike):
            logits: torch.Tensor | None = None

        class Scale(torch.nn.Module):
            def forward(self, out: NewOutput) -> NewOutput:
                return NewOutput(logits=out.logits * 2)

        x = NewOutput(logits=torch.ones(2))
        self.assertTrue(py_pytree.tree_is_leaf(x))
        if entry_point == "dynamo_export":
            graph_module, _ = torch._dynamo.export(Scale())(x)
            actual = graph_module(x)
        else:
            export = {
                "export": functools.partial(torch.export.export, strict=True),
                "export_nonstrict": functools.partial(
                    torch.export.export, strict=False
                ),
                "draft_export": torch.export.draft_export,
            }[entry_point]
            actual = export(Scale(), (x,)).module()(x)
        self.assertIs(type(actual), NewOutput)
        self.assertEqual(actual.logits, torch.ones(2) * 2)

    @parametrize_strict
    def test_export_output_class_input(self, strict: bool) -> None:
        head = Head()
        labels = torch.randint(0, VOCAB, (2, 3))
        encoder_output = _encoder_output()
        expected = head(encoder_output, labels)
        ep = _export(head, (encoder_output, labels), strict)
        in_types = _spec_types(ep.call_spec.in_spec)
        self.assertIn(BaseModelOutputLike, in_types)
        self.assertEqual(len(ep.graph_signature.user_inputs), 4)
        actual = ep.module()(encoder_output, labels)
        self.assertIs(type(actual), CausalLMOutputLike)
        self.assertEqual(list(actual.keys()), ["loss", "logits"])
        self.assertSameTree(actual, expected)
        # other values of the same structure
        other = _encoder_output()
        self.assertSameTree(ep.module()(other, labels), head(other, labels))
        # another structure is refused
        missing = BaseModelOutputLike(last_hidden_state=other.last_hidden_state)
        with self.assertRaisesRegex(ValueError, "[Tt]ree ?[Ss]pec|structure"):
            ep.module()(missing, labels)

    @parametrize_strict
    def test_export_dynamic_shapes(self, strict: bool) -> None:
        mod = Encoder()
        batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=32)
        ep = _export(
            mod, (torch.randn(2, 3, DIM),), strict, dynamic_shapes=({0: batch, 1: seq},)
        )
        for shape in [(1, 5, DIM), (4, 2, DIM), (2, 3, DIM)]:
            x = torch.randn(shape)
            actual = ep.module()(x)
            self.assertIs(type(actual), BaseModelOutputLike)
            self.assertEqual(actual.last_hidden_state.shape, shape)
            self.assertSameTree(actual, mod(x))

    @parametrize_strict
    @parametrize(
        "cache_cls",
        [
            subtest(DynamicCacheLike, name="dynamic"),
            subtest(SlidingWindowCacheLike, name="sliding"),
        ],
    )
    def test_decode_loop_feeds_back_cache(self, strict: bool, cache_cls: type) -> None:
        mod = Decoder()
        cache = _prefill(mod, cache_cls)
        tokens = _tokens(4)
        # the sliding-window cache keeps a fixed length: no dynamic dimension
        dynamic = cache_cls is DynamicCacheLike
        ep = _export(
            mod,
            (tokens[0], cache),
            strict,
            dynamic_shapes=_decoder_dynamic_shapes(cache) if dynamic else None,
        )
        args_spec = ep.call_spec.in_spec.child(0)
        cache_spec = args_spec.child(1)
        self.assertEqual(_spec_types(cache_spec), [cache_cls, list, list])
        step = ep.module()
        eager_cache, exported_cache = copy.deepcopy(cache), copy.deepcopy(cache)
        lengths = []
        for token in tokens[1:]:
            with torch.no_grad():
                expected = mod(token, eager_cache)
                actual = step(token, exported_cache)
            self.assertIs(type(actual), CausalLMOutputLike)
            self.assertIs(type(actual.past_key_values), cache_cls)
            self.assertSameTree(actual, expected)
            eager_cache = expected.past_key_values
            exported_cache = actual.past_key_values
            lengths.append(exported_cache.get_seq_length())
        self.assertEqual(lengths, [6, 7, 8] if dynamic else [4, 4, 4])

    def test_save_load_fresh_process(self) -> None:
        # Saved here, loaded in a fresh process that registers the families (by
        # importing the stand-ins module) before it loads.
        dec = Decoder()
        cache = _prefill(dec, DynamicCacheLike)
        s2s = Seq2SeqDecoder()
        sliding = _prefill(s2s, SlidingWindowCacheLike, length=6)
        token = _tokens(1)[0]
        cases = {
            "encoder": (Encoder(), (torch.randn(2, 3, DIM),), None),
            "unet": (UNet(), (torch.randn(1, 3, 4, 4),), None),
            "decoder": (dec, (token, cache), _decoder_dynamic_shapes(cache)),
            "seq2seq": (s2s, (token, sliding), None),
        }
        expected = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name, (mod, args, dynamic_shapes) in cases.items():
                ep = _export(mod, args, False, dynamic_shapes=dynamic_shapes)
                torch.export.save(ep, os.path.join(tmp, f"{name}.pt2"))
                torch.save(py_pytree.tree_leaves(args), os.path.join(tmp, f"{name}.in"))
                expected[name] = mod(*copy.deepcopy(args))
            result, _ = _run_python(_LOAD, tmp, STAND_INS, *cases)
            self.assertEqual(result["before_load"], [])
            for name, want in expected.items():
                with self.subTest(case=name):
                    got = result["cases"][name]
                    self.assertEqual(got["type"], _type_name(type(want)))
                    self.assertEqual(got["keys"], list(want.keys()))
                    spec = py_pytree.treespec_loads(got["spec"])
                    self.assertEqual(spec, py_pytree.tree_structure(want))
                    leaves = torch.load(os.path.join(tmp, f"{name}.out"))
                    self.assertSameTree(py_pytree.tree_unflatten(leaves, spec), want)

    @parametrize_strict
    def test_export_user_dict_family(self, strict: bool) -> None:
        mod, batch = Batcher(), _batch()
        ep = _export(mod, (batch,), strict)
        self.assertEqual(
            _spec_types(ep.call_spec.in_spec), [tuple, tuple, BatchLike, dict]
        )
        self.assertEqual(_spec_types(ep.call_spec.out_spec), [BatchFeatureLike, tuple])
        self.assertEqual(len(ep.graph_signature.user_inputs), 2)
        for b in (batch, _batch(seed=4)):
            actual = ep.module()(b)
            self.assertIs(type(actual), BatchFeatureLike)
            self.assertEqual(list(actual.keys()), ["hidden", "pooled"])
            self.assertSameTree(actual, mod(b))

    def test_save_load_user_dict_fresh_process(self) -> None:
        mod, batch = Batcher(), _batch()
        expected = mod(batch)
        cases = ("batch_strict", "batch_nonstrict")
        with tempfile.TemporaryDirectory() as tmp:
            for name in cases:
                ep = _export(mod, (batch,), name == "batch_strict")
                torch.export.save(ep, os.path.join(tmp, f"{name}.pt2"))
                inputs_path = os.path.join(tmp, f"{name}.in")
                torch.save(py_pytree.tree_leaves(batch), inputs_path)
            result, _ = _run_python(_LOAD, tmp, STAND_INS, *cases)
            for name in cases:
                with self.subTest(case=name):
                    got = result["cases"][name]
                    self.assertEqual(got["type"], _type_name(BatchFeatureLike))
                    self.assertEqual(got["keys"], ["hidden", "pooled"])
                    spec = py_pytree.treespec_loads(got["spec"])
                    self.assertEqual(spec, py_pytree.tree_structure(expected))
                    leaves = torch.load(os.path.join(tmp, f"{name}.out"))
                    actual = py_pytree.tree_unflatten(leaves, spec)
                    self.assertSameTree(actual, expected)

    def test_unregistered_user_dict_output_hint(self) -> None:
        class UnregisteredBatch(UserDict):
            pass

        class Returns(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> UnregisteredBatch:
                return UnregisteredBatch(y=x + 1)

        self.assertTrue(py_pytree.tree_is_leaf(UnregisteredBatch(y=1)))
        with self.assertRaisesRegex(
            RuntimeError,
            r"Found .*UnregisteredBatch'> in output, which is not a known type\. "
            r".* A dataclass or a mapping and its subclasses can be registered with "
            r"torch\.utils\._pytree\.register_pytree_family\(<base class>\)\.",
        ):
            torch.export.export(Returns(), (torch.ones(2),), strict=False)

    @parametrize_strict
    def test_unregistered_dataclass_input_hint(self, strict: bool) -> None:
        @dataclasses.dataclass
        class UnregisteredInput:
            x: torch.Tensor

        class Takes(torch.nn.Module):
            def forward(self, inp: UnregisteredInput) -> torch.Tensor:
                return inp.x + 1

        # stock's advice, then the family's
        with self.assertRaisesRegex(
            Exception,
            r"register_dataclass.{1,4}with its subclasses.{1,3}"
            r"torch\.utils\._pytree\.register_pytree_family\(<base class>\)",
        ):
            inputs = (UnregisteredInput(torch.ones(2)),)
            torch.export.export(Takes(), inputs, strict=strict)

    def test_load_without_registration_fails(self) -> None:
        ep = _export(Encoder(), (torch.randn(2, 3, DIM),), False)
        with tempfile.TemporaryDirectory() as tmp:
            torch.export.save(ep, os.path.join(tmp, "encoder.pt2"))
            result, stderr = _run_python(
                _LOAD_UNREGISTERED, os.path.join(tmp, "encoder.pt2")
            )
        self.assertFalse(result["loaded"])
        name = f"{STAND_INS}.BaseModelOutputLike"
        # the wording of PyTorch 2.13 and 2.14, and of 2.15; in the error, or
        # in the log without [export] Raise the error that stopped load
        self.assertRegex(
            result["error"] + stderr,
            rf"Deserializing {re.escape(name)} in pytree (is not registered|failed "
            "because the serialized type is not registered)",
        )

    @parametrize(
        "case",
        ["encoder", "unet", "decoder"],
    )
    def test_dynamo_export(self, case: str) -> None:
        if case == "decoder":
            mod = Decoder()
            args: tuple = (_tokens(1)[0], _prefill(mod, DynamicCacheLike))
        elif case == "encoder":
            mod, args = Encoder(), (torch.randn(2, 3, DIM),)
        else:
            mod, args = UNet(), (torch.randn(1, 3, 4, 4),)
        expected = mod(*copy.deepcopy(args))
        graph_module, _ = torch._dynamo.export(mod)(*copy.deepcopy(args))
        actual = graph_module(*copy.deepcopy(args))
        self.assertIs(type(actual), type(expected))
        self.assertSameTree(actual, expected)

    def test_compile_fullgraph(self) -> None:
        for mod, args in [
            (Encoder(), (torch.randn(2, 3, DIM),)),
            (UNet(), (torch.randn(1, 3, 4, 4),)),
            (Decoder(), (_tokens(1)[0], _prefill(Decoder(), DynamicCacheLike))),
            (Head(), (_encoder_output(), torch.zeros(2, 3).long())),
        ]:
            with self.subTest(model=type(mod).__name__):
                torch._dynamo.reset()
                counter = CompileCounter()
                compiled = torch.compile(mod, fullgraph=True, backend=counter)
                expected = mod(*copy.deepcopy(args))
                actual = compiled(*copy.deepcopy(args))
                self.assertEqual(counter.frame_count, 1)
                self.assertIs(type(actual), type(expected))
                self.assertSameTree(actual, expected)

    @parametrize_pytree
    def test_compile_pytree_functions(self, pytree: Any) -> None:
        # the pytree functions themselves, applied to family members in a graph
        def fn(out: CausalLMOutputLike) -> tuple[Any, Any]:
            leaves, spec = pytree.tree_flatten(out)
            doubled = pytree.tree_unflatten([t * 2 for t in leaves], spec)
            return doubled, pytree.tree_map(torch.neg, out.past_key_values)

        cache = DynamicCacheLike(
            keys=[torch.randn(1, 1, 3, 2)], values=[torch.randn(1, 1, 3, 2)]
        )
        out = CausalLMOutputLike(logits=torch.randn(2, 4), past_key_values=cache)
        counter = CompileCounter()
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        actual = compiled(out)
        self.assertEqual(counter.frame_count, 1)
        expected = fn(out)
        self.assertIs(type(actual[0]), CausalLMOutputLike)
        self.assertIs(type(actual[1]), DynamicCacheLike)
        self.assertSameTree(actual, expected)

    @parametrize_pytree
    def test_flatten_unflatten(self, pytree: Any) -> None:
        cache = SlidingWindowCacheLike(
            keys=[torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2)],
            values=[torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2)],
        )
        h0, h1, logits = torch.randn(2), torch.randn(2), torch.randn(3)
        trees = {
            "model_output": (
                BaseModelOutputLike(last_hidden_state=h1, hidden_states=(h0, h1)),
                [h1, h0, h1],
            ),
            "late_output": (
                Seq2SeqLMOutputLike(logits=logits, past_key_values=cache),
                [logits, *cache.keys, *cache.values],
            ),
            "diffusers_output": (UNetOutputLike(sample=h0), [h0]),
        }
        for name, (tree, expected_leaves) in trees.items():
            with self.subTest(tree=name):
                leaves, spec = pytree.tree_flatten(tree)
                self.assertEqual(len(leaves), len(expected_leaves))
                for leaf, expected in zip(leaves, expected_leaves):
                    self.assertIs(leaf, expected)
                rebuilt = pytree.tree_unflatten(leaves, spec)
                self.assertIs(type(rebuilt), type(tree))
                self.assertEqual(list(rebuilt.keys()), list(tree.keys()))
                self.assertEqual(pytree.tree_structure(rebuilt), spec)
                mapped = pytree.tree_map(lambda t: t + 1, tree)
                self.assertIs(type(mapped), type(tree))
                self.assertEqual(pytree.tree_leaves(mapped)[0], leaves[0] + 1)
        rebuilt = pytree.tree_unflatten(*pytree.tree_flatten(trees["late_output"][0]))
        self.assertIsNone(rebuilt.loss)
        self.assertIs(type(rebuilt.past_key_values), SlidingWindowCacheLike)
        self.assertIs(rebuilt.past_key_values.keys[1], cache.keys[1])

    def test_key_paths(self) -> None:
        # (the C++ pytree has no key paths)
        cache = DynamicCacheLike(keys=[torch.ones(1)] * 2, values=[torch.ones(1)] * 2)
        out = Seq2SeqLMOutputLike(logits=torch.ones(1), past_key_values=cache)
        paths = [py_pytree.keystr(p) for p, _ in py_pytree.tree_leaves_with_path(out)]
        self.assertEqual(
            paths,
            [
                "['logits']",
                "['past_key_values'].keys[0]",
                "['past_key_values'].keys[1]",
                "['past_key_values'].values[0]",
                "['past_key_values'].values[1]",
            ],
        )

    def test_treespec_serialization(self) -> None:
        cache = DynamicCacheLike(keys=[torch.ones(1)], values=[torch.ones(1)])
        out = CausalLMOutputLike(logits=torch.ones(1), past_key_values=cache)
        spec = py_pytree.tree_structure(out)
        dumped = py_pytree.treespec_dumps(spec)
        self.assertEqual(py_pytree.treespec_loads(dumped), spec)
        # serialized with the concrete classes' names
        self.assertExpectedInline(
            _format_serialized(json.loads(dumped)[1]).replace(f"{STAND_INS}.", ""),
            """\
CausalLMOutputLike ["logits", "past_key_values"]
  *
  DynamicCacheLike [["keys", "values"], []]
    builtins.list null
      *
    builtins.list null
      *""",
        )

    @parametrize_strict
    def test_unregistered_classes_stay_leaves(self, strict: bool) -> None:
        # Classes outside the families behave as they did before: the same stand-in
        # shapes, not registered, are leaves, and export refuses them.
        @dataclasses.dataclass
        class UnregisteredOutput(OrderedDict):
            logits: torch.Tensor | None = None

            def __post_init__(self) -> None:
                if self.logits is not None:
                    self["logits"] = self.logits

        @dataclasses.dataclass
        class UnregisteredCache:
            keys: list[torch.Tensor] = dataclasses.field(default_factory=list)

        for obj in (UnregisteredOutput(logits=torch.ones(1)), UnregisteredCache()):
            for pytree in pytree_modules.values():
                self.assertEqual(pytree.tree_leaves(obj), [obj])
        self.assertFalse(issubclass(UnregisteredOutput, ModelOutputLike))
        self.assertFalse(issubclass(UnregisteredCache, CacheLike))

        class Returns(torch.nn.Module):
            def __init__(self, make: Any) -> None:
                super().__init__()
                self.make = make

            def forward(self, x: torch.Tensor) -> Any:
                return self.make(x)

        # what stock PyTorch says, and for a dataclass or a mapping (not for
        # other classes) how to register it with its family
        message = (
            "Encountered unrecognized type"
            if strict
            else r"not a known type\. .* with torch\.utils\._pytree\.register_pytree_family"
        )
        for make in (
            lambda x: UnregisteredOutput(logits=x + 1),
            lambda x: UnregisteredCache(keys=[x + 1]),
        ):
            with self.assertRaisesRegex(Exception, message):
                torch.export.export(Returns(make), (torch.ones(2),), strict=strict)
        if not strict:
            with self.assertRaisesRegex(Exception, "not a known type") as cm:
                torch.export.export(Returns(lambda x: Exception(x)), (torch.ones(2),))
            self.assertNotIn("register_pytree_family", str(cm.exception))


# Functions of (pytree module, tree) that call one entry point each; compiled
# with fullgraph=True they must trace one graph and agree with eager.
def _flatten_add_one_unflatten(pytree: Any, tree: Any) -> Any:
    leaves, spec = pytree.tree_flatten(tree)
    return pytree.tree_unflatten([v + 1 for v in leaves], spec)


_ENTRY_POINT_FNS: dict[str, Any] = {
    "tree_flatten": _flatten_add_one_unflatten,
    "tree_leaves": lambda m, t: [v * 2 for v in m.tree_leaves(t)],
    "tree_iter": lambda m, t: [v * 2 for v in m.tree_iter(t)],
    "tree_structure": lambda m, t: m.tree_unflatten(
        [v - 1 for v in m.tree_leaves(t)], m.tree_structure(t)
    ),
    "tree_map": lambda m, t: m.tree_map(lambda v: v + 1, t),
    "tree_map_": lambda m, t: m.tree_map_(lambda v: v.add_(1), t),
    "tree_map_only": lambda m, t: m.tree_map_only(torch.Tensor, lambda v: v * 3, t),
    "tree_all": lambda m, t: m.tree_all(lambda v: v.dim() == 1, t),
    "tree_any": lambda m, t: m.tree_any(lambda v: v.shape[0] == 2, t),
    "tree_is_leaf": lambda m, t: (m.tree_is_leaf(t), m.tree_is_leaf(torch.ones(1))),
}


class TestCompilePytreeFamily(TestCase):
    """Dynamo meets a family member before eager code has flattened one (a
    member created since the last boundary is a leaf, as on stock)."""

    def setUp(self) -> None:
        super().setUp()
        torch._dynamo.reset()
        py_pytree._update_pytree_families()

    @skipIfTorchDynamo("compiles its own function: a compiled test would inline it")
    def test_compile_fullgraph_never_flattened_before(self) -> None:
        @dataclasses.dataclass
        class FreshOutput(ModelOutputLike):
            a: Any = None
            b: Any = None

        py_pytree._update_pytree_families()  # registered as an export would

        def fn(out: FreshOutput) -> FreshOutput:
            mapped = py_pytree.tree_map(lambda t: t * 2, out)
            return FreshOutput(a=mapped.a + 1)

        counter = CompileCounter()
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        x = torch.randn(3)
        result = compiled(FreshOutput(a=x))
        self.assertEqual(counter.frame_count, 1)
        self.assertIs(type(result), FreshOutput)
        self.assertEqual(list(result.keys()), ["a"])
        self.assertEqual(result.a, x * 2 + 1)

    @skipIfTorchDynamo("compiles its own function: a compiled test would inline it")
    def test_compile_refuses_what_eager_refuses(self) -> None:
        # After a first call, the graph is not reused for a member that holds
        # more than its fields: the check reads what the guards watch.
        def fn(out: Any) -> Any:
            return py_pytree.tree_map(lambda t: t * 2, out)

        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        first = DynamicCacheLike(keys=[torch.ones(2)], values=[torch.ones(2)])
        self.assertEqual(compiled(first).keys[0], torch.ones(2) * 2)
        extra = DynamicCacheLike(keys=[torch.ones(2)], values=[torch.ones(2)])
        extra.note = "set by hand"
        for call in (fn, compiled):
            with self.assertRaisesRegex(
                Exception, "its attribute 'note' is not a field"
            ):
                call(extra)

    @skipIfTorchDynamo("compiles its own function: a compiled test would inline it")
    def test_compile_mapping_state(self) -> None:
        # A graph cannot carry a mapping's other attributes: None ones are left
        # to its constructor, any other value is refused, as no graph may drop it.
        def fn(batch: BatchLike) -> BatchLike:
            return py_pytree.tree_map(lambda t: t + 1, batch)

        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        batch = BatchLike({"ids": torch.ones(2)})
        batch.encodings = None
        self.assertEqual(compiled(batch)["ids"], torch.ones(2) * 2)
        batch.encodings = ["kept in eager"]
        self.assertEqual(fn(batch).encodings, ["kept in eager"])
        with self.assertRaisesRegex(
            Exception,
            "its attribute 'encodings' is state a compiled graph cannot carry",
        ):
            compiled(batch)

    @skipIfTorchDynamo("compiles its own function: a compiled test would inline it")
    @parametrize_pytree
    @parametrize("entry_point", list(_ENTRY_POINT_FNS))
    @parametrize("kind", ["plain", "member", "new_member"])
    def test_compile_fullgraph_entry_points(
        self, pytree: Any, entry_point: str, kind: str
    ) -> None:
        # Stock traces every entry point of both pytrees into one graph; with
        # families registered it still does, whether or not the input holds one
        # of their members (`new_member`: a class never flattened before).
        @dataclasses.dataclass
        class NewOutput(ModelOutputLike):
            a: Any = None
            b: Any = None

        py_pytree._update_pytree_families()  # registered as an export would

        def make_tree() -> Any:
            x, y = torch.arange(3.0), torch.ones(2)
            if kind == "plain":
                return {"a": [x, (y,)], "b": x}
            if kind == "member":
                return [BaseModelOutputLike(last_hidden_state=x, hidden_states=(y,)), x]
            return [NewOutput(a=x, b=(y, x)), y]

        fn = functools.partial(_ENTRY_POINT_FNS[entry_point], pytree)
        expected = fn(make_tree())
        counter = CompileCounter()
        actual = torch.compile(fn, backend=counter, fullgraph=True)(make_tree())
        self.assertEqual(actual, expected)
        self.assertEqual(type(actual), type(expected))
        self.assertLessEqual(counter.frame_count, 1)

    @unittest.skipIf("cxx" not in pytree_modules, "missing optree package")
    def test_compile_fullgraph_cxx_in_fresh_process(self) -> None:
        # In a fresh process the families are registered (by importing the
        # stand-ins) but no member was ever seen, by optree or by Dynamo.
        result, _ = _run_python(
            """
            import importlib, json, sys
            import torch
            import torch.utils._cxx_pytree as cxx_pytree

            stand_ins = importlib.import_module(sys.argv[1])

            def fn(x):
                leaves, spec = cxx_pytree.tree_flatten({"a": [x, (x,)], "b": x})
                out = cxx_pytree.tree_unflatten([v + 1 for v in leaves], spec)
                return cxx_pytree.tree_map(lambda v: v * 2, out)

            def gn(o):
                return cxx_pytree.tree_map(lambda v: v + 1, o)

            x = torch.arange(3.0)
            compiled = torch.compile(fn, fullgraph=True, backend="eager")
            torch.testing.assert_close(compiled(x), fn(x))
            o = stand_ins.BaseModelOutputLike(last_hidden_state=x, hidden_states=(x, x))
            r = torch.compile(gn, fullgraph=True, backend="eager")(o)
            print(json.dumps({
                "type": type(r).__qualname__,
                "keys": list(r.keys()),
                "hidden_states": [t.tolist() for t in r.hidden_states],
            }))
            """,
            STAND_INS,
        )
        self.assertEqual(
            result,
            {
                "type": "BaseModelOutputLike",
                "keys": ["last_hidden_state", "hidden_states"],
                "hidden_states": [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]],
            },
        )


def _subprocess_env() -> dict[str, str]:
    env = os.environ.copy()
    # the child imports the same torch and stand-ins module as this process
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _run_python(code: str, *argv: str) -> tuple[Any, str]:
    # in an empty directory: with -c, the working directory is on sys.path
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *argv],
            check=False,
            capture_output=True,
            text=True,
            env=_subprocess_env(),
            cwd=cwd,
            timeout=300,
        )
    if proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    # the last line of stdout is the JSON result
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


_LOAD = """
import importlib, json, os, sys
import torch
import torch.utils._pytree as pytree

tmp, module_name, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
before_load = sorted(m for m in sys.modules if "stand_ins" in m)
# registers the families
importlib.import_module(module_name)
result = {}
for case in cases:
    ep = torch.export.load(os.path.join(tmp, f"{case}.pt2"))
    args = pytree.tree_unflatten(
        torch.load(os.path.join(tmp, f"{case}.in")), ep.call_spec.in_spec
    )[0]
    out = ep.module()(*args)
    leaves, spec = pytree.tree_flatten(out)
    torch.save(leaves, os.path.join(tmp, f"{case}.out"))
    result[case] = {
        "type": f"{type(out).__module__}.{type(out).__qualname__}",
        "keys": list(out.keys()),
        "spec": pytree.treespec_dumps(spec),
    }
print(json.dumps({"before_load": before_load, "cases": result}))
"""

_LOAD_UNREGISTERED = """
import json, sys
import torch

try:
    torch.export.load(sys.argv[1])
except Exception as e:
    result = {"loaded": False, "error": f"{type(e).__name__}: {e}"}
else:
    result = {"loaded": True, "error": ""}
print(json.dumps(result))
"""


instantiate_parametrized_tests(TestExportPytreeFamily)
instantiate_parametrized_tests(TestCompilePytreeFamily)


if __name__ == "__main__":
    run_tests()
