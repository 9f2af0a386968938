"""Commit messages for the commits that `torch-patch export` adds on top of the library series.

``{test_plan}`` is replaced by one command per added file (generated, so it is always current).
"""

TESTS_COMMIT_MESSAGE = """\
[pytree] Add tests for pytree families, HF model outputs and pytree invariants

test/test_pytree_family.py: `register_pytree_family` in torch.utils._pytree
and torch.utils._cxx_pytree, parametrized over both: resolution order (exact
registration > namedtuple rules > nearest family base > leaf), dict-subclass
and dataclass families (None fields, frozen/slots/kw_only, init=False),
custom functions, key paths, spec equality/hash, flatten_up_to, multi-tree
tree_map, serialization (loading imports at most the module a name points
to, checked with sys.modules diffs; crafted and non-string names), Python/C++
parity for subclasses defined after the registration, threads (stress with
(de)registration, two threads meeting a new member, imports during loads),
caches that keep no class alive, fullgraph torch.compile of every entry point
of both pytrees (also in a fresh process, with and without transformers),
torch.export / torch._dynamo.export with family outputs and inputs, and the
KV-cache functions on an nn.Module stand-in cache.

test/test_pytree_fast_path.py: the eager fast paths of tree_flatten,
tree_leaves and tree_is_leaf give the same leaves and TreeSpecs as their
reference implementations for every builtin node kind, see every
(de)registration at once, use a user's replacement of the list/tuple/dict
registration, keep is_leaf call counts, keep no class alive, and compiled
code does not recompile when their caches fill.

test/test_pytree_hypothesis.py: property-based tests (hypothesis) of the
flatten/unflatten invariants over generated trees of builtin containers,
namedtuples, structseqs, families and unregistered types, for both
implementations. The default profile is derandomized with no example
database (PYTORCH_PYTREE_HYPOTHESIS_PROFILE selects another).

test/export/test_export_hf_model_output.py and
test/distributed/test_ddp_model_output.py: tiny randomly initialised
transformers models (BERT, GPT-2 with use_cache=True, T5; nothing is
downloaded) exported with torch.export (strict and non-strict),
torch._dynamo.export and torch.compile keep their ModelOutput class and
caches, also after torch.export.save/load in a fresh process; DDP with
static_graph=True on a module returning a ModelOutput, and
find_unused_parameters=True on a tiny Llama whose output holds a
DynamicCache. They need transformers.

test/dynamo/test_member_descriptor.py: Dynamo traces
`member_descriptor.__set__` on objects created in the graph and on
existing ones, graph-breaks (and raises like eager) on an object of another
class, and compiles `tree_flatten` with fullgraph=True to the same leaves
and TreeSpec as eager.

test/onnx/test_onnx_hf_models.py: the same kind of tiny transformers models
(BERT, GPT-2 with and without the cache, BART, ViT, T5) exported with
torch.onnx.export(dynamo=True) run in onnxruntime like eager, a GPT-2 decode
loop feeds the cache back through onnxruntime, and the graph inputs and
outputs carry their key-path names. They need transformers, onnx, onnxscript
and onnxruntime. test/onnx/test_onnx_pytree_io_names.py is the test of the
ONNX naming commit (test/onnx/exporter/test_pytree_io_names.py).

Test Plan:

{test_plan}
"""

BENCHMARKS_COMMIT_MESSAGE = """\
[pytree] Add pytree microbenchmarks and a Dynamo compile-time benchmark

benchmarks/pytree/pytree_bench.py times the python pytree of a base revision
(loaded from its source file under an alias module), the current python
pytree and torch.utils._cxx_pytree in one process, interleaved, and prints
paired ratios: flatten, unflatten, tree_map, leaves, flatten_with_path and
treespec dumps/loads over flat lists and dicts, nested containers, HF model
outputs (exact registration vs family), deep chains and single leaves.
--check RATIO turns it into a regression gate.

--instructions counts instructions with callgrind instead (stable under
load; the client requests are in benchmarks/pytree/_callgrind.py);
--with-time records both in one run.

benchmarks/pytree/cxx_pytree_bench.py times a base revision's
torch/utils/_cxx_pytree.py (alias module, same optree registry) against the
current one: flat and nested trees with no family, with a family registered
but unused, and with transformers imported (gated by --check), and trees of
family members against exactly registered twins.

benchmarks/pytree/compile_time_bench.py compares Dynamo compile time of
pytree-heavy code between two torch builds (child processes, alternating);
with --instructions it counts each compile under callgrind instead.

Test Plan:

{test_plan}
"""
