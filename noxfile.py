"""Test matrix: `nox` runs all four sessions (see README.md, command 2).

Each session installs this package with its test extras into a fresh venv (.nox/<session>),
applies the patch series to that venv's torch with `torch-patch apply` (a no-op when the
session is reused), then runs the whole suite.  Arguments after `--` replace the default `test`:
`nox -s tests-latest -- test/test_pytree_family.py -x`.
"""

import nox


nox.options.default_venv_backend = "venv"  # never uv: it would fetch CUDA torch wheels
nox.options.sessions = ["tests-latest", "tests-hf431", "tests-hf446", "tests-ci-pins"]
nox.options.error_on_missing_interpreters = True


def _run_suite(
    session: nox.Session,
    *extra_requirements: str,
    hypothesis_profile: str,
    default_tests: tuple[str, ...] = ("test",),
    extras: str = "test",
) -> dict[str, str]:
    session.install("-e", f".[{extras}]", *extra_requirements)
    session.run("torch-patch", "apply")
    session.run("torch-patch", "status")
    env = {
        # test/test_pytree_hypothesis.py: see the profiles in its docstring
        "PYTORCH_PYTREE_HYPOTHESIS_PROFILE": hypothesis_profile,
        # keep hypothesis' cache out of the work tree
        "HYPOTHESIS_STORAGE_DIRECTORY": session.create_tmp(),
    }
    session.run(
        "python", "-m", "pytest", "-q", *(session.posargs or default_tests), env=env
    )
    return env


@nox.session(name="tests-latest")
def tests_latest(session: nox.Session) -> None:
    """Latest transformers (and numpy 2); the full CI hypothesis profile (>= 100,000 examples)."""
    _run_suite(session, hypothesis_profile="pytree-ci")


@nox.session(name="tests-hf431")
def tests_hf431(session: nox.Session) -> None:
    """transformers 4.31.0, the oldest supported release (needs numpy<2 and its tokenizers)."""
    _run_suite(
        session,
        "transformers==4.31.0",
        "numpy<2",
        "tokenizers==0.13.3",
        hypothesis_profile="pytree-quick",
    )


@nox.session(name="tests-hf446")
def tests_hf446(session: nox.Session) -> None:
    """transformers 4.46.3, where Cache is a torch.nn.Module (4.36 to 4.5x).

    Only the suites that cover that: DDP with a cache in the output, the family
    and fast-path tests. The export tests are written for the current cache API.
    """
    _run_suite(
        session,
        "transformers==4.46.3",
        "tokenizers==0.20.3",
        "huggingface_hub<0.26",
        hypothesis_profile="pytree-quick",
        default_tests=(
            "test/distributed",
            "test/test_pytree_family.py",
            "test/test_pytree_fast_path.py",
        ),
    )


# The test files that PyTorch's CI also runs under PYTORCH_TEST_WITH_DYNAMO=1.
_DYNAMO_WRAPPED_TESTS = (
    "test/test_pytree_family.py",
    "test/test_pytree_fast_path.py",
    "test/test_pytree_hypothesis.py",
    "test/dynamo/test_member_descriptor.py",
)


@nox.session(name="tests-ci-pins")
def tests_ci_pins(session: nox.Session) -> None:
    """The test dependencies pinned as in PyTorch's CI, without transformers and diffusers.

    hypothesis 6.56.4, optree 0.13.0, pytest 7.3.2 and numpy 1.26.2; the
    transformers-dependent cases skip, everything else runs, with upstream's
    hypothesis budget.  Then the pytree test files once more with
    PYTORCH_TEST_WITH_DYNAMO=1, as PyTorch's dynamo-wrapped CI shards run them
    (arguments after `--` replace `test` in the first run only).
    """
    env = _run_suite(
        session,
        "hypothesis==6.56.4",
        "optree==0.13.0",
        "pytest==7.3.2",
        "numpy==1.26.2",
        extras="test-core",
        hypothesis_profile="pytree-default",
    )
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        *_DYNAMO_WRAPPED_TESTS,
        env={**env, "PYTORCH_TEST_WITH_DYNAMO": "1"},
    )
