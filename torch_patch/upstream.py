"""The messages of the commits that `torch-patch export` adds on top of the library series: the
tests and benchmarks that no commit's Test Plan names (``{test_plan}``: a command for each)."""

TESTS_COMMIT_MESSAGE = """\
[pytree] Add the pytree tests that no commit's Test Plan names

The tests of each commit of this series are in that commit. These files of
the series' tests are named by no commit's Test Plan, so they come here, on
top of the whole series.

Test Plan:

{test_plan}
"""

BENCHMARKS_COMMIT_MESSAGE = """\
[pytree] Add the pytree benchmarks that no commit's Test Plan names

The benchmarks a commit of this series is measured with are in that commit.
These are named by no commit's Test Plan, so they come here, on top of the
whole series.

Test Plan:

{test_plan}
"""
