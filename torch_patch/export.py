"""`torch-patch export OUTDIR`: the upstream-ready series (library patches + tests + benchmarks).

A throw-away stand-in checkout holding the stock files the series touches is committed as
``v<release>`` of the torch the files come from (v2.13.0, v2.14.1, ...) and the library series of
that release line is `git am`-ed, each commit together with the files of this
repo's upstream tests (``test/**`` except ``test/torch_patch/``) and ``benchmarks/**`` that its
Test Plan names first (``python test/x.py``: that file and the modules of its directory it
imports; ``python benchmarks/d/x.py``: all of ``benchmarks/d/``). One commit then adds the
tests, and one the benchmarks, that no Test Plan names.  Everything after the base is written
with the byte-stable ``git format-patch`` options of ``dev --export``.

``--cut generic`` stops before the first library patch that is specific to HuggingFace
libraries (its added lines name transformers, diffusers or HuggingFace), so a fork can take the
generic part alone; the files that only the dropped patches' Test Plans name are left out too.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional

from .core import (PATCHES_DIR, Log, TorchPatchError, _print, check_base, git_env, load_record,
                   load_series, release_line, release_of, require_git, resolve_target, run_git,
                   stock_files)
from .dev import FIXED_IDENTITY, _git_commit_all, base_message, base_tag, format_patches, git_am
from .upstream import BENCHMARKS_COMMIT_MESSAGE, TESTS_COMMIT_MESSAGE

TOOL_TESTS = "test/torch_patch/"
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache"}


def default_repo() -> Path:
    repo = PATCHES_DIR.parent.parent
    if not ((repo / "setup.py").is_file() and (repo / "test").is_dir()):
        raise TorchPatchError(f"export needs a checkout of the torch_patch repository (its test/ and "
                              f"benchmarks/); none next to {PATCHES_DIR.parent}: pass --repo DIR")
    return repo


def repo_files(repo: Path, top: str) -> List[str]:
    """Files under ``top`` (tracked or untracked but not ignored), as repo-relative posix paths."""
    if not (repo / top).is_dir():
        return []
    if (repo / ".git").exists():
        proc = run_git(["ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", top], repo)
        files = [f for f in proc.stdout.decode().split("\0") if f and (repo / f).is_file()]
    else:
        files = [p.relative_to(repo).as_posix() for p in (repo / top).rglob("*") if p.is_file()]
    return sorted(f for f in set(files)
                  if not _SKIP_PARTS.intersection(f.split("/")) and not f.endswith((".pyc", ".pyo")))


_TEST_PLAN_COMMAND = re.compile(r"^\s*python3?\s+(\S+\.py)\b", re.MULTILINE)
_LOCAL_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)\b", re.MULTILINE)


def _copy_into(repo: Path, work: Path, files: List[str]) -> None:
    for f in files:
        dst = work / f
        if dst.exists():
            raise TorchPatchError(f"{f} would overwrite a file of the library series; rename it")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / f, dst)
        shutil.copymode(repo / f, dst)


def _test_plan_files(patch_text: str) -> List[str]:
    """The ``python <file>.py`` commands of the Test Plan in a patch's message, in order."""
    message = patch_text.split("\n---\n", 1)[0]
    if "\nTest Plan:" not in message:
        return []
    return _TEST_PLAN_COMMAND.findall(message.split("\nTest Plan:", 1)[1])


def _files_for_test_plan(named: str, repo: Path, available: List[str]) -> List[str]:
    """What a Test Plan command needs from this repo: a benchmark's whole directory; a test file
    and the modules of its own directory that it imports (recursively)."""
    directory = named.rsplit("/", 1)[0]
    if named.startswith("benchmarks/"):
        return [f for f in available if f.startswith(directory + "/")]
    needed, todo = [], [named]
    while todo:
        f = todo.pop()
        if f in needed:
            continue
        needed.append(f)
        text = (repo / f).read_text(encoding="utf-8", errors="replace")
        for module in _LOCAL_IMPORT.findall(text):
            sibling = f"{f.rsplit('/', 1)[0]}/{module}.py"
            if sibling in available:
                todo.append(sibling)
    return sorted(needed)


def _tests_per_patch(patches: List, repo: Path, available: List[str]) -> List[List[str]]:
    """For each library patch, the files of this repo that its Test Plan names first."""
    taken: set = set()
    per_patch = []
    for patch in patches:
        files: List[str] = []
        for named in _test_plan_files(patch.text):
            if named in available:
                files += [f for f in _files_for_test_plan(named, repo, available)
                          if f not in taken and f not in files]
        taken.update(files)
        per_patch.append(sorted(files))
    return per_patch


CUTS = ("full", "generic")
_HF_SPECIFIC = re.compile(r"\b(?:transformers|diffusers|HuggingFace|huggingface)\b")


def _generic_length(patches: List) -> int:
    """How many library patches come before the first HuggingFace-specific one."""
    for i, patch in enumerate(patches):
        added = "\n".join(line[1:] for line in patch.text.split("\n---\n", 1)[-1].splitlines()
                          if line.startswith("+") and not line.startswith("+++"))
        if _HF_SPECIFIC.search(added):
            return i
    return len(patches)


def _test_plan(files: List[str], kind: str) -> str:
    lines = []
    for f in files:
        name = f.rsplit("/", 1)[-1]
        if f.endswith(".py") and (kind == "benchmarks" or name.startswith("test_")):
            lines.append(f"    python {f}")
    return "\n".join(lines) if lines else "    (no runnable files)"


def export(outdir: os.PathLike, *, force: bool = False, series_dir: Optional[os.PathLike] = None,
           repo: Optional[os.PathLike] = None, source: Optional[os.PathLike] = None,
           cut: str = "full", log: Log = _print) -> List[str]:
    """Write the upstream series into OUTDIR (patch files + ``series``).  Returns the names.

    ``cut="generic"``: only the library patches before the first HuggingFace-specific one.
    """
    if cut not in CUTS:
        raise TorchPatchError(f"unknown cut {cut!r}; choose one of: {', '.join(CUTS)}")
    outdir = Path(outdir).expanduser().resolve()
    if outdir.exists() and any(outdir.iterdir()) and not force:
        raise TorchPatchError(f"{outdir} exists and is not empty; choose a new directory or pass --force")
    require_git()
    src = resolve_target(source, require_venv=False)
    release = release_of(check_base(src))
    series = load_series(series_dir, line=release_line(release))
    tag = base_tag(release)
    repo = Path(repo).resolve() if repo is not None else default_repo()
    test_files = [f for f in repo_files(repo, "test") if not f.startswith(TOOL_TESTS)]
    bench_files = repo_files(repo, "benchmarks")
    record = load_record(src.root)
    with tempfile.TemporaryDirectory(prefix="torch-patch-export-") as tmp:
        work = Path(tmp) / "pytorch"
        work.mkdir()
        for rel, stock in stock_files(src, series.files, record, series=series).items():
            if stock is not None:
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(stock, work / rel)
        env = git_env(FIXED_IDENTITY)
        run_git(["-c", "init.defaultBranch=main", "init", "-q"], work, env=env)
        (work / "README").write_text(f"stand-in for pytorch {tag}: only the files the series touches\n")
        _git_commit_all(work, base_message(release))
        run_git(["tag", tag], work, env=env)
        # Each library commit carries the tests and benchmarks its Test Plan names (the first one
        # to name a file gets it); what no Test Plan names follows in a tests and a benchmarks commit.
        per_patch = _tests_per_patch(series.patches, repo, test_files + bench_files)
        library = series.patches
        if cut == "generic":
            keep = _generic_length(series.patches)
            if keep == 0:
                raise TorchPatchError("the series has no generic part: its first patch is already "
                                      "specific to HuggingFace libraries")
            dropped = {f for files in per_patch[keep:] for f in files}
            test_files = [f for f in test_files if f not in dropped]
            bench_files = [f for f in bench_files if f not in dropped]
            library, per_patch = series.patches[:keep], per_patch[:keep]
            log(f"generic cut: {keep} of {len(series.patches)} library patches (up to and including "
                f"{library[-1].name}), without the {len(dropped)} file(s) only the others' Test Plans name")
        for patch, files in zip(library, per_patch):
            git_am(work, [patch.path])
            if files:
                _copy_into(repo, work, files)
                run_git(["add", "-f", "--", *files], work, env=env)
                date = run_git(["log", "-1", "--format=%aI"], work, env=env).stdout.decode().strip()
                run_git(["commit", "-q", "--amend", "--no-edit", "--no-verify"], work,
                        env=git_env(dict(FIXED_IDENTITY, GIT_COMMITTER_DATE=date)))
        in_library = {f for files in per_patch for f in files}
        test_files = [f for f in test_files if f not in in_library]
        bench_files = [f for f in bench_files if f not in in_library]
        # the added commits carry the identity and date of the last library commit (stable bytes)
        ident = run_git(["log", "-1", "--format=%an%n%ae%n%aI"], work, env=env).stdout.decode().split("\n")
        identity = dict(FIXED_IDENTITY)
        if library:
            identity.update(GIT_AUTHOR_NAME=ident[0], GIT_AUTHOR_EMAIL=ident[1], GIT_AUTHOR_DATE=ident[2],
                            GIT_COMMITTER_NAME=ident[0], GIT_COMMITTER_EMAIL=ident[1],
                            GIT_COMMITTER_DATE=ident[2])
        for files, template, kind in ((test_files, TESTS_COMMIT_MESSAGE, "test"),
                                      (bench_files, BENCHMARKS_COMMIT_MESSAGE, "benchmarks")):
            if not files:
                log(f"note: every {kind} file is in a library commit (or none exists); no {kind} commit")
                continue
            _copy_into(repo, work, files)
            run_git(["add", "-f", "--", *files], work, env=env)
            run_git(["commit", "-q", "--no-verify", "-m", template.format(test_plan=_test_plan(files, kind))],
                    work, env=git_env(identity))
        # written next to the work tree first, so a failure leaves OUTDIR as it was
        staged = Path(tmp) / "out"
        names = [p.name for p in format_patches(work, f"{tag}..HEAD", staged)]
        (staged / "series").write_text("".join(f"{n}\n" for n in names), encoding="utf-8")
        outdir.mkdir(parents=True, exist_ok=True)
        if force:
            for old in list(outdir.glob("*.patch")) + [outdir / "series"]:
                old.unlink(missing_ok=True)
        for name in names + ["series"]:
            shutil.copyfile(staged / name, outdir / name)
    log(f"exported {len(names)} patch(es) to {outdir} ({len(library)} library, carrying "
        f"{len(in_library)} file(s) their Test Plans name; then {len(test_files)} other test file(s), "
        f"{len(bench_files)} other benchmark file(s))")
    log(f"  on a PyTorch {tag} checkout:  git am --keep-non-patch {outdir}/*.patch")
    return names
