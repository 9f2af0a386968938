"""Test matrix: `nox` runs the test sessions, `lint` and `commits` (see README.md, command 2).

Each test session installs a torch release (.ci/requirements-torch-<line>.txt: 2.13.0 unless the
session names another line) and this package with its test extras into a fresh venv
(.nox/<session>), applies the series of that release line to that venv's torch with
`torch-patch apply` (a no-op when the session is reused), then runs the whole suite.  Every
session deletes its venv when it ends, unless `-r` asks nox to reuse the venvs: a whole run then
needs about 9 GB of disk at a time instead of 21.  Arguments after `--` replace the default
`test`: `nox -s tests-latest -- test/test_pytree_family.py -x`.  `lint` runs PyTorch's lint
gates on the exported series; `commits` checks every library commit against its own Test Plan,
with only the commits before it (the work of both is done by the scripts in .ci/).
"""

import functools
import shutil
from collections.abc import Callable
from pathlib import Path

import nox


nox.options.default_venv_backend = "venv"  # never uv: it would fetch CUDA torch wheels
nox.options.sessions = [
    "tests-latest", "tests-2.15", "tests-2.14", "tests-hf431", "tests-hf446", "tests-ci-pins",
    "tests-deploy", "lint", "commits",
]
nox.options.error_on_missing_interpreters = True

# The venvs of a whole run take about 21 GB (6 GB for each CUDA build of torch 2.14.1 and
# 2.15.0); a CI machine may have less.  Without -r/--reuse-existing-virtualenvs the next run
# recreates every venv anyway, so a session deletes its own once it ends, pass or fail: a run
# then needs about 9 GB at a time (8.8 GB measured, while torch 2.15.0 installs).  With -r the
# venvs stay, to be reused.
_GB = 1024**3
_Run = Callable[[nox.Session], None]


def _session(name: str, *, needs_gb: float = 3.0) -> Callable[[_Run], _Run]:
    """`nox.session(name=name)`, plus a check of the free disk first and freeing the venv after."""

    def decorate(run: _Run) -> _Run:
        @functools.wraps(run)
        def wrapper(session: nox.Session) -> None:
            venv = Path(session.virtualenv.location)
            free = shutil.disk_usage(venv.parent).free / _GB
            session.log(f"{free:.1f} GB free on the disk of {venv.parent}")
            installed = any(venv.glob("lib/python*/site-packages/torch/__init__.py"))
            try:
                if free < needs_gb and not installed:
                    session.error(
                        f"{name} needs about {needs_gb:.0f} GB free for its venv, and "
                        f"{venv.parent} has {free:.1f} GB: free some space there (the venvs "
                        "kept by an earlier `nox -r` are in that directory)"
                    )
                run(session)
            finally:
                if not session.virtualenv.reuse_existing:
                    session.log(f"removing {venv} (pass -r to keep it for the next run)")
                    shutil.rmtree(venv, ignore_errors=True)

        return nox.session(name=name)(wrapper)

    return decorate


# pytest-xdist workers, one per core of the 2-core CI machine: the suite takes 0.57x.
_WORKERS = 2


def _run_suite(
    session: nox.Session,
    *extra_requirements: str,
    hypothesis_profile: str,
    default_tests: tuple[str, ...] = ("test",),
    extras: str = "test",
    line: str = "2.13",
    workers: int = _WORKERS,
) -> dict[str, str]:
    # torch is pinned: the package allows every supported line, and pip would take the newest
    session.install(
        "-r", f".ci/requirements-torch-{line}.txt", "-e", f".[{extras}]", "pytest-xdist",
        *extra_requirements,
    )
    session.run("torch-patch", "apply")
    session.run("torch-patch", "status")
    env = {
        # test/extended/test_pytree_hypothesis.py: see the profiles in its docstring
        "PYTORCH_PYTREE_HYPOTHESIS_PROFILE": hypothesis_profile,
        # keep hypothesis' cache out of the work tree
        "HYPOTHESIS_STORAGE_DIRECTORY": session.create_tmp(),
    }
    parallel = ("-n", str(workers)) if workers > 1 else ()
    tests = session.posargs or default_tests
    session.run("python", "-m", "pytest", "-q", *parallel, *tests, env=env)
    return env


@_session("tests-latest")
def tests_latest(session: nox.Session) -> None:
    """Latest transformers and diffusers (and numpy 2); the full CI hypothesis profile
    (26,400 examples)."""
    _run_suite(session, "diffusers", hypothesis_profile="pytree-ci")


@_session("tests-hf431")
def tests_hf431(session: nox.Session) -> None:
    """transformers 4.31.0, the oldest supported release (needs numpy<2 and its tokenizers)."""
    _run_suite(
        session, "transformers==4.31.0", "numpy<2", "tokenizers==0.13.3",
        hypothesis_profile="pytree-quick",
    )


@_session("tests-hf446")
def tests_hf446(session: nox.Session) -> None:
    """transformers 4.46.3, where Cache is a torch.nn.Module (4.36 to 4.5x).

    Only the suites that cover that: the cache functions, DDP with a cache in the
    output, the family and fast-path tests. The export tests are written for the
    current cache API.
    """
    _run_suite(
        session,
        "transformers==4.46.3",
        "tokenizers==0.20.3",
        "huggingface_hub<0.26",
        hypothesis_profile="pytree-quick",
        default_tests=(
            "test/test_pytree_hf_cache.py",
            "test/extended/test_ddp_model_output.py",
            "test/test_pytree_family.py",
            "test/test_pytree_fast_path.py",
            "test/extended/test_pytree_hf_import_order.py",
        ),
    )


# The decode loops in the runtimes HF users deploy to (they skip in the other sessions,
# which lack the runtimes), and the ONNX suite, whose names depend on how transformers
# 4.32-5.13 registers its outputs: without key functions.  (Not the suite that checks
# that importing transformers logs nothing: executorch brings torchao, which does.)
_DEPLOY_TESTS = (
    "test/extended/test_onnx_hf_decode.py",
    "test/extended/test_export_hf_executorch.py",
    "test/extended/test_export_hf_save_decode.py",
    "test/extended/test_onnx_hf_models.py",
    "test/extended/test_pytree_hf_import_order.py",
)


@_session("tests-deploy")
def tests_deploy(session: nox.Session) -> None:
    """The runtimes HF users deploy to: optimum-onnx, onnxruntime-genai and ExecuTorch.

    Tiny Llama and GPT-2 decode steps, exported to ONNX and with torch.export,
    decoded greedily by optimum-onnx 0.1.0's ORTModelForCausalLM,
    onnxruntime-genai 0.18.0 and ExecuTorch 1.5.1 (portable and XNNPACK), token for
    token against eager generate(). transformers 4.57.6, the newest release that
    optimum-onnx 0.1.0 allows (it registers ModelOutputs without key functions, so the
    ONNX names of test_onnx_hf_models.py are checked here too); all of them
    install beside torch 2.13.0 in one venv. Only these test files (docs/deploy.md).
    """
    _run_suite(
        session,
        "transformers==4.57.6",
        "optimum-onnx==0.1.0",
        "onnxruntime-genai==0.18.0",
        "executorch==1.5.1",
        hypothesis_profile="pytree-quick",
        default_tests=_DEPLOY_TESTS,
        workers=1,  # each test already runs a runtime's own threads
    )


# The test files that PyTorch's CI also runs under PYTORCH_TEST_WITH_DYNAMO=1 (all of this
# repo's pytree files; the export, distributed and ONNX suites are not Dynamo-wrapped upstream).
_DYNAMO_WRAPPED_TESTS = (
    "test/test_pytree_family.py",
    "test/test_pytree_family_lazy.py",
    "test/test_pytree_fast_path.py",
    "test/test_pytree_hf_cache.py",
    "test/extended/test_pytree_hypothesis.py",
)


@_session("tests-ci-pins")
def tests_ci_pins(session: nox.Session) -> None:
    """The test dependencies pinned as in PyTorch's CI, without transformers and diffusers.

    hypothesis 6.56.4, optree 0.13.0, pytest 7.3.2, pytest-xdist 3.3.1 and numpy 1.26.2; the
    transformers-dependent cases skip, everything else runs, with upstream's
    hypothesis budget.  Then the pytree test files that pass that way once more
    with PYTORCH_TEST_WITH_DYNAMO=1, as PyTorch's dynamo-wrapped CI shards run
    them (arguments after `--` replace `test` in the first run only).
    """
    env = _run_suite(
        session, "hypothesis==6.56.4", "optree==0.13.0", "pytest==7.3.2", "pytest-xdist==3.3.1",
        "numpy==1.26.2", extras="test-core", hypothesis_profile="pytree-default",
    )
    session.run(
        "python", "-m", "pytest", "-q", "-n", str(_WORKERS), *_DYNAMO_WRAPPED_TESTS,
        env={**env, "PYTORCH_TEST_WITH_DYNAMO": "1"},
    )


# ---------------------------------------------------------------------------
# lint and commits: the exported series as upstream would see it (the scripts in .ci/)
# ---------------------------------------------------------------------------


@_session("lint")
def lint(session: nox.Session) -> None:
    """PyTorch's lint gates on the exported series: no finding that stock v2.13.0 does not have.

    .ci/lint_series.py exports the series (`torch-patch export`: library patches, tests,
    benchmarks), applies it with `git am` to a tree of the stock torch 2.13.0 files, and runs, on
    every file it touches, what PyTorch's CI runs: RUFF, FLAKE8, PYFMT (isort, then usort, then
    ruff format), mypy strict (the MYPYSTRICT files) and pyrefly, at upstream's pinned versions
    (.ci/lint/requirements.txt). The same runs on the stock files give the baseline; the session
    fails on any finding the patched files add. Then every exported commit alone: the files it
    touches, as they are at that commit, against the same baseline (a commit that is clean only
    once a later one lands fails). Settings: PyTorch's (the files in .ci/lint/), or a PyTorch
    checkout's own with `nox -s lint -- --pytorch-root DIR`.
    """
    args = session.posargs
    if args and (len(args) != 2 or args[0] != "--pytorch-root"):
        session.error("usage: nox -s lint [-- --pytorch-root DIR]")
    session.install(
        "-r", ".ci/requirements-torch-2.13.txt", "-e", ".", "-r", ".ci/lint/requirements.txt"
    )
    session.run("python", ".ci/lint_series.py", *args)


@_session("commits")
def commits(session: nox.Session) -> None:
    """Each library commit of the exported series passes its own Test Plan atop the ones before it.

    .ci/check_commits.py: for commit k, a dev tree holds torch 2.13.0 with patches 1..k applied,
    and every command of commit k's Test Plan that runs a file of this repo runs against it, with
    the test files of commits 1..k (`torch-patch export` puts a test into the first commit whose
    Test Plan names it). Commands that need a file this repo does not have (upstream's
    test/test_pytree.py) or an argument to fill in (the benchmark's `--baseline <stock
    _pytree.py>`) are listed, not run. `nox -s commits -- 3 5` checks commits 3 and 5 only. The
    last commit is the whole series, which the test sessions run; `nox -s commits -- 9` checks it
    here too.
    """
    # With CI set (as in PyTorch's CI and ours), `python test/<file>.py` makes run_tests()
    # write a JUnit XML report through xmlrunner, which upstream CI installs from this package.
    session.install(
        "-r", ".ci/requirements-torch-2.13.txt", "-e", ".[test]", "unittest-xml-reporting"
    )
    session.run("python", ".ci/check_commits.py", *session.posargs)


# ---------------------------------------------------------------------------
# the other release lines: torch_patch/patches/2.14/ and 2.15/
# ---------------------------------------------------------------------------

# The release between 2.13 and the newest: the family, export, Dynamo and tool suites.
_MIDDLE_LINE_TESTS = (
    "test/test_pytree_family.py",
    "test/test_pytree_family_lazy.py",
    "test/test_pytree_fast_path.py",
    "test/test_pytree_hf.py",
    "test/test_pytree_hf_cache.py",
    "test/test_pytree_load_imports.py",
    "test/export",
    "test/extended/test_export_hf_kv_cache.py",
    "test/torch_patch",
)


@_session("tests-2.14", needs_gb=9.0)
def tests_2_14(session: nox.Session) -> None:
    """torch 2.14.1 and its series: the family, export and tool suites.

    A CUDA build, which runs on the CPU (about 4 GB with its nvidia packages); latest
    transformers.
    """
    _run_suite(
        session, line="2.14", hypothesis_profile="pytree-quick", default_tests=_MIDDLE_LINE_TESTS
    )


@_session("tests-2.15", needs_gb=9.0)
def tests_2_15(session: nox.Session) -> None:
    """torch 2.15.0, the newest supported release, and its series: the whole suite.

    A CUDA build, which runs on the CPU (about 4 GB with its nvidia packages); latest
    transformers; 200 hypothesis examples per property (tests-latest runs the 1,200-example
    profile on 2.13.0).
    """
    _run_suite(session, line="2.15", hypothesis_profile="pytree-quick")
