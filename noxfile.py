"""Test matrix: `nox` runs the test sessions, `lint` and `commits` (see README.md, command 2).

Each test session installs a torch release (.ci/requirements-torch-<line>.txt: 2.13.0 unless the
session names another line) and this package with its test extras into a fresh venv
(.nox/<session>), applies the series of that release line to that venv's torch with
`torch-patch apply` (a no-op when the session is reused), then runs the whole suite.  Every
session deletes its venv when it ends, unless `-r` asks nox to reuse the venvs: a whole run then
needs about 9 GB of disk at a time instead of 21.  Arguments after `--` replace the default
`test`: `nox -s tests-latest -- test/test_pytree_family.py -x`.  `lint` runs PyTorch's lint
gates on the exported series; `commits` checks every library commit against its own Test Plan,
with only the commits before it.
"""

import collections
import functools
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import nox


nox.options.default_venv_backend = "venv"  # never uv: it would fetch CUDA torch wheels
nox.options.sessions = [
    "tests-latest",
    "tests-2.15",
    "tests-2.14",
    "tests-hf431",
    "tests-hf446",
    "tests-ci-pins",
    "tests-deploy",
    "lint",
    "commits",
]
nox.options.error_on_missing_interpreters = True

# The venvs of a whole run take about 21 GB (6 GB for each CUDA build of torch 2.14.1 and
# 2.15.0); a CI machine may have less.  Without -r/--reuse-existing-virtualenvs the next run
# recreates every venv anyway, so a session deletes its own once it ends, pass or fail: a run
# then needs about 9 GB at a time (8.8 GB measured, while torch 2.15.0 installs).  With -r the
# venvs stay, to be reused.
_GB = 1024**3


def _session(name: str, *, needs_gb: float = 3.0) -> Callable[
    [Callable[[nox.Session], None]], Callable[[nox.Session], None]
]:
    """`nox.session(name=name)`, plus a check of the free disk first and freeing the venv after."""

    def decorate(
        run: Callable[[nox.Session], None],
    ) -> Callable[[nox.Session], None]:
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
        "-r",
        f".ci/requirements-torch-{line}.txt",
        "-e",
        f".[{extras}]",
        "pytest-xdist",
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
        session,
        "transformers==4.31.0",
        "numpy<2",
        "tokenizers==0.13.3",
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
        session,
        "hypothesis==6.56.4",
        "optree==0.13.0",
        "pytest==7.3.2",
        "pytest-xdist==3.3.1",
        "numpy==1.26.2",
        extras="test-core",
        hypothesis_profile="pytree-default",
    )
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-n",
        str(_WORKERS),
        *_DYNAMO_WRAPPED_TESTS,
        env={**env, "PYTORCH_TEST_WITH_DYNAMO": "1"},
    )


# ---------------------------------------------------------------------------
# lint: PyTorch's lint gates on the exported series, stock vs patched
# ---------------------------------------------------------------------------

# The linters and the versions PyTorch's lintrunner pins (2026).
LINT_REQUIREMENTS = (
    "ruff==0.14.4",
    "isort==6.0.1",
    "usort==1.1.3",
    "flake8==7.3.0",
    "flake8-bugbear==24.12.12",
    "flake8-comprehensions==3.16.0",
    "flake8-executable==2.1.3",
    "flake8-logging-format==2024.24.12",
    "flake8-pyi==25.5.0",
    "flake8-simplify==0.30.0",
    "pycodestyle==2.14.0",
    "pyflakes==3.4.0",
    "torchfix==0.4.0",
    "mypy==1.16.0",
    "pyrefly==0.58.0",
    "optree==0.13.0",  # mypy and pyrefly resolve `import optree` as upstream's CI does
    "setuptools<81",  # flake8-logging-format imports pkg_resources
)

# Files on PyTorch's MYPYSTRICT list that the series can touch.
MYPY_STRICT_FILES = ("torch/utils/_pytree.py", "torch/utils/_cxx_pytree.py")

# The settings of PyTorch's lint configuration that apply to the files the
# series touches (pyproject.toml's [tool.ruff] / [tool.isort] / [tool.usort],
# .flake8, mypy-strict.ini, pyrefly.toml), used when no PyTorch checkout is
# given with `-- --pytorch-root DIR` (whose own files are then used instead).
_LINT_CONFIG = {
    "pyproject.toml": """\
[project]
name = "torch"
requires-python = ">=3.10"
dynamic = ["version"]

[tool.isort]
src_paths = ["caffe2", "torch", "torchgen", "functorch", "test"]
extra_standard_library = ["typing_extensions"]
profile = "black"
line_length = 88
lines_after_imports = 2
multi_line_output = 3
include_trailing_comma = true
combine_as_imports = true

[tool.usort]
preserve_inline_comments = true
collapse_blank_lines_in_category = false

[tool.usort.known]
first_party = ["caffe2", "torch", "torchgen", "functorch", "test"]
standard_library = ["typing_extensions"]

[tool.ruff]
line-length = 88
src = ["caffe2", "torch", "torchgen", "functorch", "test"]

[tool.ruff.format]
docstring-code-format = true
quote-style = "double"

[tool.ruff.lint]
select = [
    "B", "B904", "C4", "G", "E", "EXE", "F", "SIM", "W", "FURB", "LOG", "NPY",
    "PERF", "PGH004", "PIE", "PLC0131", "PLC0132", "PLC1802", "PLC0205", "PLC3002",
    "PLC0414", "PLE", "PLR0133", "PLR0206", "PLR1722", "PLR1736", "PLW0127",
    "PLW0129", "PLW0131", "PLW0133", "PLW0245", "PLW0406", "PLW0711", "PLW1501",
    "PLW1507", "PLW1509", "PLW2101", "PLW3301", "PT006", "PT014", "PT022", "PT023",
    "PT024", "PT025", "PT026", "PYI", "Q003", "Q004", "RSE", "RUF007", "RUF008",
    "RUF013", "RUF015", "RUF016", "RUF017", "RUF018", "RUF019", "RUF020", "RUF024",
    "RUF026", "RUF030", "RUF033", "RUF041", "RUF048", "RUF100", "RUF200", "S324",
    "SLOT", "TC", "TRY002", "TRY203", "TRY401", "UP", "YTT", "S101",
]
ignore = [
    "B007", "B008", "B017", "B018", "B023", "B028", "B905", "C408", "E402", "E501",
    "E741", "EXE001", "F405", "FURB122", "NPY002", "PERF203", "PERF401", "PYI024",
    "PYI036", "PYI041", "PYI056", "SIM102", "SIM103", "SIM105", "SIM108", "SIM110",
    "SIM112", "SIM114", "SIM116", "SIM117", "SIM300", "TC006",
]
external = [
    "P201", "P204", "T484", "B901", "B909", "E115", "E201", "E221", "E225", "E226",
    "E227", "E231", "E241", "E261", "E262", "E265", "E266", "E272", "E306",
]

[tool.ruff.lint.per-file-ignores]
"__init__.py" = ["F401"]
"test/export/**" = ["PGH004"]
""",
    ".flake8": """\
[flake8]
enable-extensions = G
select = B,C,E,F,G,P,SIM1,SIM911,T4,W,B9,TOR0,TOR1,TOR2,TOR9
max-line-length = 120
ignore =
    E203,E305,E402,E501,E704,E721,E741,F405,F841,F999,W503,W504,C408,E302,W291,E303,
    F824,EXE001,B007,B008,B017,B019,B023,B028,B903,B904,B905,B906,B907,B908,B910,
    C407,G100,G101,G200,SIM102,SIM103,SIM104,SIM105,SIM106,SIM108,SIM110,SIM111,
    SIM112,SIM113,SIM114,SIM115,SIM116,SIM117,SIM118,SIM119,SIM12,
    TOR001,TOR003,TOR101,TOR102
per-file-ignores =
    __init__.py: F401
    test/**: F821
optional-ascii-coding = True
""",
    "mypy-strict.ini": """\
[mypy]
python_version = 3.10
cache_dir = .mypy_cache/strict
allow_redefinition = True
strict_optional = True
show_error_codes = True
show_column_numbers = True
warn_no_return = True
disallow_any_unimported = True
strict = True
implicit_reexport = False
warn_unused_ignores = False

[mypy-torch]
follow_imports = skip

[mypy-torch.*]
follow_imports = skip

[mypy-numpy]
ignore_missing_imports = True
""",
    "pyrefly.toml": """\
python-version = "3.12"
project-includes = ["torch"]
project-excludes = ["torch/testing/_internal/**", "*/__pycache__/**", "*/.*"]
ignore-missing-imports = [
    "numpy.*", "sympy.*", "onnx.*", "onnxruntime.*", "onnxscript.*", "triton.*",
]
untyped-def-behavior = "check-and-infer-return-any"
errors.implicitly-defined-attribute = false
errors.bad-param-name-override = false
errors.implicit-import = false
""",
}

_PYFMT_SCRIPT = """\
import re, subprocess, sys
from pathlib import Path
import isort, usort

root = Path(sys.argv[1])
for name in sys.argv[2:]:
    path = root / name
    original = text = path.read_text(encoding="utf-8")
    text = re.sub(r"(#.*\\b)usort:\\s*skip\\b", r"\\g<1>isort: split", text)
    text = isort.code(text, config=isort.Config(settings_path=str(root)), file_path=path)
    text = re.sub(r"(#.*\\b)isort: split\\b", r"\\g<1>usort: skip", text)
    text = usort.usort_string(text, path=path, config=usort.Config.find(path))
    text = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--config", str(root / "pyproject.toml"),
         "--stdin-filename", str(path), "-"],
        input=text, capture_output=True, text=True, check=True,
    ).stdout
    if text != original:
        print(f"{name}: PYFMT would reformat this file")
"""

_LINT_CONFIG_FILES = {  # ours -> the file of that name in a PyTorch checkout
    "pyproject.toml": "pyproject.toml",
    ".flake8": ".flake8",
    "mypy-strict.ini": "mypy-strict.ini",
    "pyrefly.toml": "pyrefly.toml",
}


def _lint_config(session: nox.Session, pytorch_root: str | None) -> dict[str, str]:
    """The configuration files' contents: a PyTorch checkout's own when given, else ours."""
    if pytorch_root is None:
        session.log(
            "lint configuration: the PyTorch settings written down in noxfile.py"
        )
        return dict(_LINT_CONFIG)
    root = Path(pytorch_root)
    missing = [
        name for name in _LINT_CONFIG_FILES.values() if not (root / name).is_file()
    ]
    if missing:
        session.error(
            f"--pytorch-root {root}: no {', '.join(missing)} there (a PyTorch checkout has them)"
        )
    session.log(f"lint configuration: {root}")
    return {
        ours: (root / theirs).read_text() for ours, theirs in _LINT_CONFIG_FILES.items()
    }


def _findings(output: str) -> collections.Counter[str]:
    """Tool output lines that name a file, without line and column numbers."""
    found: collections.Counter[str] = collections.Counter()
    for line in output.splitlines():
        match = re.match(r"^\s*(?:ERROR\s+)?(\S+?\.py)(?::[\d:-]+)?:?\s+(.*)$", line)
        if match and "note:" not in match.group(2):
            found[f"{match.group(1)}: {match.group(2)}"] += 1
    return found


@_session("lint")
def lint(session: nox.Session) -> None:
    """PyTorch's lint gates on the exported series: no finding that stock v2.13.0 does not have.

    Exports the series (`torch-patch export`: library patches, tests, benchmarks), applies it with
    `git am` to a tree of the stock torch 2.13.0 files, and runs, on every file it touches, what
    PyTorch's CI runs: RUFF, FLAKE8, PYFMT (isort, then usort, then ruff format), mypy strict (the
    MYPYSTRICT files) and pyrefly, at upstream's pinned versions. The same runs on the stock files
    give the baseline; the session fails on any finding the patched files add. Then every
    exported commit alone: the files it touches, as they are at that commit, against the same
    baseline (a commit that is clean only once a later one lands fails). Settings: PyTorch's
    (written down below), or a PyTorch checkout's own with `nox -s lint -- --pytorch-root DIR`.
    """
    pytorch_root = None
    if session.posargs:
        if len(session.posargs) != 2 or session.posargs[0] != "--pytorch-root":
            session.error("usage: nox -s lint [-- --pytorch-root DIR]")
        pytorch_root = session.posargs[1]
    config = _lint_config(session, pytorch_root)
    session.install("-r", ".ci/requirements-torch-2.13.txt", "-e", ".", *LINT_REQUIREMENTS)
    # Not under .nox: flake8 and pyrefly skip files below hidden directories.
    work = Path(tempfile.mkdtemp(prefix="torch-patch-lint-"))
    try:
        _lint_trees(session, config, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _gate_findings(
    session: nox.Session,
    gate: str,
    cmd: tuple[str, ...],
    checks: Callable[[str], bool],
    tree: Path,
    files: list[str],
) -> collections.Counter[str]:
    """One gate's findings on those of ``files`` it checks and ``tree`` has."""
    present = [f for f in files if checks(f) and (tree / f).is_file()]
    if not present:
        return collections.Counter()
    with session.chdir(tree):
        output = session.run(*cmd, *present, silent=True, success_codes=[0, 1])
    if "Traceback (most recent call last)" in output:
        session.error(f"{gate} crashed on the files of {tree.name}:\n{output}")
    return _findings(output)


def _lint_trees(session: nox.Session, config: dict[str, str], work: Path) -> None:
    git = (
        "git",
        "-c",
        "user.name=lint",
        "-c",
        "user.email=lint@example.invalid",
        "-c",
        "advice.detachedHead=false",
    )
    session.run("torch-patch", "dev", str(work / "dev"), silent=True)
    session.run("torch-patch", "export", str(work / "series"), silent=True)
    patches = sorted(str(p) for p in (work / "series").glob("*.patch"))
    dev = str(work / "dev")
    session.run(
        *git, "-C", dev, "checkout", "-q", "-b", "exported", "v2.13.0", external=True
    )
    session.run(
        *git, "-C", dev, "am", "-q", "--keep-non-patch", *patches, external=True
    )
    trees = {"stock": work / "stock", "patched": work / "patched"}
    for name, ref in (("stock", "v2.13.0"), ("patched", "exported")):
        session.run(
            *git,
            "-C",
            dev,
            "worktree",
            "add",
            "-q",
            "--detach",
            str(trees[name]),
            ref,
            external=True,
        )
        for filename, text in config.items():
            (trees[name] / filename).write_text(text)
    touched = session.run(
        *git,
        "-C",
        dev,
        "diff",
        "--name-only",
        "v2.13.0",
        "exported",
        silent=True,
        external=True,
    )
    files = sorted(f for f in touched.split() if f.endswith(".py"))
    session.log(f"{len(files)} Python files touched by {len(patches)} patches")
    pyfmt = work / "pyfmt.py"
    pyfmt.write_text(_PYFMT_SCRIPT)
    new: dict[str, collections.Counter[str]] = {}
    # gate -> (command, which of the touched files it checks)
    gates = {
        "RUFF": (
            (
                "ruff",
                "check",
                "--config",
                "pyproject.toml",
                "--output-format",
                "concise",
                "--no-cache",
            ),
            lambda f: True,
        ),
        "FLAKE8": (("flake8", "--config", ".flake8"), lambda f: True),
        "PYFMT": (("python", str(pyfmt), "."), lambda f: True),
        "MYPY-STRICT": (
            ("mypy", "--config-file", "mypy-strict.ini"),
            lambda f: f in MYPY_STRICT_FILES,
        ),
        "PYREFLY": (
            (
                "pyrefly",
                "check",
                "--config",
                "pyrefly.toml",
                "--output-format",
                "min-text",
            ),
            lambda f: f.startswith("torch/"),
        ),
    }
    stock: dict[str, collections.Counter[str]] = {}
    for gate, (cmd, checks) in gates.items():
        results = {
            name: _gate_findings(session, gate, cmd, checks, tree, files)
            for name, tree in trees.items()
        }
        stock[gate] = results["stock"]
        new[gate] = results["patched"] - results["stock"]
        counts = {name: sum(found.values()) for name, found in results.items()}
        session.log(
            f"{gate}: stock {counts['stock']}, patched {counts['patched']}, new {sum(new[gate].values())}"
        )
    # Each commit alone: the files it touches, as they are at that commit (a later commit
    # must not be what makes an earlier one clean).
    commits = session.run(
        *git, "-C", dev, "rev-list", "--reverse", "v2.13.0..exported",
        silent=True, external=True,
    ).split()
    for k, commit in enumerate(commits, 1):
        at = work / f"commit-{k}"
        session.run(
            *git, "-C", dev, "worktree", "add", "-q", "--detach", str(at), commit,
            external=True,
        )
        for filename, text in config.items():
            (at / filename).write_text(text)
        changed = session.run(
            *git, "-C", dev, "diff", "--name-only", f"{commit}~1", commit,
            silent=True, external=True,
        )
        touched_py = {f for f in changed.split() if f.endswith(".py")}
        if touched_py & set(MYPY_STRICT_FILES):
            # mypy strict checks the MYPYSTRICT files together, as lintrunner does
            # (alone, one sees the other as an unfollowed import)
            touched_py |= set(MYPY_STRICT_FILES)
        own = sorted(touched_py)
        found = 0
        for gate, (cmd, checks) in gates.items():
            extra = _gate_findings(session, gate, cmd, checks, at, own) - stock[gate]
            found += sum(extra.values())
            new[gate] += collections.Counter(
                {f"commit {k}: {finding}": n for finding, n in extra.items()}
            )
        session.log(f"commit {k}: {len(own)} Python files checked, new findings {found}")
        shutil.rmtree(at, ignore_errors=True)
    failures = [
        f"{gate}: {finding}" for gate, found in new.items() for finding in sorted(found)
    ]
    if failures:
        session.error("new lint findings:\n" + "\n".join(failures))


# ---------------------------------------------------------------------------
# commits: every library commit passes its own Test Plan with only the commits before it
# ---------------------------------------------------------------------------


def _test_plan_commands(patch: Path) -> list[list[str]]:
    """The ``python <file> [args]`` commands of a patch's Test Plan (the ``# ...`` comments dropped)."""
    message = patch.read_text(encoding="utf-8").split("\n---\n", 1)[0]
    if "\nTest Plan:" not in message:
        return []
    commands = []
    for line in message.split("\nTest Plan:", 1)[1].splitlines():
        words = line.split("#", 1)[0].split()
        if (
            len(words) >= 2
            and words[0] in ("python", "python3")
            and words[1].endswith(".py")
        ):
            commands.append(words[1:])
    return commands


@_session("commits")
def commits(session: nox.Session) -> None:
    """Each library commit of the exported series passes its own Test Plan on top of the ones before it.

    For commit k, a dev tree holds torch 2.13.0 with patches 1..k applied, and every command of
    commit k's Test Plan that runs a file of this repo runs against it, with the test files of
    commits 1..k (`torch-patch export` puts a test into the first commit whose Test Plan names
    it). Commands that need a file this repo does not have (upstream's test/test_pytree.py) or an
    argument to fill in (the benchmark's `--baseline <stock _pytree.py>`) are listed, not run.
    `nox -s commits -- 3 5` checks commits 3 and 5 only. The last commit is the whole series, which
    the test sessions run; `nox -s commits -- 9` checks it here too.
    """
    only = {int(arg) for arg in session.posargs}
    # With CI set (as in PyTorch's CI and ours), `python test/<file>.py` makes run_tests()
    # write a JUnit XML report through xmlrunner, which upstream CI installs from this package.
    session.install(
        "-r", ".ci/requirements-torch-2.13.txt", "-e", ".[test]", "unittest-xml-reporting"
    )
    work = Path(tempfile.mkdtemp(prefix="torch-patch-commits-"))
    try:
        series = work / "series"
        session.run("torch-patch", "export", str(series), silent=True)
        library = [
            line
            for line in (Path("torch_patch/patches/2.13/series").read_text().split())
            if line.endswith(".patch")
        ]
        exported = (series / "series").read_text().split()
        have: list[str] = []  # this repo's files that the commits so far carry
        failed: list[str] = []
        env = {"HYPOTHESIS_STORAGE_DIRECTORY": str(work / "hypothesis")}
        for k, name in enumerate(library, 1):
            patch = series / exported[k - 1]
            added = re.findall(
                r"^diff --git a/((?:test|benchmarks)/\S+) ", patch.read_text(), re.M
            )
            have += added
            if (only and k not in only) or (not only and k == len(library)):
                continue
            prefix = work / f"series-{k}"
            prefix.mkdir()
            for lib in library[:k]:
                shutil.copyfile(Path("torch_patch/patches/2.13") / lib, prefix / lib)
            (prefix / "series").write_text("".join(f"{lib}\n" for lib in library[:k]))
            tree = work / f"tree-{k}"
            session.run(
                "torch-patch", "dev", str(tree), "--series", str(prefix), silent=True
            )
            env["PYTHONPATH"] = str(tree)
            for rel in have:
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(rel, tree / rel)
            for command in _test_plan_commands(patch):
                if command[0] not in have or any("<" in word for word in command):
                    session.log(
                        f"commit {k}: not run (needs what this repo does not have): python {' '.join(command)}"
                    )
                    continue
                session.log(f"commit {k} ({name}): python {' '.join(command)}")
                try:
                    with session.chdir(tree):
                        session.run("python", *command, env=env)
                except nox.command.CommandFailed:
                    failed.append(f"commit {k} ({name}): python {' '.join(command)}")
            shutil.rmtree(tree, ignore_errors=True)
        if failed:
            session.error(
                "Test Plan commands that fail at their commit:\n" + "\n".join(failed)
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)



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
        session,
        line="2.14",
        hypothesis_profile="pytree-quick",
        default_tests=_MIDDLE_LINE_TESTS,
    )


@_session("tests-2.15", needs_gb=9.0)
def tests_2_15(session: nox.Session) -> None:
    """torch 2.15.0, the newest supported release, and its series: the whole suite.

    A CUDA build, which runs on the CPU (about 4 GB with its nvidia packages); latest
    transformers; 200 hypothesis examples per property (tests-latest runs the 1,200-example
    profile on 2.13.0).
    """
    _run_suite(session, line="2.15", hypothesis_profile="pytree-quick")
