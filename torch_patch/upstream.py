"""Commit messages for the commits that `torch-patch export` adds on top of the library series.

``{test_plan}`` is replaced by one command per added file (generated, so it is always current).
"""

TESTS_COMMIT_MESSAGE = """\
Add tests for pytree families (register_pytree_family)

Add the tests for `register_pytree_family` in torch.utils._pytree and
torch.utils._cxx_pytree: a registered base class makes the class and all of
its present and future subclasses pytree nodes (mapping, dataclass and custom
flatten/unflatten kinds), exact `register_pytree_node` registrations always
win, lazy "module:Class" registrations resolve on import, key paths and
treespec (de)serialization name the concrete subclass, and types that were
not opted in behave exactly as before. The tests are parametrized over the
python and the C++ pytree implementations, and include integration tests
with transformers ModelOutput (tiny randomly initialised models, no
downloads) that are skipped when transformers is not installed.

Test Plan:

{test_plan}
"""

BENCHMARKS_COMMIT_MESSAGE = """\
Add pytree family benchmarks

Add microbenchmarks that compare tree_flatten / tree_unflatten / tree_map on
family-registered types (dict subclasses, dataclasses, transformers
ModelOutput) against exact registrations and against stock builtin
containers, to show that the family lookup adds no cost to the existing
fast paths and little cost to the new ones.

Test Plan:

{test_plan}
"""
