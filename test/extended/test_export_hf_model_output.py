# Owner(s): ["oncall: export"]
"""Real HuggingFace transformers models through export and compile.

Tiny, random-weight models go through torch.export, torch._dynamo.export and
torch.compile, relying on the built-in lazy pytree family for
``transformers.utils.generic:ModelOutput``. The models run without a KV cache:
outputs that carry one (``transformers.cache_utils:Cache``, a family of its own)
are tested in ``test_export_hf_kv_cache.py``.

Runs against whatever transformers is installed; CI runs it with transformers
4.31.0 (no pytree self-registration) and with the latest 5.x (ModelOutput
subclasses register themselves). Models are built from configs, nothing is
downloaded. Without transformers every test skips;
``test_export_pytree_family.py`` covers the same paths with stand-in classes.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings

import torch
import torch.utils._pytree as py_pytree
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    TestCase,
)


try:
    import torch.utils._cxx_pytree as cxx_pytree
except ImportError:
    cxx_pytree = None

try:
    import transformers
    from transformers.utils import ModelOutput

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

# ModelOutput subclasses registering themselves in __init_subclass__ (absent in
# transformers 4.31.0)
HAS_SELF_REGISTRATION = HAS_TRANSFORMERS and hasattr(
    transformers.utils.generic, "_model_output_flatten"
)

# transformers 5.x: MoE experts call torch.ops.transformers.grouped_mm_fallback
# (found by file: in 4.31, transformers.integrations is a module, not a package)
HAS_MOE_INTEGRATION = HAS_TRANSFORMERS and os.path.isfile(
    os.path.join(os.path.dirname(transformers.__file__), "integrations", "moe.py")
)

# every test class needs transformers; the module still imports without it
requires_transformers = unittest.skipIf(
    not HAS_TRANSFORMERS, "transformers is not installed"
)

pytree_params = [subtest(py_pytree, name="py")]
if cxx_pytree is not None:
    pytree_params.append(subtest(cxx_pytree, name="cxx"))

VOCAB = 99


def _subprocess_env():
    env = os.environ.copy()
    # the child must import the same torch (PYTHONPATH may point at a patched
    # tree) and must stay offline
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    return env


def run_python(code, *argv, timeout=300):
    """Run ``code`` in a fresh Python process; its last line of stdout, as JSON."""
    # in an empty directory: with -c, the working directory is on sys.path, and
    # stray modules in the shared temporary directory must not shadow anything
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code), *argv],
            check=False,
            capture_output=True,
            text=True,
            env=_subprocess_env(),
            cwd=cwd,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    # the last line of stdout is the JSON result
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_import_and_build_emit_no_warnings(
    test: TestCase, import_order: str, use_cache: bool
) -> None:
    """Import torch and transformers in ``import_order`` in a fresh process, build
    and run a tiny BERT and GPT-2 (``use_cache``), flatten their outputs after a
    boundary: no warning, no log record of level WARNING or above, only tensor
    leaves."""
    first, second = (
        ("torch", "transformers")
        if import_order == "torch_first"
        else ("transformers", "torch")
    )
    result = run_python(
        f"""
        import json, logging, warnings

        records = []

        class Collect(logging.Handler):
            def emit(self, record):
                records.append(f"{{record.name}}: {{record.getMessage()}}")

        logging.getLogger().addHandler(Collect(level=logging.WARNING))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import {first}
            import {second}
            import torch.utils._pytree as pytree
            from transformers import (
                BertConfig, BertModel, GPT2Config, GPT2LMHeadModel
            )

            torch.manual_seed(0)
            bert = BertModel(BertConfig(
                vocab_size=99, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=37,
            )).eval()
            gpt2 = GPT2LMHeadModel(GPT2Config(
                n_layer=2, n_embd=32, n_head=2, vocab_size=99,
                bos_token_id=98, eos_token_id=98,
            )).eval()
            ids = torch.randint(1, 99, (2, 5))
            with torch.no_grad():
                outs = [bert(ids), gpt2(ids, use_cache={use_cache!r})]
            pytree._update_pytree_families()  # as an export does
            leaves = [pytree.tree_flatten(o)[0] for o in outs]
        print(json.dumps({{
            "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught],
            "logs": records,
            "leaf_types": sorted({{type(x).__name__ for ls in leaves for x in ls}}),
        }}))
        """
    )
    test.assertEqual(result["warnings"], [])
    test.assertEqual(result["logs"], [])
    test.assertEqual(result["leaf_types"], ["Tensor"])


class _Call(torch.nn.Module):
    """Calls ``model`` with the positional tensors as ``names``, plus constants."""

    def __init__(self, model, names, **constant_kwargs):
        super().__init__()
        self.model = model
        self.names = names
        self.constant_kwargs = constant_kwargs

    def forward(self, *tensors):
        kwargs = dict(zip(self.names, tensors))
        return self.model(**kwargs, **self.constant_kwargs)


def _bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        pad_token_id=0,
    )
    model = transformers.BertModel(config).eval()
    input_ids = torch.randint(1, VOCAB, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, 5:] = 0
    return _Call(model, ["input_ids", "attention_mask"], return_dict=True), (
        input_ids,
        attention_mask,
    )


def _gpt2():
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    input_ids = torch.randint(0, VOCAB, (2, 7))
    return _Call(model, ["input_ids"], use_cache=False, return_dict=True), (input_ids,)


def _t5():
    config = transformers.T5Config(
        d_model=32,
        d_ff=37,
        num_layers=2,
        num_heads=2,
        vocab_size=VOCAB,
        d_kv=8,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    input_ids = torch.randint(1, VOCAB, (2, 7))
    decoder_input_ids = torch.randint(1, VOCAB, (2, 4))
    return (
        _Call(
            model, ["input_ids", "decoder_input_ids"], use_cache=False, return_dict=True
        ),
        (input_ids, decoder_input_ids),
    )


MODELS = {"bert": _bert, "gpt2": _gpt2, "t5": _t5}


def _build(name):
    torch.manual_seed(0)
    return MODELS[name]()


def _run_export_strict(mod, args):
    return torch.export.export(mod, args, strict=True).module()(*args)


def _run_export_nonstrict(mod, args):
    return torch.export.export(mod, args, strict=False).module()(*args)


def _run_dynamo_export(mod, args):
    graph_module, _guards = torch._dynamo.export(mod)(*args)
    return graph_module(*args)


def _run_compile(mod, args):
    return torch.compile(mod, fullgraph=True, backend="eager")(*args)


MODES = {
    "export_strict": _run_export_strict,
    "export_nonstrict": _run_export_nonstrict,
    "dynamo_export": _run_dynamo_export,
    "compile": _run_compile,
}


def _type_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def assert_same_model_output(test: TestCase, expected, actual) -> None:
    """``actual`` is a ModelOutput of ``expected``'s class, with the same keys,
    the same spec and the same tensor leaves (nested caches flattened too)."""
    test.assertIsInstance(expected, ModelOutput)
    assert_same_mapping_output(test, expected, actual)


def assert_same_mapping_output(test: TestCase, expected, actual) -> None:
    """``actual`` is of ``expected``'s class (a mapping), with the same keys, the
    same spec and the same tensor leaves."""
    test.assertIs(type(actual), type(expected))
    test.assertEqual(list(actual.keys()), list(expected.keys()))
    expected_leaves, expected_spec = py_pytree.tree_flatten(expected)
    actual_leaves, actual_spec = py_pytree.tree_flatten(actual)
    for leaf in expected_leaves + actual_leaves:
        test.assertIsInstance(leaf, torch.Tensor)
    test.assertEqual(actual_spec, expected_spec)
    test.assertEqual(len(actual_leaves), len(expected_leaves))
    for a, e in zip(actual_leaves, expected_leaves):
        test.assertEqual(a, e, atol=1e-5, rtol=1e-5)


def check_model_output_preserved(test: TestCase, mod, args, mode: str):
    """``mod(*args)`` through ``MODES[mode]`` returns what eager does; returns
    the eager output."""
    with torch.no_grad():
        expected = mod(*args)
        with warnings.catch_warnings():
            # tracing-time deprecation chatter from transformers / export is
            # not what is tested here
            warnings.simplefilter("ignore")
            actual = MODES[mode](mod, args)
    assert_same_model_output(test, expected, actual)
    return expected


def check_save_load_fresh_process(test: TestCase, mod, args) -> None:
    """A program exported from ``mod`` and saved loads and runs in a fresh
    process that only imported torch and transformers, and returns the same
    ModelOutput class, keys, spec and values."""
    with torch.no_grad():
        expected = mod(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(mod, args, strict=False)
    expected_leaves, expected_spec = py_pytree.tree_flatten(expected)
    with tempfile.TemporaryDirectory() as tmp:
        ep_path = os.path.join(tmp, "model.pt2")
        args_path = os.path.join(tmp, "args.pt")
        leaves_path = os.path.join(tmp, "leaves.pt")
        torch.export.save(ep, ep_path)
        torch.save(args, args_path)
        result = run_python(
            """
            import json, sys
            import torch, transformers

            assert "transformers.modeling_outputs" not in sys.modules
            ep = torch.export.load(sys.argv[1])
            out = ep.module()(*torch.load(sys.argv[2]))

            import torch.utils._pytree as pytree
            leaves, spec = pytree.tree_flatten(out)
            torch.save(leaves, sys.argv[3])
            print(json.dumps({
                "type": f"{type(out).__module__}.{type(out).__qualname__}",
                "keys": list(out.keys()),
                "spec": pytree.treespec_dumps(spec),
            }))
            """,
            ep_path,
            args_path,
            leaves_path,
        )
        leaves = torch.load(leaves_path)
    test.assertEqual(result["type"], _type_name(type(expected)))
    test.assertEqual(result["keys"], list(expected.keys()))
    test.assertEqual(py_pytree.treespec_loads(result["spec"]), expected_spec)
    test.assertEqual(len(leaves), len(expected_leaves))
    for a, e in zip(leaves, expected_leaves):
        test.assertEqual(a, e, atol=1e-5, rtol=1e-5)


# Tiny mixture-of-experts models: (config class, model class, config arguments
# over _MOE_COMMON). Exported, transformers 5.x runs their experts through the
# custom op torch.ops.transformers.grouped_mm_fallback, which
# transformers.integrations.moe registers when a modeling module imports it.
# Eager on CPU runs torch's grouped_mm, which needs strides of 16 bytes: expert
# sizes are multiples of 4.
_MOE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=36,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_MOE_MODELS = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
        ),
    ),
}


def check_moe_load_fresh_process(test: TestCase, name: str) -> None:
    """A tiny MoE model ``name`` exported with ``use_cache=False`` and saved: in a
    fresh process that only imported torch and transformers, loading imports
    nothing and fails with an error that names the module to import; after that
    one import it loads and returns eager's logits. Skips when the program calls
    no op of transformers."""
    config_cls, model_cls, kwargs = _MOE_MODELS[name]
    if not hasattr(transformers, model_cls):
        test.skipTest(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**_MOE_COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).eval()
    input_ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model(input_ids, use_cache=False)
        ep = torch.export.export(model, (input_ids,), {"use_cache": False})
    ops = {
        str(n.target)
        for n in ep.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("transformers.")
    }
    if not ops:
        test.skipTest(f"{model_cls} calls no op of transformers in this version")
    op = sorted(ops)[0]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f) for f in ("model.pt2", "ids.pt", "logits.pt")]
        torch.export.save(ep, paths[0])
        torch.save(input_ids, paths[1])
        result = run_python(
            """
            import importlib, json, re, sys
            import torch, transformers

            def imported():
                return sorted(m for m in sys.modules if ".moe" in m or "modeling_" in m)

            before = imported()
            read = []  # the source files of transformers that the failed load opens
            package = transformers.__file__.rpartition("/")[0]
            sys.addaudithook(
                lambda event, args: event == "open"
                and str(args[0]).startswith(package)
                and str(args[0]).endswith(".py")
                and read.append(args[0])
            )
            try:
                torch.export.load(sys.argv[1])
            except RuntimeError as e:
                error = str(e)
            after_error, sources_read = imported(), len(read)
            module = re.search(r"import ([\w.]+) before loading", error)[1]
            importlib.import_module(module)
            ep = torch.export.load(sys.argv[1])
            out = ep.module()(torch.load(sys.argv[2]), use_cache=False)
            torch.save(out.logits, sys.argv[3])
            print(json.dumps({
                "before": before,
                "after_error": after_error,
                "sources_read": sources_read,
                "error": error,
                "module": module,
                "type": f"{type(out).__module__}.{type(out).__qualname__}",
            }))
            """,
            *paths,
        )
        logits = torch.load(paths[2])
    test.assertEqual(result["before"], [])
    test.assertEqual(result["after_error"], [])  # the load imported nothing
    test.assertEqual(result["sources_read"], 0)  # nor read transformers' sources
    test.assertIn(
        f"torch.ops.{op} is not registered: import transformers.integrations.moe "
        "before loading (the program calls the custom op from there).",
        result["error"],
    )
    test.assertEqual(result["module"], "transformers.integrations.moe")
    test.assertEqual(result["type"], _type_name(type(expected)))
    test.assertEqual(logits, expected.logits, atol=1e-5, rtol=1e-5)


class _EncodingToFeature(torch.nn.Module):
    """Takes a tokenizer's ``BatchEncoding``, returns a processor's ``BatchFeature``."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        # imported here, as a model's module imports its output classes: a class
        # first imported while export traces is not registered by that export
        self.output_class = transformers.BatchFeature

    def forward(self, batch):
        h = self.embed(batch.input_ids) * batch["attention_mask"].unsqueeze(-1)
        return self.output_class({"hidden": h, "pooled": (h.mean(1),)})


class _CallWithBatch(torch.nn.Module):
    """Calls ``model(**batch)``: the ``BatchEncoding`` is the exported input."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model(**batch)


def _batch_encoding(seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (2, 7), generator=g)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, 5:] = 0
    return transformers.BatchEncoding(
        {"input_ids": input_ids, "attention_mask": attention_mask}
    )


def _batch_modules():
    torch.manual_seed(0)
    bert, _ = _bert()
    return {
        "encoding_to_feature": _EncodingToFeature().eval(),
        "bert": _CallWithBatch(bert.model),
    }


_LOAD_BATCH = """
import json, sys
import torch, transformers
import torch.utils._pytree as pytree

# transformers imports these lazily: loading the program must import them
lazy = (
    "transformers.tokenization_utils_base",
    "transformers.feature_extraction_utils",
    "transformers.modeling_outputs",
)
imported_before_load = [m for m in lazy if m in sys.modules]
results = []
for path in sys.argv[2:]:
    ep = torch.export.load(path)
    args, kwargs = pytree.tree_unflatten(torch.load(sys.argv[1]), ep.call_spec.in_spec)
    out = ep.module()(*args, **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    torch.save(leaves, path + ".out")
    results.append({
        "input": f"{type(args[0]).__module__}.{type(args[0]).__qualname__}",
        "type": f"{type(out).__module__}.{type(out).__qualname__}",
        "keys": list(out.keys()),
        "spec": pytree.treespec_dumps(spec),
    })
print(json.dumps({"imported_before_load": imported_before_load, "results": results}))
"""


@requires_transformers
class TestExportHFModelOutput(TestCase):
    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    @parametrize("model_name", list(MODELS))
    @parametrize("mode", list(MODES))
    def test_model_output_preserved(self, model_name, mode):
        mod, args = _build(model_name)
        expected = check_model_output_preserved(self, mod, args, mode)
        # without a cache, every field that is set is one tensor
        self.assertEqual(py_pytree.tree_flatten(expected)[1].num_leaves, len(expected))

    @parametrize("model_name", list(MODELS))
    def test_save_load_fresh_process(self, model_name):
        check_save_load_fresh_process(self, *_build(model_name))

    @unittest.skipIf(
        not HAS_MOE_INTEGRATION, "transformers has no transformers.integrations.moe"
    )
    def test_moe_custom_op_load_fresh_process(self):
        # the op of the experts is registered by transformers.integrations.moe,
        # which the modeling module imports: the load error names it
        for name in _MOE_MODELS:
            with self.subTest(model=name):
                check_moe_load_fresh_process(self, name)

    @parametrize(
        "strict", [subtest(True, name="strict"), subtest(False, name="nonstrict")]
    )
    @parametrize("module_name", ["encoding_to_feature", "bert"])
    def test_batch_encoding_input(self, module_name, strict):
        mod = _batch_modules()[module_name]
        batch = _batch_encoding()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(mod, (batch,), strict=strict)
            in_spec = ep.call_spec.in_spec.child(0).child(0)
            self.assertIs(in_spec.type, transformers.BatchEncoding)
            # the keys are its structure; its other attributes are state
            self.assertEqual(in_spec.context, ["input_ids", "attention_mask"])
            for b in (batch, _batch_encoding(seed=1)):
                assert_same_mapping_output(self, mod(b), ep.module()(b))
        if module_name == "encoding_to_feature":
            self.assertIs(ep.call_spec.out_spec.type, transformers.BatchFeature)

    def test_fast_tokenizer_output_as_input(self):
        # A program exported with one output of a fast tokenizer takes another
        # with the same keys (the encodings are state, not structure), saves,
        # and loads in a fresh process, whose example input has no encodings.
        test_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, test_dir)
        self.addCleanup(sys.path.remove, test_dir)
        from test_pytree_hf import fast_tokenizer

        tokenizer = fast_tokenizer()
        first = tokenizer(["hello world", "world"], padding=True, return_tensors="pt")
        other = tokenizer(["world hello", "hello"], padding=True, return_tensors="pt")
        mod = _batch_modules()["encoding_to_feature"]
        for strict in (True, False):
            with self.subTest(strict=strict), tempfile.TemporaryDirectory() as tmp:
                with torch.no_grad():
                    ep = torch.export.export(mod, (first,), strict=strict)
                assert_same_mapping_output(self, mod(other), ep.module()(other))
                paths = [os.path.join(tmp, f) for f in ("step.pt2", "in.pt", "out.pt")]
                torch.export.save(ep, paths[0])
                torch.save(dict(other), paths[1])
                result = run_python(
                    """
                    import json, sys
                    import torch, transformers
                    ep = torch.export.load(sys.argv[1])
                    (example,), _ = ep.example_inputs
                    batch = transformers.BatchEncoding(torch.load(sys.argv[2]))
                    torch.save(ep.module()(batch)["hidden"], sys.argv[3])
                    print(json.dumps([type(example).__name__, example.encodings]))
                    """,
                    *paths,
                )
                self.assertEqual(result, ["BatchEncoding", None])
                self.assertEqual(torch.load(paths[2]), mod(other)["hidden"])

    def test_batch_encoding_save_load_fresh_process(self):
        from transformers.modeling_outputs import (
            BaseModelOutputWithPoolingAndCrossAttentions,
        )

        # exported strict and non-strict, loaded in a process that imported only
        # torch and transformers
        batch = _batch_encoding()
        expected, paths = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for name, mod in _batch_modules().items():
                for strict in (True, False):
                    with torch.no_grad(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        ep = torch.export.export(mod, (batch,), strict=strict)
                        expected.append(mod(batch))
                    paths.append(os.path.join(tmp, f"{name}_{strict}.pt2"))
                    torch.export.save(ep, paths[-1])
            inputs_path = os.path.join(tmp, "inputs.pt")
            torch.save(py_pytree.tree_leaves(((batch,), {})), inputs_path)
            result = run_python(_LOAD_BATCH, inputs_path, *paths)
            self.assertEqual(result["imported_before_load"], [])
            self.assertEqual(len(result["results"]), len(paths))
            for path, want, got in zip(paths, expected, result["results"]):
                with self.subTest(program=os.path.basename(path)):
                    encoding = _type_name(transformers.BatchEncoding)
                    self.assertEqual(got["input"], encoding)
                    self.assertEqual(got["type"], _type_name(type(want)))
                    self.assertEqual(got["keys"], list(want.keys()))
                    spec = py_pytree.treespec_loads(got["spec"])
                    leaves = torch.load(path + ".out")
                    actual = py_pytree.tree_unflatten(leaves, spec)
                    assert_same_mapping_output(self, want, actual)
        self.assertEqual(
            [r["type"] for r in result["results"]][::2],
            [
                _type_name(transformers.BatchFeature),
                _type_name(BaseModelOutputWithPoolingAndCrossAttentions),
            ],
        )

    @parametrize("pytree", pytree_params)
    def test_model_output_round_trip(self, pytree):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        hidden = torch.randn(2, 3)
        past = ((torch.randn(1), torch.randn(1)),)
        out = BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past)
        # None fields are not keys; the tuple past_key_values is flattened through
        leaves, spec = pytree.tree_flatten(out)
        self.assertEqual(len(leaves), 3)
        self.assertIs(leaves[0], hidden)
        self.assertIs(spec.type, BaseModelOutputWithPast)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), BaseModelOutputWithPast)
        self.assertEqual(list(rebuilt.keys()), list(out.keys()))
        self.assertIsNone(rebuilt.attentions)
        doubled = pytree.tree_map(lambda t: t * 2, out)
        self.assertIs(type(doubled), BaseModelOutputWithPast)
        self.assertEqual(doubled.last_hidden_state, hidden * 2)

    @unittest.skipIf(cxx_pytree is None, "missing optree package")
    def test_compile_cxx_tree_map_in_fresh_process(self):
        # A fresh process: transformers is imported and a boundary registered
        # its ModelOutput family, but no output was flattened before Dynamo
        # meets one in a cxx_pytree call.
        result = run_python(
            """
            import json
            import torch
            import torch.utils._cxx_pytree as cxx_pytree
            import transformers.modeling_outputs as mo

            torch.utils._pytree._update_pytree_families()  # as an export would

            def fn(o):
                return cxx_pytree.tree_map(lambda v: v + 1, o)

            x = torch.arange(3.0)
            o = mo.BaseModelOutput(last_hidden_state=x, hidden_states=(x, x))
            r = torch.compile(fn, fullgraph=True, backend="eager")(o)
            print(json.dumps({
                "type": type(r).__name__,
                "keys": list(r.keys()),
                "hidden_states": [t.tolist() for t in r.hidden_states],
            }))
            """
        )
        self.assertEqual(
            result,
            {
                "type": "BaseModelOutput",
                "keys": ["last_hidden_state", "hidden_states"],
                "hidden_states": [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]],
            },
        )

    @parametrize("pytree", pytree_params)
    def test_user_model_output_subclass(self, pytree):
        # defined after transformers (and torch) were imported and after the
        # family was registered
        @dataclasses.dataclass
        class MyOutput(ModelOutput):
            logits: torch.Tensor | None = None
            loss: torch.Tensor | None = None
            extra: tuple | None = None

        py_pytree._update_pytree_families()  # 4.31 does not register it: a boundary
        logits, e0, e1 = torch.randn(2, 4), torch.randn(1), torch.randn(2)
        out = MyOutput(logits=logits, extra=(e0, e1))
        leaves, spec = pytree.tree_flatten(out)
        self.assertEqual(len(leaves), 3)
        for got, want in zip(leaves, [logits, e0, e1]):
            self.assertIs(got, want)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        self.assertIs(type(rebuilt), MyOutput)
        self.assertEqual(list(rebuilt.keys()), ["logits", "extra"])
        self.assertIsNone(rebuilt.loss)

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x):
                y = self.lin(x)
                return MyOutput(logits=y, extra=(y.sum(), y * 2))

        head = Head()
        x = torch.randn(3, 4)
        expected = head(x)
        for strict in (True, False):
            with self.subTest(strict=strict):
                actual = torch.export.export(head, (x,), strict=strict).module()(x)
                self.assertIs(type(actual), MyOutput)
                self.assertEqual(list(actual.keys()), ["logits", "extra"])
                self.assertEqual(actual.logits, expected.logits)
                self.assertEqual(actual.extra, expected.extra)

    @unittest.skipIf(
        not HAS_SELF_REGISTRATION,
        "transformers 4.31.0 does not register ModelOutput subclasses itself",
    )
    def test_transformers_own_registration_wins(self):
        from transformers.modeling_outputs import (
            BaseModelOutputWithPoolingAndCrossAttentions,
            CausalLMOutputWithCrossAttentions,
            Seq2SeqLMOutput,
        )
        from transformers.utils import generic

        @dataclasses.dataclass
        class LateOutput(ModelOutput):
            logits: torch.Tensor | None = None

        for cls in (
            BaseModelOutputWithPoolingAndCrossAttentions,
            CausalLMOutputWithCrossAttentions,
            Seq2SeqLMOutput,
            LateOutput,
        ):
            with self.subTest(cls=cls.__name__):
                node = py_pytree.SUPPORTED_NODES[cls]
                self.assertIs(node.flatten_fn, generic._model_output_flatten)
                self.assertIs(node.unflatten_fn.func, generic._model_output_unflatten)
                self.assertIs(node.unflatten_fn.keywords["output_type"], cls)
                self.assertEqual(
                    py_pytree.SUPPORTED_SERIALIZED_TYPES[cls].serialized_type_name,
                    f"{cls.__module__}.{cls.__name__}",
                )

    def test_key_paths_name_the_fields(self):
        # transformers 4.32 to 5.13 registers its outputs without a key function:
        # their context lists the keys; 4.31 has the family's, 5.14+ its own
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        out = CausalLMOutputWithCrossAttentions(
            logits=torch.ones(1), hidden_states=(torch.ones(2),)
        )
        pairs, _ = py_pytree.tree_flatten_with_path(out)
        self.assertEqual(
            [py_pytree.keystr(path) for path, _ in pairs],
            ["['logits']", "['hidden_states'][0]"],
        )
        for path, leaf in pairs:
            self.assertIs(py_pytree.key_get(out, path), leaf)

    @parametrize("import_order", ["torch_first", "transformers_first"])
    def test_import_and_build_emit_no_warnings(self, import_order):
        check_import_and_build_emit_no_warnings(self, import_order, use_cache=False)

    def test_zero_cost_when_unused(self):
        result = run_python(
            """
            import dataclasses, importlib.util, json, sys
            from collections import OrderedDict, namedtuple
            import torch
            import torch.utils._pytree as pytree

            class MyDict(OrderedDict):
                pass

            @dataclasses.dataclass
            class Plain:
                x: torch.Tensor

            Point = namedtuple("Point", "x y")
            tree = {
                "a": [torch.ones(1), (2, None)],
                "b": MyDict(c=torch.zeros(1)),
                "p": Point(1, Plain(torch.ones(2))),
            }
            leaves, spec = pytree.tree_flatten(tree)
            pytree.tree_unflatten(leaves, spec)
            pytree.tree_map(lambda v: v, tree)
            pytree.tree_flatten_with_path(tree)
            plain_spec = pytree.tree_flatten({"a": [torch.ones(1), (2, None)]})[1]
            pytree.treespec_loads(pytree.treespec_dumps(plain_spec))
            try:
                import torch.utils._cxx_pytree as cxx_pytree
            except ImportError:
                pass
            else:
                cxx_pytree.tree_unflatten(*cxx_pytree.tree_flatten(tree))

            class M(torch.nn.Module):
                def forward(self, x):
                    return {"y": x + 1, "z": [x * 2]}

            torch.export.export(M(), (torch.ones(2),))
            print(json.dumps({
                "installed": importlib.util.find_spec("transformers") is not None,
                "leaked": sorted(
                    m for m in sys.modules
                    if m.split(".")[0] in ("transformers", "diffusers")
                ),
                "leaf_types": [type(leaf).__name__ for leaf in leaves],
            }))
            """
        )
        self.assertTrue(
            result["installed"]
        )  # the lazy hook had something it could have imported
        self.assertEqual(result["leaked"], [])
        # types that were not opted in keep their stock behaviour (OrderedDict
        # subclass, dataclass are leaves)
        self.assertEqual(
            result["leaf_types"],
            ["Tensor", "int", "NoneType", "MyDict", "int", "Plain"],
        )


@unittest.skipIf(importlib.util.find_spec("diffusers") is None, "needs diffusers")
class TestExportDiffusersOutput(TestCase):
    def test_key_paths_and_export(self):
        # diffusers >= 0.22 registers each BaseOutput without a key function
        from diffusers.models.unets.unet_2d import UNet2DOutput

        class Head(torch.nn.Module):
            def forward(self, x):
                return UNet2DOutput(sample=x * 2)

        x = torch.randn(2, 3)
        pairs, _ = py_pytree.tree_flatten_with_path(Head()(x))
        self.assertEqual([py_pytree.keystr(path) for path, _ in pairs], ["['sample']"])
        for strict in (True, False):
            with self.subTest(strict=strict):
                actual = torch.export.export(Head(), (x,), strict=strict).module()(x)
                self.assertIs(type(actual), UNet2DOutput)
                self.assertEqual(actual.sample, x * 2)


instantiate_parametrized_tests(TestExportHFModelOutput)

if __name__ == "__main__":
    run_tests()
