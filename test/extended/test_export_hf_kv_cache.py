# Owner(s): ["oncall: export"]
"""Exported decode steps that take the KV cache they returned, for transformers.

The built-in lazy pytree families for ``transformers.cache_utils:Cache`` and the
cache layer bases (see ``torch/utils/_pytree_hf.py``) keep per-step state
(tensors, also in dicts and lists, and ints such as the counters of sliding-window
layers) in the leaves and settings in the context, so the spec of a cache is the
same after every decoding step. Each test builds a tiny random model from a config (nothing is
downloaded), exports one decode step (``input_ids`` of length 1 plus the cache, with a
dynamic cache length), runs several steps feeding back the returned cache and compares
with eager.

The whole model outputs of GPT-2 and T5 with ``use_cache=True`` (a ModelOutput
carrying the cache) go through torch.export, torch._dynamo.export and torch.compile,
and the cache classes round-trip through the pytree functions on their own.

Runs with whatever transformers is installed: with transformers 5.x for the cache
classes, with transformers 4.31.0 for the tuple caches (``past_key_values``).
Without transformers every test skips; ``test_export_pytree_family.py`` runs a
decode loop with a stand-in cache class.
"""

import copy
import importlib.util
import inspect
import os
import tempfile
import unittest
import warnings

import torch
import torch.utils._pytree as py_pytree
from torch.export import AdditionalInputs, Dim
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    TestCase,
)


try:
    from .test_export_hf_model_output import (
        check_import_and_build_emit_no_warnings,
        check_model_output_preserved,
        check_save_load_fresh_process,
        MODES,
        run_python,
    )
except ImportError:
    from test_export_hf_model_output import (
        check_import_and_build_emit_no_warnings,
        check_model_output_preserved,
        check_save_load_fresh_process,
        MODES,
        run_python,
    )

try:
    import torch.utils._cxx_pytree as cxx_pytree
except ImportError:
    cxx_pytree = None

try:
    import transformers

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

HAS_ONNXRUNTIME = all(
    importlib.util.find_spec(name) is not None
    for name in ("onnx", "onnxscript", "onnxruntime")
)

if HAS_TRANSFORMERS:
    # transformers >= 4.56: caches made of layer objects (DynamicSlidingWindowLayer,
    # StaticSlidingWindowLayer, ...); transformers 4.31.0 has no cache_utils at all.
    HAS_CACHE_LAYERS = importlib.util.find_spec("transformers.cache_utils") is not None
    if HAS_CACHE_LAYERS:
        from transformers import cache_utils

        HAS_CACHE_LAYERS = hasattr(cache_utils, "DynamicSlidingWindowLayer")
    HAS_TUPLE_CACHE = not importlib.util.find_spec("transformers.cache_utils")
else:
    HAS_CACHE_LAYERS = HAS_TUPLE_CACHE = False
# transformers.cache_utils exists (not in transformers 4.31.0)
HAS_CACHE_UTILS = HAS_TRANSFORMERS and not HAS_TUPLE_CACHE

# every test class needs transformers; the module still imports without it
requires_transformers = unittest.skipIf(
    not HAS_TRANSFORMERS, "transformers is not installed"
)

pytree_params = [subtest(py_pytree, name="py")]
if cxx_pytree is not None:
    pytree_params.append(subtest(cxx_pytree, name="cxx"))

VOCAB = 99
PREFILL = 6  # longer than the sliding window: sliding layers are full when decoding
SLIDING_WINDOW = 4
STEPS = 4
ATOL = 1e-5


def _cache_kwarg(model):
    # transformers 5.x calls it "cache"; earlier versions "past_key_values"
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class _DecoderStep(torch.nn.Module):
    """One decoding step of a decoder-only model: ``(input_ids, cache)`` in and out."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.cache_kwarg = _cache_kwarg(model)

    def forward(self, input_ids, cache):
        out = self.model(
            input_ids=input_ids, use_cache=True, **{self.cache_kwarg: cache}
        )
        return out.logits, out[self.cache_kwarg]


class _Seq2SeqStep(torch.nn.Module):
    """One decoding step of an encoder-decoder model, given the encoder's output."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.cache_kwarg = _cache_kwarg(model)

    def forward(self, decoder_input_ids, encoder_hidden_states, cache):
        out = self.model(
            encoder_outputs=(encoder_hidden_states,),
            decoder_input_ids=decoder_input_ids,
            use_cache=True,
            **{self.cache_kwarg: cache},
        )
        return out.logits, out[self.cache_kwarg]


def _decoder_config(name):
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 37}
    attention = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    if name == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, bos_token_id=0
        )
    if name == "mistral":
        return transformers.MistralConfig(
            num_hidden_layers=2, sliding_window=SLIDING_WINDOW, **common, **attention
        )
    if name == "gemma2":
        # hybrid: a sliding-window layer and a full-attention layer
        return transformers.Gemma2Config(
            num_hidden_layers=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **common,
            **attention,
        )
    if name == "mamba":
        # LinearAttentionLayer: conv_states and recurrent_states are dicts
        return transformers.MambaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            time_step_rank=8,
        )
    if name == "minimax":
        # MiniMaxCache: the linear-attention states in a list, linear_cache,
        # here [[], tensor] (an empty list for the full-attention layer)
        return transformers.MiniMaxConfig(
            num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"],
            num_local_experts=2,
            block_size=4,
            **common | {"intermediate_size": 32},  # grouped_mm: 16-byte strides
            **attention,
        )
    raise AssertionError(name)


_DECODER_MODELS = {
    "gpt2": "GPT2LMHeadModel",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "minimax": "MiniMaxForCausalLM",
}


def _seq2seq_model(name):
    if name == "t5":
        config = transformers.T5Config(
            d_model=32,
            d_ff=37,
            num_layers=2,
            num_heads=2,
            d_kv=8,
            vocab_size=VOCAB,
            decoder_start_token_id=0,
        )
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_position_embeddings=64,
    )
    return transformers.BartForConditionalGeneration(config)


def _new_cache(kind, config):
    """The empty cache a case starts from (None: the model creates its own)."""
    if kind == "dynamic":
        return cache_utils.DynamicCache(config=config)
    if kind == "static":
        return cache_utils.StaticCache(config=config, max_cache_len=16)
    if kind in ("mtp", "dflash"):
        cls = cache_utils.MtpCache if kind == "mtp" else cache_utils.DFlashCache
        return cls(config=config)
    return None


# case -> (model, cache kind, layer classes expected in the cache)
CACHE_CASES = {
    "gpt2_dynamic": ("gpt2", "dynamic", {"DynamicLayer"}),
    "mistral_dynamic_sliding": ("mistral", "dynamic", {"DynamicSlidingWindowLayer"}),
    "gemma2_dynamic_hybrid": (
        "gemma2",
        "dynamic",
        {"DynamicSlidingWindowLayer", "DynamicLayer"},
    ),
    "gpt2_static": ("gpt2", "static", {"StaticLayer"}),
    "mistral_static_sliding": ("mistral", "static", {"StaticSlidingWindowLayer"}),
    "gemma2_static_hybrid": (
        "gemma2",
        "static",
        {"StaticSlidingWindowLayer", "StaticLayer"},
    ),
    "mistral_mtp": ("mistral", "mtp", {"DynamicSlidingWindowLayer"}),
    "gemma2_dflash": (
        "gemma2",
        "dflash",
        {"DynamicSlidingWindowLayer", "DynamicLayer"},
    ),
    # caches that keep tensors in a dict (conv_states) or a list (linear_cache)
    "mamba_linear_attention": ("mamba", "model", {"LinearAttentionLayer"}),
    "minimax_linear_cache": ("minimax", "model", {"DynamicLayer"}),
    "t5_encoder_decoder": ("t5", "encoder_decoder", {"DynamicLayer"}),
    "bart_encoder_decoder": ("bart", "encoder_decoder", {"DynamicLayer"}),
}
TUPLE_CASES = ("gpt2", "t5", "bart")
# fixed-size tensors and tensor counters: no dynamic dimension at all
FULLY_STATIC_CASES = ("gpt2_static", "mamba_linear_attention")


def _build_case(case, prompt=None):
    """Return ``(step module, example args)`` after a prompt of ``prompt`` tokens
    (default: ``PREFILL``, and 3 decoder tokens for an encoder-decoder)."""
    torch.manual_seed(0)
    model_name, kind, _ = CACHE_CASES.get(case, (case, "tuple", None))
    prefill = torch.randint(1, VOCAB, (1, prompt or PREFILL))
    if model_name in ("t5", "bart"):
        model = _seq2seq_model(model_name).eval()
        step = _Seq2SeqStep(model)
        py_pytree._update_pytree_families()  # as an export does, for the eager checks
        with torch.no_grad():
            encoder_hidden = model.get_encoder()(input_ids=prefill)[0]
            out = model(
                encoder_outputs=(encoder_hidden,),
                decoder_input_ids=torch.randint(1, VOCAB, (1, prompt or 3)),
                use_cache=True,
            )
        return step, (encoder_hidden, out[step.cache_kwarg])
    config = _decoder_config(model_name)
    model = getattr(transformers, _DECODER_MODELS[model_name])(config).eval()
    step = _DecoderStep(model)
    py_pytree._update_pytree_families()  # as an export does, for the eager checks
    cache = None if kind == "tuple" else _new_cache(kind, config)
    kwargs = {} if cache is None else {step.cache_kwarg: cache}
    with torch.no_grad():
        out = model(input_ids=prefill, use_cache=True, **kwargs)
    cache = out[step.cache_kwarg]
    if kind == "tuple":
        # transformers 4.31 GPT-2 returns strided views after prefill and contiguous
        # tensors after each step; the program guards on the strides it traced
        cache = py_pytree.tree_map(torch.Tensor.contiguous, cache)
    return step, (cache,)


def _token(generator):
    return torch.randint(1, VOCAB, (1, 1), generator=generator)


def _call(step, token, state):
    # state: (cache,) or (encoder_hidden_states, cache)
    return step(token, *state)


def _eager_steps(step, state, tokens):
    """Eager logits and caches of ``len(tokens)`` steps, feeding back the cache."""
    state = copy.deepcopy(state)
    results = []
    with torch.no_grad():
        for token in tokens:
            logits, cache = _call(step, token, state)
            state = (*state[:-1], cache)
            results.append((logits, copy.deepcopy(cache)))
    return results


def _max_diff(expected, actual):
    expected_leaves, expected_spec = py_pytree.tree_flatten(expected)
    actual_leaves, actual_spec = py_pytree.tree_flatten(actual)
    if expected_spec != actual_spec:
        raise AssertionError(f"specs differ:\n{expected_spec}\n{actual_spec}")
    diff = 0.0
    for e, a in zip(expected_leaves, actual_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            diff = max(diff, (e.double() - a.double()).abs().max().item())
        elif e != a:
            raise AssertionError(f"leaves differ: {e!r} != {a!r}")
    return diff


def _dynamic_shapes(step, state, tokens):
    """dynamic_shapes from the inputs of the next eager step (AdditionalInputs)."""
    (_, next_cache), *_ = _eager_steps(step, state, tokens[:1])
    shapes = AdditionalInputs()
    shapes.add((tokens[1], *state[:-1], next_cache))
    return shapes


def _auto_cache_shapes(state):
    """dynamic_shapes of a step: the token and the encoder's output (a tensor) fixed,
    one Dim.AUTO for the cache."""
    return (None, *[None if isinstance(s, torch.Tensor) else Dim.AUTO for s in state])


def _export(step, token, state, dynamic_shapes, strict):
    with warnings.catch_warnings():
        # tracing-time deprecation chatter from transformers / export is not tested
        warnings.simplefilter("ignore")
        return torch.export.export(
            step,
            (token, *copy.deepcopy(state)),
            dynamic_shapes=dynamic_shapes,
            strict=strict,
        )


def _run_steps(test, run, step, state, tokens):
    """Run ``run`` (an exported module) for ``tokens``; compare with eager each step."""
    expected = _eager_steps(step, state, tokens)
    state = copy.deepcopy(state)
    diffs = []
    for token, (logits, cache) in zip(tokens, expected, strict=True):
        with torch.no_grad():
            got_logits, got_cache = _call(run, token, state)
        diffs.append(_max_diff((logits, cache), (got_logits, got_cache)))
        state = (*state[:-1], got_cache)
    test.assertEqual(len(diffs), len(tokens))
    test.assertLessEqual(max(diffs), ATOL, f"max |diff| per step: {diffs}")
    return diffs


class _Forward(torch.nn.Module):
    """The whole output of ``model`` called with ``use_cache=True``."""

    def __init__(self, model, names):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *tensors):
        kwargs = dict(zip(self.names, tensors))
        return self.model(**kwargs, use_cache=True, return_dict=True)


def _model_with_cache(name):
    """``(module, args)``: GPT-2 or T5 returning a ModelOutput that holds its cache."""
    torch.manual_seed(0)
    if name == "gpt2":
        model = getattr(transformers, _DECODER_MODELS[name])(_decoder_config(name))
        return _Forward(model.eval(), ["input_ids"]), (torch.randint(0, VOCAB, (2, 7)),)
    model = _seq2seq_model(name).eval()
    args = (torch.randint(1, VOCAB, (2, 7)), torch.randint(1, VOCAB, (2, 4)))
    return _Forward(model, ["input_ids", "decoder_input_ids"]), args


OUTPUT_MODELS = ("gpt2", "t5")


def _cache_leaf_count(model_name):
    """Tensors in the cache / past_key_values of the tiny configs above (2 layers)."""
    return {"gpt2": 2 * 2, "t5": 2 * 4}[model_name]


_LOAD_AND_DECODE = """
import copy, json, os, sys
import torch, transformers

tmp, steps = sys.argv[1], {}
for case in sys.argv[2:]:
    module = torch.export.load(os.path.join(tmp, f"{case}.pt2")).module()
    tokens, state = torch.load(os.path.join(tmp, f"{case}.in.pt"), weights_only=False)
    outputs = []
    with torch.no_grad():
        for token in tokens:
            logits, cache = module(token, *state)
            state = (*state[:-1], cache)
            # static caches are updated in place: keep this step's values
            outputs.append(copy.deepcopy((logits, cache)))
    torch.save(outputs, os.path.join(tmp, f"{case}.out.pt"))
    steps[case] = len(outputs)
print(json.dumps({"steps": steps}))
"""


@requires_transformers
class TestExportHFKVCache(TestCase):
    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    def _tokens(self, n=STEPS + 1):
        generator = torch.Generator().manual_seed(1)
        return [_token(generator) for _ in range(n)]

    def _check_case(self, case, strict):
        step, state = _build_case(case)
        tokens = self._tokens()
        if case in CACHE_CASES:
            layer_classes = {type(layer).__name__ for layer in _layers(state[-1])}
            self.assertEqual(layer_classes, CACHE_CASES[case][2])
        # the spec does not change from one step to the next
        (_, cache1), (_, cache2) = _eager_steps(step, state, tokens[:2])
        spec1 = py_pytree.tree_structure(cache1)
        self.assertEqual(py_pytree.tree_structure(state[-1]), spec1)
        self.assertEqual(py_pytree.tree_structure(cache2), spec1)
        dynamic_shapes = _dynamic_shapes(step, state, tokens)
        ep = _export(step, tokens[0], state, dynamic_shapes, strict)
        # the exported program takes caches of other steps (counters, lengths)
        self.assertEqual(bool(ep.range_constraints), case not in FULLY_STATIC_CASES)
        diffs = _run_steps(self, ep.module(), step, state, tokens[1:])
        return ep, step, state, tokens, diffs

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("strict", [True, False])
    @parametrize("case", list(CACHE_CASES))
    def test_decode_step_takes_its_cache(self, case, strict):
        self._check_case(case, strict)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("strict", [True, False])
    @parametrize("case", list(CACHE_CASES))
    def test_decode_step_with_auto_cache(self, case, strict):
        # one Dim.AUTO for the whole cache: its counters and lengths vary unless
        # the model specializes them
        step, state = _build_case(case)
        tokens = self._tokens()
        ep = _export(step, tokens[0], state, _auto_cache_shapes(state), strict)
        if case not in FULLY_STATIC_CASES:
            self.assertTrue(ep.range_constraints)
        _run_steps(self, ep.module(), step, state, tokens[1:])

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("form", ["mirror", "children"])
    @parametrize("strict", [True, False])
    @parametrize("case", list(CACHE_CASES))
    def test_decode_step_with_shapes_as_users_write_them(self, case, strict, form):
        # mirror: tree_map over the cache, an object of the cache's class with a
        # spec where the cache holds a tensor or an int; children: the same specs
        # as nested lists of each registered node's children
        step, state = _build_case(case)
        tokens = self._tokens()

        def spec(leaf):
            if isinstance(leaf, torch.Tensor):
                return dict.fromkeys(range(leaf.dim()), Dim.AUTO)
            return Dim.AUTO if type(leaf) is int else None

        def children(node):
            if type(node) in (list, tuple):
                return type(node)(map(children, node))
            if type(node) is dict:
                return {key: children(value) for key, value in node.items()}
            if py_pytree.tree_is_leaf(node):
                return spec(node)
            # one level down: every child of the node is a leaf of this flatten
            return list(map(children, py_pytree.tree_leaves(node, lambda x: x is not node)))

        if form == "mirror":
            shape = py_pytree.tree_map(spec, state[-1])
            self.assertIs(type(shape), type(state[-1]))
        else:
            shape = children(state[-1])
            self.assertIs(type(shape), list)
        shapes = (None, *[None] * (len(state) - 1), shape)
        ep = _export(step, tokens[0], state, shapes, strict)
        _run_steps(self, ep.module(), step, state, tokens[1:])

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("case", list(CACHE_CASES))
    def test_decode_from_a_one_token_prompt(self, case):
        # docs/deploy.md's recipe for any prompt length: export from a 1-token
        # prompt with backed_size_oblivious, so that a size of 1 in the example
        # is not fixed. A sliding window has two regimes in the model's own code
        # (its keys grow until the window fills, then keep its length): that
        # program serves until the cache holds `window` tokens, then one exported
        # from a full window takes over. 15 steps, to 16 tokens (max_cache_len).
        step, state = _build_case(case, prompt=1)
        tokens = self._tokens(15)
        expected = _eager_steps(step, state, tokens)
        sliding = any("Sliding" in name for name in CACHE_CASES[case][2])
        window = step.model.config.sliding_window if sliding else None

        def export(state):
            shapes = _auto_cache_shapes(state)
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                return _export(step, tokens[0], state, shapes, strict=False).module()

        warm = export(state)
        # the eager cache after window - 1 steps holds `window` tokens
        full = export((*state[:-1], expected[window - 2][1])) if window else None
        state, used = copy.deepcopy(state), []
        for token, (logits, cache) in zip(tokens, expected, strict=True):
            n = int(state[-1].get_seq_length()) if window else 0
            run = full if window and n >= window else warm
            used.append(run is full)
            with torch.no_grad():
                got_logits, got_cache = _call(run, token, state)
            self.assertLessEqual(_max_diff((logits, cache), (got_logits, got_cache)), ATOL)
            state = (*state[:-1], got_cache)
        self.assertEqual(used, [window is not None and i + 1 >= window for i in range(15)])

    @unittest.skipIf(not HAS_TUPLE_CACHE, "needs transformers without cache_utils")
    @parametrize("strict", [True, False])
    @parametrize("case", TUPLE_CASES)
    def test_decode_step_takes_its_tuple_cache(self, case, strict):
        _, _, state, _, _ = self._check_case(case, strict)
        self.assertIs(type(state[-1]), tuple)

    def test_save_load_fresh_process(self):
        # every case, saved here and loaded in one fresh process that only ran
        # `import torch, transformers`
        cases = list(CACHE_CASES) if HAS_CACHE_LAYERS else list(TUPLE_CASES)
        expected = {}
        with tempfile.TemporaryDirectory() as tmp:
            for case in cases:
                step, state = _build_case(case)
                tokens = self._tokens()
                shapes = _dynamic_shapes(step, state, tokens)
                ep = _export(step, tokens[0], state, shapes, strict=False)
                torch.export.save(ep, os.path.join(tmp, f"{case}.pt2"))
                torch.save((tokens[1:], state), os.path.join(tmp, f"{case}.in.pt"))
                expected[case] = _eager_steps(step, state, tokens[1:])
            result = run_python(_LOAD_AND_DECODE, tmp, *cases)
            self.assertEqual(result["steps"], dict.fromkeys(cases, STEPS))
            for case in cases:
                outputs = torch.load(
                    os.path.join(tmp, f"{case}.out.pt"), weights_only=False
                )
                for want, got in zip(expected[case], outputs, strict=True):
                    with self.subTest(case=case):
                        self.assertLessEqual(_max_diff(want, got), ATOL)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    def test_nested_dynamic_shapes(self):
        # the nested form of the module docstring, for a full and a sliding layer
        step, state = _build_case("gemma2_dynamic_hybrid")
        tokens = self._tokens()
        length = Dim("length", min=2, max=64)
        # the children of each layer: keys, values, then sliding_window,
        # cumulative_length and _sliding_window_tensor for the sliding one
        sliding = [None, None, None, Dim.DYNAMIC, None]
        full = [{2: length}, {2: length}]
        dynamic_shapes = {"input_ids": None, "cache": [[sliding, full]]}
        for strict in (True, False):
            with self.subTest(strict=strict):
                ep = _export(step, tokens[0], state, dynamic_shapes, strict)
                _run_steps(self, ep.module(), step, state, tokens[1:])

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    def test_unmarked_counter_is_a_constant(self):
        # a counter left out of dynamic_shapes is specialized: the program says so
        step, state = _build_case("mistral_dynamic_sliding")
        tokens = self._tokens(2)
        ep = _export(step, tokens[0], state, None, strict=False)
        _, cache = ep.module()(tokens[0], *copy.deepcopy(state))
        # the guard names the counter and the fix
        with self.assertRaisesRegex(
            AssertionError,
            r"Guard failed: cache\.layers\[0\]\.cumulative_length == 6 "
            r"\(.*dynamic_shapes, e\.g\. Dim\.AUTO",
        ):
            ep.module()(tokens[1], cache)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("case", ["gpt2_dynamic", "gpt2_static", "gemma2_static_hybrid"])
    def test_shapes_of_keys_and_values(self, case):
        # one shape per key and value, layer by layer, as onnx-diagnostic's
        # make_dynamic_shapes_kv_cache gives them; the rest of the cache Dim.AUTO
        _, (cache,) = _build_case(case)

        class Keys(torch.nn.Module):
            def forward(self, cache):
                return [layer.keys * 2 + layer.values for layer in cache.layers]

        shapes = [{2: Dim.DYNAMIC}] * (2 * len(cache.layers))
        ep = _export(Keys(), cache, (), (shapes,), strict=False)
        longer = py_pytree.tree_map(
            lambda x: torch.cat([x, x], 2) if isinstance(x, torch.Tensor) and x.dim() == 4 else x,
            cache,
        )
        self.assertEqual(ep.module()(longer), Keys()(longer))
        with self.assertRaisesRegex(ValueError, "Node arity mismatch"):  # not 2 per layer
            _export(Keys(), cache, (), (shapes[1:],), strict=False)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    def test_a_window_that_fills_is_named_a_branch(self):
        # exported with Dim.AUTO before the window is full: the guard that fails
        # later gives the values, and names the model's branch, not Dim.AUTO
        step, state = _build_case("mistral_dynamic_sliding", prompt=2)
        module = _export(
            step, self._tokens(1)[0], state, _auto_cache_shapes(state), strict=False
        ).module()
        cache = state[-1]
        with self.assertRaises(AssertionError) as cm:
            for token in self._tokens(2 * SLIDING_WINDOW):
                _, cache = module(token, *state[:-1], cache)
        message = str(cm.exception)
        self.assertRegex(
            message,
            r"^Guard failed: .*\n"
            r"  cache\.layers\[0\]\.\w+.*: \d+ in this call(, \d+| and) at export\n",
        )
        self.assertIn("\nThe model's code required this of its inputs at export", message)
        self.assertNotIn("Dim.AUTO", message)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("helper", ["executorch", "exporters"])
    def test_dynamic_shapes_after_transformers_helper(self, helper):
        # transformers' own helpers register cache classes exactly, which wins over
        # the family; ShapesCollection (after executorch's helper) and
        # AdditionalInputs (after the exporters' one) follow whichever is used.
        # In a subprocess: the registrations are global and cannot be undone.
        result = run_python(
            _AFTER_HELPER,
            helper,
            os.path.dirname(os.path.abspath(__file__)),
        )
        self.assertEqual(result["before"], result["after"])
        self.assertTrue(result["registered_exactly"])
        self.assertEqual(result["steps"], [STEPS, STEPS])  # before and after
        self.assertLessEqual(max(result["diffs"]), ATOL)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @unittest.skipIf(not HAS_ONNXRUNTIME, "onnx, onnxscript or onnxruntime missing")
    @parametrize(
        "case", ["mistral_dynamic_sliding", "mamba_linear_attention", "minimax_linear_cache"]
    )
    def test_onnx_decode(self, case):
        # a sliding window (its counter is an input), mamba (states in dicts) and
        # a mixture of experts (MiniMax), decoded in onnxruntime step by step
        import numpy as np
        import onnxruntime

        step, state = _build_case(case)
        if CACHE_CASES[case][0] == "minimax":
            # transformers' default experts call its custom op grouped_mm_fallback,
            # which has no ONNX function: docs/deploy.md's recipe for MoE models
            step.model.set_experts_implementation("batched_mm")
        tokens = self._tokens()
        dynamic_shapes = _dynamic_shapes(step, state, tokens)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "step.onnx")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    step,
                    (tokens[0], *copy.deepcopy(state)),
                    path,
                    dynamo=True,
                    dynamic_shapes=dynamic_shapes.dynamic_shapes(
                        step, (tokens[0], *state)
                    ),
                )
            session = onnxruntime.InferenceSession(
                path, providers=["CPUExecutionProvider"]
            )
        from torch.onnx._internal.exporter._pytree_io_names import _component

        # by name: the leaves of the cache that are constants of the program
        # (its sliding_window) are neither inputs nor outputs of the graph
        names = [i.name for i in session.get_inputs()]
        output_names = [o.name for o in session.get_outputs()]
        cache_leaves, cache_spec = py_pytree.tree_flatten(state[-1])
        paths = [".".join(map(_component, path)) for path, _ in
                 py_pytree.tree_flatten_with_path(state[-1])[0]]
        self.assertEqual(names, ["input_ids", *(f"cache.{p}" for p in paths
                                                if f"cache.{p}" in names)])
        if case == "mistral_dynamic_sliding":
            self.assertIn("cache.layers.0.cumulative_length", names)
        expected = _eager_steps(step, state, tokens[1:])
        diffs = []
        for token, (logits, cache) in zip(tokens[1:], expected, strict=True):
            feed = {"input_ids": token}
            feed |= {f"cache.{p}": v for p, v in zip(paths, cache_leaves)}
            results = session.run(
                None, {n: np.asarray(feed[n]) for n in names}
            )
            outputs = dict(zip(output_names, results, strict=True))
            cache_leaves = [
                leaf if (o := outputs.get(f"output.1.{p}")) is None
                else torch.from_numpy(o) if isinstance(leaf, torch.Tensor) else int(o)
                for p, leaf in zip(paths, cache_leaves, strict=True)
            ]
            got_cache = py_pytree.tree_unflatten(cache_leaves, cache_spec)
            got = (torch.from_numpy(outputs["output.0"]), got_cache)
            diffs.append(_max_diff((logits, cache), got))
        self.assertEqual(len(diffs), STEPS)
        self.assertLessEqual(max(diffs), ATOL, diffs)


@requires_transformers
class TestExportHFModelOutputWithCache(TestCase):
    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    @parametrize("model_name", OUTPUT_MODELS)
    @parametrize("mode", list(MODES))
    def test_model_output_preserved(self, model_name, mode):
        mod, args = _model_with_cache(model_name)
        expected = check_model_output_preserved(self, mod, args, mode)
        # the cache (tuples of tensors in 4.31, a Cache object in 5.x) is
        # flattened into its tensors too
        tensor_fields = len(expected) - 1
        self.assertEqual(
            py_pytree.tree_flatten(expected)[1].num_leaves,
            tensor_fields + _cache_leaf_count(model_name),
        )

    @parametrize("model_name", OUTPUT_MODELS)
    def test_save_load_fresh_process(self, model_name):
        check_save_load_fresh_process(self, *_model_with_cache(model_name))

    @parametrize("import_order", ["torch_first", "transformers_first"])
    def test_import_and_build_emit_no_warnings(self, import_order):
        check_import_and_build_emit_no_warnings(self, import_order, use_cache=True)


@requires_transformers
@unittest.skipIf(
    not HAS_CACHE_UTILS,
    "transformers 4.31.0 has no transformers.cache_utils (tuple past_key_values)",
)
class TestHFCacheFamily(TestCase):
    def test_an_exporter_replaces_the_registrations(self):
        # what onnx-diagnostic does on entering torch_export_patches: remove
        # transformers' registrations (a lazy family's and transformers' own),
        # check that they are gone, and register its own
        result = run_python(_REPLACE_REGISTRATIONS)
        self.assertEqual(result["registered_after_removal"], [False, False])
        self.assertEqual(result["leaves"], {"py": [4, 1], "cxx": [4, 1]})

    def _gpt2_cache(self):
        mod, (input_ids,) = _model_with_cache("gpt2")
        with torch.no_grad():
            out = mod(input_ids)
        self._cache_key = list(out.keys())[1]
        return mod, input_ids, out[self._cache_key]

    @parametrize("pytree", pytree_params)
    def test_dynamic_cache_round_trip(self, pytree):
        from transformers.cache_utils import DynamicCache

        mod, input_ids, cache = self._gpt2_cache()
        self.assertIsInstance(cache, DynamicCache)
        leaves, spec = pytree.tree_flatten(cache)
        expected = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        # the leaves are exactly the cached tensors, not copies (their order is
        # the handler's choice)
        self.assertEqual(sorted(map(id, leaves)), sorted(map(id, expected)))
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), DynamicCache)
        self.assertEqual(pytree.tree_flatten(rebuilt)[1], spec)
        self.assertEqual(rebuilt.get_seq_length(), cache.get_seq_length())
        # the rebuilt cache keeps working for the next decoding step ("cache" in
        # 5.x, "past_key_values" before)
        cache_kwarg = self._cache_key
        step = input_ids[:, :1]
        with torch.no_grad():
            a = mod.model(
                step,
                **{cache_kwarg: pytree.tree_unflatten(leaves, spec)},
                use_cache=True,
            ).logits
            b = mod.model(step, **{cache_kwarg: cache}, use_cache=True).logits
        self.assertEqual(a, b)

    @parametrize("pytree", pytree_params)
    def test_encoder_decoder_cache_round_trip(self, pytree):
        from transformers.cache_utils import EncoderDecoderCache

        mod, args = _model_with_cache("t5")
        with torch.no_grad():
            out = mod(*args)
        cache = out[list(out.keys())[1]]
        self.assertIsInstance(cache, EncoderDecoderCache)
        leaves, spec = pytree.tree_flatten(cache)
        self.assertEqual(len(leaves), _cache_leaf_count("t5"))
        self.assertTrue(all(isinstance(t, torch.Tensor) for t in leaves))
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), EncoderDecoderCache)
        self.assertIs(
            type(rebuilt.self_attention_cache), type(cache.self_attention_cache)
        )
        self.assertIs(
            type(rebuilt.cross_attention_cache), type(cache.cross_attention_cache)
        )
        self.assertEqual(rebuilt.is_updated, cache.is_updated)
        self.assertEqual(rebuilt.get_seq_length(), cache.get_seq_length())
        self.assertEqual(
            py_pytree.treespec_loads(
                py_pytree.treespec_dumps(py_pytree.tree_flatten(cache)[1])
            ),
            py_pytree.tree_flatten(cache)[1],
        )

    @parametrize("strict", [True, False])
    def test_export_with_cache_input(self, strict):
        # the cache as an export *input*: flattened into placeholders, rebuilt
        # inside the traced forward
        mod, input_ids, cache = self._gpt2_cache()
        cache_kwarg = self._cache_key

        class Step(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, cache):
                return self.model(input_ids, **{cache_kwarg: cache}, use_cache=True)

        step = input_ids[:, :1]
        with torch.no_grad():
            expected = Step(mod.model)(step, copy.deepcopy(cache))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ep = torch.export.export(
                    Step(mod.model), (step, copy.deepcopy(cache)), strict=strict
                )
            actual = ep.module()(step, copy.deepcopy(cache))
        # one placeholder per cache tensor, named after the key path
        self.assertEqual(
            len(ep.graph_signature.user_inputs), 1 + _cache_leaf_count("gpt2")
        )
        self.assertEqual(actual[cache_kwarg].get_seq_length(), input_ids.shape[1] + 1)
        self.assertEqual(type(actual), type(expected))
        expected_leaves, expected_spec = py_pytree.tree_flatten(expected)
        actual_leaves, actual_spec = py_pytree.tree_flatten(actual)
        self.assertEqual(actual_spec, expected_spec)
        for a, e in zip(actual_leaves, expected_leaves, strict=True):
            self.assertEqual(a, e, atol=1e-5, rtol=1e-5)

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("pytree", pytree_params)
    @parametrize(
        "case,path",
        [
            ("mamba_linear_attention", ".layers[0].conv_states[0]"),
            ("minimax_linear_cache", ".linear_cache[1]"),
        ],
    )
    def test_cache_with_tensor_containers_round_trip(self, pytree, case, path):
        # stock torch and the earlier family functions raised "pytree cannot
        # flatten" for a dict or list of tensors; the decode loops are in
        # TestExportHFKVCache
        _, (cache,) = _build_case(case)
        paths = [py_pytree.keystr(p) for p, _ in py_pytree.tree_leaves_with_path(cache)]
        self.assertIn(path, paths)
        leaves, spec = pytree.tree_flatten(cache)
        self.assertEqual(len(leaves), len(paths))
        self.assertTrue(all(isinstance(t, (torch.Tensor, int)) for t in leaves))
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), type(cache))
        self.assertEqual(pytree.tree_structure(rebuilt), spec)
        self.assertEqual(rebuilt.get_seq_length(), cache.get_seq_length())
        py_spec = py_pytree.tree_structure(cache)
        self.assertEqual(
            py_pytree.treespec_loads(py_pytree.treespec_dumps(py_spec)), py_spec
        )

    @unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
    @parametrize("pytree", pytree_params)
    def test_offloaded_cache_keeps_its_stream(self, pytree):
        # tree_map over an offloaded cache returns one with its stream and flags
        # (the stream is state the spec carries, not a leaf)
        from transformers.cache_utils import DynamicCache, DynamicLayer

        # the state DynamicCache(offloading=True) sets, with a CPU stream: the
        # default one needs a GPU on CUDA builds of torch
        cache = DynamicCache()
        cache.offloading, cache.only_non_sliding = True, False
        cache.prefetch_stream = torch.Stream(device="cpu")
        layer = DynamicLayer()
        layer.keys, layer.values = torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
        cache.layers = [layer]
        mapped = pytree.tree_map(
            lambda x: x * 2 if isinstance(x, torch.Tensor) else x, cache
        )
        self.assertIs(mapped.prefetch_stream, cache.prefetch_stream)
        self.assertTrue(mapped.offloading)
        self.assertEqual(mapped.layers[0].keys, torch.full((1, 2, 3, 4), 2.0))

    def test_static_cache_round_trip(self):
        from transformers.cache_utils import StaticCache

        mod, input_ids, _ = self._gpt2_cache()
        cache = StaticCache(config=mod.model.config, max_cache_len=16)
        with torch.no_grad():
            mod.model(input_ids, **{self._cache_key: cache}, use_cache=True)
        leaves, spec = py_pytree.tree_flatten(cache)
        # tensors, and the ints of each layer (max_cache_len, ...)
        self.assertTrue(all(isinstance(t, (torch.Tensor, int)) for t in leaves))
        self.assertEqual(sum(isinstance(t, torch.Tensor) for t in leaves), 6)
        rebuilt = py_pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), StaticCache)
        self.assertEqual(int(rebuilt.get_seq_length()), input_ids.shape[1])
        self.assertEqual(rebuilt.get_max_length(), 16)
        for new, old in zip(rebuilt.layers, cache.layers):
            self.assertIs(new.keys, old.keys)
            self.assertIs(new.values, old.values)


_REPLACE_REGISTRATIONS = """
import json
import torch, transformers
import torch.utils._cxx_pytree as cxx_pytree
import torch.utils._pytree as pytree
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutput

functions = {
    DynamicCache: (
        lambda c: ([[l.keys for l in c.layers], [l.values for l in c.layers]], None),
        lambda v, _: DynamicCache(list(zip(*v))),
    ),
    BaseModelOutput: (
        lambda o: ([o.last_hidden_state], None),
        lambda v, _: BaseModelOutput(last_hidden_state=v[0]),
    ),
}
removed = []
for cls, (flatten, unflatten) in functions.items():
    if cls in pytree.SUPPORTED_NODES:  # on stock torch, DynamicCache is not
        pytree._deregister_pytree_node(cls)
        try:  # torch 2.15's _deregister_pytree_node does it too
            cxx_pytree.optree.unregister_pytree_node(cls, namespace="torch")
        except ValueError:
            pass
    removed.append(cls in pytree.SUPPORTED_NODES)
    pytree.register_pytree_node(cls, flatten, unflatten)
cache = DynamicCache()
for i in range(2):
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), i)
output = BaseModelOutput(last_hidden_state=torch.ones(2))
leaves = {
    name: [len(module.tree_leaves(cache)), len(module.tree_leaves(output))]
    for name, module in (("py", pytree), ("cxx", cxx_pytree))
}
print(json.dumps({"registered_after_removal": removed, "leaves": leaves}))
"""


@requires_transformers
@unittest.skipIf(not HAS_CACHE_LAYERS, "needs transformers >= 4.56 cache layers")
class TestHFCacheSpecLoading(TestCase):
    def test_round_trip(self):
        step, (cache,) = _build_case("gemma2_dynamic_hybrid")
        spec = py_pytree.tree_structure(cache)
        # (the cxx treespec_loads rebuilds a spec from a tree of 0 leaves, which a
        # cache flattens differently: only the refusal below is tested for it)
        loaded = py_pytree.treespec_loads(py_pytree.treespec_dumps(spec))
        self.assertEqual(loaded, spec)
        rebuilt = py_pytree.tree_unflatten(py_pytree.tree_leaves(cache), loaded)
        self.assertEqual(py_pytree.tree_structure(rebuilt), spec)
        self.assertEqual(rebuilt.get_seq_length(), cache.get_seq_length())

    def test_crafted_context_is_refused(self):
        # In a fresh process, so that what a crafted spec could import is not
        # imported yet (torch._inductor, the BERT modeling module).
        result = run_python(_CRAFTED_SPECS)
        self.assertTrue(result["pytrees"])
        self.assertEqual(len(result["cases"]), 4 * len(result["pytrees"]))
        for case in result["cases"]:
            with self.subTest(case=case["name"], pytree=case["pytree"]):
                if case["name"] == "layer class":  # a node type, not a context
                    self.assertEqual(case["error"], "NotImplementedError")
                    self.assertIn("PreTrainedConfig", case["message"])
                else:
                    self.assertEqual(case["error"], "ValueError", case["message"])
                    self.assertIn("context", case["message"])
                self.assertEqual(case["imported"], [])


_CRAFTED_SPECS = """
import json, sys
import torch, transformers
import torch.utils._pytree as py_pytree
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

pytrees = [py_pytree]
try:
    import torch.utils._cxx_pytree as cxx_pytree
    pytrees.append(cxx_pytree)
except ImportError:
    pass

py_pytree._update_pytree_families()  # as an export or a load does
layer = DynamicSlidingWindowLayer(sliding_window=4)
layer.update(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))
cache = DynamicCache()
cache.layers = [layer]
dumped = json.loads(py_pytree.treespec_dumps(py_pytree.tree_structure(cache)))
assert dumped[1]["type"].endswith("DynamicCache"), dumped


def craft(edit):
    spec = json.loads(json.dumps(dumped))
    edit(spec[1], spec[1]["children_spec"][0]["children_spec"][0])  # cache, layer
    return json.dumps(spec)


def edit_context(node, name, value):
    context = json.loads(node["context"])
    entry = [e for e in context if e[0] == name][0]
    entry[1] = value
    node["context"] = json.dumps(context)


def layer_class(cache, layer):
    # a layer node of a class that is no cache layer
    layer["type"] = "transformers.configuration_utils.PreTrainedConfig"


def layer_value(value):
    return lambda cache, layer: edit_context(layer, "is_initialized", value)


def cache_value(cache, layer):
    bert = "transformers.models.bert.modeling_bert.BertModel"
    edit_context(cache, "layer_class_to_replicate", {"class": bert})


crafted = {
    "layer class": craft(layer_class),
    "dtype": craft(layer_value({"dtype": "_inductor"})),
    "class value": craft(cache_value),
    "enum": craft(layer_value({"__enum__": True, "fqn": "torch._inductor:X"})),
}
cases = []
for pytree in pytrees:
    for name, serialized in crafted.items():
        before = set(sys.modules)
        try:
            pytree.treespec_loads(serialized)
        except Exception as e:
            error, message = type(e).__name__, str(e)
        else:
            error, message = None, ""
        cases.append({
            "name": name,
            "pytree": pytree.__name__,
            "error": error,
            "message": message,
            "imported": sorted(set(sys.modules) - before),
        })
print(json.dumps({"pytrees": [p.__name__ for p in pytrees], "cases": cases}))
"""


_AFTER_HELPER = """
import copy, json, sys, warnings
sys.path.insert(0, sys.argv[2])
import torch
import torch.utils._pytree as pytree
from torch.export import Dim, ShapesCollection
import test_export_hf_kv_cache as t

warnings.simplefilter("ignore")


def gpt2_shapes(step, state, tokens):
    # ShapesCollection: by tensor, whatever the flattening
    shapes = ShapesCollection()
    length = Dim("length", min=2, max=64)
    for layer in state[-1].layers:
        shapes[layer.keys] = {2: length}
        shapes[layer.values] = {2: length}
    # resolved against these inputs: _export passes copies of them
    return shapes.dynamic_shapes(step, (tokens[0], *state))


def run_all():
    steps, diffs, specs = [], [], []
    recipe = gpt2_shapes if sys.argv[1] == "executorch" else t._dynamic_shapes
    for case, make_shapes in [("gpt2_dynamic", recipe)]:
        for strict in (False,):
            step, state = t._build_case(case)
            tokens = [torch.randint(1, t.VOCAB, (1, 1)) for _ in range(t.STEPS + 1)]
            ep = t._export(step, tokens[0], state, make_shapes(step, state, tokens),
                           strict)
            expected = t._eager_steps(step, state, tokens[1:])
            run_state = copy.deepcopy(state)
            for token, want in zip(tokens[1:], expected):
                logits, cache = ep.module()(token, *run_state)
                run_state = (cache,)
                diffs.append(t._max_diff(want, (logits, cache)))
            steps.append(len(expected))
            specs.append(len(pytree.tree_leaves(state[-1])))
    return steps, diffs, specs


steps, diffs, before = run_all()
from transformers.cache_utils import DynamicCache
if sys.argv[1] == "executorch":
    from transformers.integrations.executorch import (
        register_dynamic_cache_export_support,
    )

    register_dynamic_cache_export_support()
else:
    from transformers.exporters.exporter_dynamo import register_pytree_node

    register_pytree_node(DynamicCache)
node = pytree.SUPPORTED_NODES[DynamicCache]
registered_exactly = node.flatten_fn.__module__.startswith("transformers")
torch._dynamo.reset()
steps2, diffs2, after = run_all()
print(json.dumps({"steps": steps + steps2, "diffs": diffs + diffs2,
                  "before": before, "after": after,
                  "registered_exactly": registered_exactly}))
"""


def _layers(cache):
    if hasattr(cache, "self_attention_cache"):
        return _layers(cache.self_attention_cache) + _layers(
            cache.cross_attention_cache
        )
    return list(cache.layers)


instantiate_parametrized_tests(TestExportHFKVCache)
instantiate_parametrized_tests(TestHFCacheSpecLoading)
instantiate_parametrized_tests(TestExportHFModelOutputWithCache)
instantiate_parametrized_tests(TestHFCacheFamily)

if __name__ == "__main__":
    run_tests()
