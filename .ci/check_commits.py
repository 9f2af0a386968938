"""Each library commit of the exported series passes its own Test Plan on top of the ones before it.

Run by `nox -s commits`, in a venv with torch 2.13.0 and this package with its test extras. For
commit k, a dev tree holds torch 2.13.0 with patches 1..k applied, and every command of commit
k's Test Plan that runs a file of this repo runs against it, with the test files of commits 1..k.
Commands that need a file this repo does not have, or an argument to fill in (`<...>`), are
listed, not run. It exits with status 1, listing them, when a command fails.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "torch_patch" / "patches" / "2.13"


def log(message: str) -> None:
    """Print one line of the run's log."""
    print(message, flush=True)


def run_quietly(*cmd: str) -> None:
    """Run ``cmd``, showing its output only when it fails (then raising CalledProcessError)."""
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        print(done.stdout, file=sys.stderr, flush=True)
        done.check_returncode()


def test_plan_commands(patch: Path) -> list[list[str]]:
    """The ``python <file> [args]`` commands of a patch's Test Plan (``# ...`` comments dropped)."""
    message = patch.read_text(encoding="utf-8").split("\n---\n", 1)[0]
    if "\nTest Plan:" not in message:
        return []
    commands = []
    for line in message.split("\nTest Plan:", 1)[1].splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] in ("python", "python3") and words[1].endswith(".py"):
            commands.append(words[1:])
    return commands


def check_commits(only: set[int], work: Path) -> list[str]:
    """The Test Plan commands that fail at their commit (of commits ``only``, when given)."""
    series = work / "series"
    run_quietly("torch-patch", "export", str(series))
    library = [
        line for line in (PATCHES / "series").read_text().split() if line.endswith(".patch")
    ]
    exported = (series / "series").read_text().split()
    have: list[str] = []  # this repo's files that the commits so far carry
    failed: list[str] = []
    env = {**os.environ, "HYPOTHESIS_STORAGE_DIRECTORY": str(work / "hypothesis")}
    for k, name in enumerate(library, 1):
        patch = series / exported[k - 1]
        added = re.findall(r"^diff --git a/((?:test|benchmarks)/\S+) ", patch.read_text(), re.M)
        have += added
        if (only and k not in only) or (not only and k == len(library)):
            continue
        prefix = work / f"series-{k}"
        prefix.mkdir()
        for lib in library[:k]:
            shutil.copyfile(PATCHES / lib, prefix / lib)
        (prefix / "series").write_text("".join(f"{lib}\n" for lib in library[:k]))
        tree = work / f"tree-{k}"
        run_quietly("torch-patch", "dev", str(tree), "--series", str(prefix))
        env["PYTHONPATH"] = str(tree)
        for rel in have:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / rel, tree / rel)
        for command in test_plan_commands(patch):
            shown = f"python {' '.join(command)}"
            if command[0] not in have or any("<" in word for word in command):
                log(f"commit {k}: not run (needs what this repo does not have): {shown}")
                continue
            log(f"commit {k} ({name}): {shown}")
            code = subprocess.run([sys.executable, *command], cwd=tree, env=env).returncode
            if code:
                log(f"commit {k} ({name}): {shown} failed with exit code {code}")
                failed.append(f"commit {k} ({name}): {shown}")
        shutil.rmtree(tree, ignore_errors=True)
    return failed


def main() -> int:
    """Check the commits named on the command line (default: all but the last)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "commits",
        nargs="*",
        type=int,
        metavar="K",
        help="check only these commits (1 is the first); the last one only when named",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="torch-patch-commits-"))
    try:
        failed = check_commits(set(args.commits), work)
    except subprocess.CalledProcessError as error:
        print(f"{' '.join(error.cmd)} failed with exit code {error.returncode}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        message = "Test Plan commands that fail at their commit:\n" + "\n".join(failed)
        print(message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
