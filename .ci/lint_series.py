"""PyTorch's lint gates on the exported series: no finding that stock v2.13.0 does not have.

Run by `nox -s lint`, in a venv with torch 2.13.0, this package and .ci/lint/requirements.txt.
It exports the series (`torch-patch export`), applies it with `git am` to a dev tree of the
stock torch files, and runs RUFF, FLAKE8, PYFMT, mypy strict (the MYPYSTRICT files) and pyrefly
on every Python file the series touches, patched and stock; stock gives the baseline. Then it
checks every exported commit alone: the files it touches, as they are at that commit, against the
same baseline. It exits with status 1, listing them, when there is any new finding.
"""

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


# The settings of PyTorch's lint configuration that apply to the files the series touches.
CONFIG_DIR = Path(__file__).resolve().parent / "lint"
CONFIG_FILES = ("pyproject.toml", ".flake8", "mypy-strict.ini", "pyrefly.toml")

# Files on PyTorch's MYPYSTRICT list that the series can touch.
MYPY_STRICT_FILES = ("torch/utils/_pytree.py", "torch/utils/_cxx_pytree.py")

GIT = (
    "git",
    "-c", "user.name=lint",
    "-c", "user.email=lint@example.invalid",
    "-c", "advice.detachedHead=false",
)

Findings = collections.Counter[str]


class LintError(Exception):
    """A failure of the lint run, with the message to show."""


def log(message: str) -> None:
    """Print one line of the run's log."""
    print(message, flush=True)


def run(*cmd: str, cwd: Path | None = None, success_codes: Sequence[int] = (0,)) -> str:
    """The output (stdout and stderr together) of ``cmd``; a LintError if it fails."""
    done = subprocess.run(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if done.returncode not in success_codes:
        raise LintError(
            f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{done.stdout}"
        )
    return done.stdout


def lint_config(pytorch_root: Path | None) -> dict[str, str]:
    """The configuration files' contents: a PyTorch checkout's own when given, else ours."""
    root = CONFIG_DIR if pytorch_root is None else pytorch_root
    missing = [name for name in CONFIG_FILES if not (root / name).is_file()]
    if missing:
        raise LintError(
            f"--pytorch-root {root}: no {', '.join(missing)} there (a PyTorch checkout has them)"
        )
    if pytorch_root is None:
        log("lint configuration: the PyTorch settings in .ci/lint/")
    else:
        log(f"lint configuration: {root}")
    return {name: (root / name).read_text() for name in CONFIG_FILES}


def findings(output: str) -> Findings:
    """Tool output lines that name a file, without line and column numbers."""
    found: Findings = collections.Counter()
    for line in output.splitlines():
        match = re.match(r"^\s*(?:ERROR\s+)?(\S+?\.py)(?::[\d:-]+)?:?\s+(.*)$", line)
        if match and "note:" not in match.group(2):
            found[f"{match.group(1)}: {match.group(2)}"] += 1
    return found


# gate -> (command, which of the touched files it checks); run in the tree, files appended
GATES: dict[str, tuple[tuple[str, ...], Callable[[str], bool]]] = {
    "RUFF": (
        ("ruff", "check", "--config", "pyproject.toml", "--output-format", "concise",
         "--no-cache"),
        lambda f: True,
    ),
    "FLAKE8": (("flake8", "--config", ".flake8"), lambda f: True),
    "PYFMT": ((sys.executable, str(CONFIG_DIR / "pyfmt.py"), "."), lambda f: True),
    "MYPY-STRICT": (
        ("mypy", "--config-file", "mypy-strict.ini"),
        lambda f: f in MYPY_STRICT_FILES,
    ),
    "PYREFLY": (
        ("pyrefly", "check", "--config", "pyrefly.toml", "--output-format", "min-text"),
        lambda f: f.startswith("torch/"),
    ),
}


def gate_findings(gate: str, tree: Path, files: Sequence[str]) -> Findings:
    """One gate's findings on those of ``files`` it checks and ``tree`` has."""
    cmd, checks = GATES[gate]
    present = [f for f in files if checks(f) and (tree / f).is_file()]
    if not present:
        return collections.Counter()
    output = run(*cmd, *present, cwd=tree, success_codes=(0, 1))
    if "Traceback (most recent call last)" in output:
        raise LintError(f"{gate} crashed on the files of {tree.name}:\n{output}")
    return findings(output)


def add_tree(dev: str, tree: Path, ref: str, config: dict[str, str]) -> None:
    """A worktree of the dev tree at ``ref``, with the lint configuration files."""
    run(*GIT, "-C", dev, "worktree", "add", "-q", "--detach", str(tree), ref)
    for filename, text in config.items():
        (tree / filename).write_text(text)


def lint_trees(config: dict[str, str], work: Path) -> list[str]:
    """The new findings of the series and of each of its commits, as ``GATE: finding`` lines."""
    run("torch-patch", "dev", str(work / "dev"))
    run("torch-patch", "export", str(work / "series"))
    patches = sorted(str(p) for p in (work / "series").glob("*.patch"))
    dev = str(work / "dev")
    run(*GIT, "-C", dev, "checkout", "-q", "-b", "exported", "v2.13.0")
    run(*GIT, "-C", dev, "am", "-q", "--keep-non-patch", *patches)
    trees = {"stock": work / "stock", "patched": work / "patched"}
    add_tree(dev, trees["stock"], "v2.13.0", config)
    add_tree(dev, trees["patched"], "exported", config)
    touched = run(*GIT, "-C", dev, "diff", "--name-only", "v2.13.0", "exported")
    files = sorted(f for f in touched.split() if f.endswith(".py"))
    log(f"{len(files)} Python files touched by {len(patches)} patches")
    new: dict[str, Findings] = {}
    stock: dict[str, Findings] = {}
    for gate in GATES:
        results = {name: gate_findings(gate, tree, files) for name, tree in trees.items()}
        stock[gate] = results["stock"]
        new[gate] = results["patched"] - results["stock"]
        counts = {name: sum(found.values()) for name, found in results.items()}
        log(
            f"{gate}: stock {counts['stock']}, patched {counts['patched']}, "
            f"new {sum(new[gate].values())}"
        )
    # Each commit alone: the files it touches, as they are at that commit (a later commit
    # must not be what makes an earlier one clean).
    commits = run(*GIT, "-C", dev, "rev-list", "--reverse", "v2.13.0..exported").split()
    for k, commit in enumerate(commits, 1):
        at = work / f"commit-{k}"
        add_tree(dev, at, commit, config)
        changed = run(*GIT, "-C", dev, "diff", "--name-only", f"{commit}~1", commit)
        touched_py = {f for f in changed.split() if f.endswith(".py")}
        if touched_py & set(MYPY_STRICT_FILES):
            # mypy strict checks the MYPYSTRICT files together, as lintrunner does
            # (alone, one sees the other as an unfollowed import)
            touched_py |= set(MYPY_STRICT_FILES)
        own = sorted(touched_py)
        found = 0
        for gate in GATES:
            extra = gate_findings(gate, at, own) - stock[gate]
            found += sum(extra.values())
            new[gate] += collections.Counter(
                {f"commit {k}: {finding}": n for finding, n in extra.items()}
            )
        log(f"commit {k}: {len(own)} Python files checked, new findings {found}")
        shutil.rmtree(at, ignore_errors=True)
    return [f"{gate}: {finding}" for gate, found in new.items() for finding in sorted(found)]


def main() -> int:
    """Lint the series; 0 when it adds no finding, 1 (with the findings) otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pytorch-root",
        type=Path,
        metavar="DIR",
        help="a PyTorch checkout whose lint configuration files to use instead of .ci/lint/",
    )
    args = parser.parse_args()
    # Not under .nox: flake8 and pyrefly skip files below hidden directories.
    work = Path(tempfile.mkdtemp(prefix="torch-patch-lint-"))
    try:
        failures = lint_trees(lint_config(args.pytorch_root), work)
        if failures:
            raise LintError("new lint findings:\n" + "\n".join(failures))
    except LintError as error:
        print(error, file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
