"""Each library commit of the exported series passes its own Test Plan on top of the ones before it.

Run by `nox -s commits`, in a venv with torch 2.13.0 and this package with its test extras. For
commit k, a dev tree holds torch 2.13.0 with patches 1..k applied, and every command of commit
k's Test Plan that runs a file of this repo runs against it, with the test files of commits 1..k.
Commands that need a file this repo does not have, or an argument to fill in (`<...>`), are
listed, not run. It exits with status 1, listing them, when a command fails.
"""

import argparse
import concurrent.futures
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
    """The Test Plan commands that fail at their commit (of commits ``only``, when given).

    Two commits at a time (each in its own dev tree): most of a check is copying torch and
    importing it, on one core."""
    series = work / "series"
    run_quietly("torch-patch", "export", str(series))
    library = [
        line for line in (PATCHES / "series").read_text().split() if line.endswith(".patch")
    ]
    exported = (series / "series").read_text().split()
    have: list[str] = []  # this repo's files that the commits so far carry
    jobs = []
    for k, name in enumerate(library, 1):
        patch = series / exported[k - 1]
        have += re.findall(r"^diff --git a/((?:test|benchmarks)/\S+) ", patch.read_text(), re.M)
        if not (only and k not in only) and (only or k != len(library)):
            jobs.append((k, name, patch, list(have), library[:k], work))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return [f for failed in pool.map(lambda job: check_commit(*job), jobs) for f in failed]


def check_commit(
    k: int, name: str, patch: Path, have: list[str], library: list[str], work: Path
) -> list[str]:
    """Commit ``k``'s Test Plan commands that fail in a dev tree of patches 1..k."""
    prefix = work / f"series-{k}"
    prefix.mkdir()
    for lib in library:
        shutil.copyfile(PATCHES / lib, prefix / lib)
    (prefix / "series").write_text("".join(f"{lib}\n" for lib in library))
    tree = work / f"tree-{k}"
    run_quietly("torch-patch", "dev", str(tree), "--series", str(prefix))
    env = {**os.environ, "HYPOTHESIS_STORAGE_DIRECTORY": str(work / "hypothesis")}
    env["PYTHONPATH"] = str(tree)
    for rel in have:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, tree / rel)
    failed = []
    for command in test_plan_commands(patch):
        shown = f"python {' '.join(command)}"
        if command[0] not in have or any("<" in word for word in command):
            log(f"commit {k}: not run (needs what this repo does not have): {shown}")
            continue
        done = subprocess.run(
            [sys.executable, *command], cwd=tree, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        last = (done.stdout.strip().splitlines() or [""])[-1]
        log(f"commit {k} ({name}): {shown}: exit code {done.returncode} ({last})")
        if done.returncode:
            log(done.stdout)
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
