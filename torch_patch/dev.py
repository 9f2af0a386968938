"""The developer's verbs: the dev tree (``dev DIR``, ``dev --export``) and the upstream series
(``export``). The same series always gives the same commits and the same patch files."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from .core import (PATCHES_DIR, RELEASE_LINES, Log, TorchPatchError, _read, git_env, load_series,
                   resolve_target, run_git, stock_versions, write_files)


def identity(name: str, email: str, date: str) -> Dict[str, str]:  # a commit's author, committer
    return {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
            for what, value in (("NAME", name), ("EMAIL", email), ("DATE", date))}


FIXED_IDENTITY = identity("torch-patch", "torch-patch@localhost", "2000-01-01T00:00:00Z")
# The same commits give the same bytes anywhere: no commit hash or git version, full blob hashes,
# "[PATCH]" subjects (a new patch renumbers no other), what git config could change pinned.
FORMAT_PATCH_OPTS = [
    "format-patch", "--zero-commit", "--no-signature", "--full-index", "--no-numbered",
    "--no-renames", "--diff-algorithm=myers", "--src-prefix=a/", "--dst-prefix=b/",
    "--no-relative", "--no-thread", "--no-cover-letter", "--encode-email-headers", "--no-color"]
# the message of the commit that `export` adds with the tests (or benchmarks) no Test Plan names
REST_COMMIT_MESSAGE = """\
[pytree] Add the pytree {kind} that no commit's Test Plan names

Each commit of this series carries the {kind} its Test Plan
names. No commit's Test Plan names these, so they come here, on top
of the whole series.

Test Plan:
{test_plan}
"""


def init_repo(repo: Path, release: str) -> None:
    """Commit all of ``repo`` as the stock torch ``release``, tagged v<release>."""
    message = f"PyTorch v{release} (python sources of the torch=={release} wheel)"
    for args in (["-c", "init.defaultBranch=main", "init", "-q"], ["add", "-A", "."],
                 ["commit", "-q", "--no-verify", "-m", message], ["tag", f"v{release}"]):
        run_git(args, repo, env=git_env(FIXED_IDENTITY))


def git_am(repo: Path, patches: List[Path]) -> None:
    """`git am` with the committer and date of the author: the commits depend on the patches."""
    env = git_env(FIXED_IDENTITY)
    for p in patches:
        proc = run_git(["am", "-q", "--committer-date-is-author-date", "--keep-cr",
                        "--keep-non-patch", str(p)], repo, env=env, check=False)
        if proc.returncode:
            run_git(["am", "--abort"], repo, env=env, check=False)
            err = proc.stderr.decode(errors="replace").strip().partition("\n")[0]
            raise TorchPatchError(f"`git am {p.name}` failed in {repo}:\n{err}")


def format_patches(repo: Path, rev_range: str, outdir: Path) -> List[Path]:
    proc = run_git([*FORMAT_PATCH_OPTS, "-o", str(outdir), rev_range], repo)
    return [Path(f) for f in proc.stdout.decode().splitlines() if f]


def dev_create(dev_dir: os.PathLike, *, source: Optional[os.PathLike] = None,
               series_dir: Optional[os.PathLike] = None, log: Log = print) -> Path:
    """Create the dev tree DIR from the installed torch ``source`` (default: this Python's)."""
    dev_dir = Path(dev_dir).expanduser().resolve()
    if dev_dir.exists() and any(dev_dir.iterdir()):
        raise TorchPatchError(f"{dev_dir} exists and is not empty; pass a new directory")
    src = resolve_target(source, require_venv=False)
    series = load_series(series_dir, line=src.line)
    stock, created = stock_versions(src, series), not dev_dir.exists()
    try:
        log(f"copying {src.root / 'torch'} to {dev_dir / 'torch'}\n"
            "(the stock files, no __pycache__)…")
        shutil.copytree(src.root / "torch", dev_dir / "torch", symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        write_files(dev_dir, stock)  # where the installed torch is patched
        for rel in [rel for rel, data in stock.items() if data is None]:
            (dev_dir / rel).unlink(missing_ok=True)
        (dev_dir / ".gitignore").write_text("*\n!*/\n!*.py\n!.gitignore\n", encoding="utf-8")
        init_repo(dev_dir, src.release)
        git_am(dev_dir, [p.path for p in series.patches])
    except BaseException:
        if created:
            shutil.rmtree(dev_dir, ignore_errors=True)
        raise
    log(f"dev tree ready at {dev_dir}:\nv{src.release} and the {len(series.patches)} patches of "
        f"{series.dir} as commits\n  test with:  PYTHONPATH={dev_dir} python ...\n"
        f"  commit there, then:  torch-patch dev --export {dev_dir}")
    return dev_dir


def same_change(a: bytes, b: bytes) -> bool:
    """The same change (message, files, context, lines) but for blob hashes and line numbers."""
    def norm(data: bytes) -> bytes:
        data = re.sub(rb"^index [0-9a-f]+\.\.[0-9a-f]+(?: \d+)?\n", b"", data, flags=re.M)
        return re.sub(rb"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@.*\n", b"@@\n", data, flags=re.M)
    return norm(a) == norm(b)


def dev_export(dev_dir: os.PathLike, *, patches_dir: Optional[os.PathLike] = None,
               log: Log = print) -> List[str]:
    """Rewrite ``patches_dir`` (default: the series of the dev tree's line) from its commits."""
    t = resolve_target(dev_dir, require_venv=False)
    dev_dir, tag = t.root, f"v{t.release}"
    if t.kind != "checkout" or run_git(["rev-parse", "-q", "--verify", f"{tag}^{{commit}}"],
                                       dev_dir, check=False).returncode:
        raise TorchPatchError(f"{dev_dir} is not a dev tree (a git checkout tagged {tag}).\n"
                              "Create one with `torch-patch dev DIR`.")
    dirty = run_git(["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                    dev_dir).stdout.decode().splitlines()
    if dirty:
        raise TorchPatchError(f"{dev_dir} has uncommitted changes to tracked files "
                              f"({', '.join(line[3:] for line in dirty[:5])}).\n"
                              "Commit or stash them first.")
    if patches_dir is None and not (PATCHES_DIR.parent.parent / "setup.py").is_file():
        raise TorchPatchError(f"{PATCHES_DIR} is not in a torch_patch source checkout.\n"
                              "Install it with `pip install -e`, or pass --patches-dir.")
    out = Path(patches_dir).resolve() if patches_dir else PATCHES_DIR / t.line
    with tempfile.TemporaryDirectory(prefix="torch-patch-export-") as tmp:
        new = {f.name: f.read_bytes() for f in format_patches(dev_dir, f"{tag}..HEAD", Path(tmp))}
    for name, data in new.items():
        for f in re.findall(rb"^diff --git a/(\S+) ", data, re.M):
            if not f.startswith(b"torch/"):
                raise TorchPatchError(f"commit {name} touches {f.decode()}, outside torch/.\n"
                                      "Library patches change only torch/ (tests: test/ here).")
    lines = list(RELEASE_LINES)
    earlier = lines[:lines.index(out.name)] if out.name in lines else []
    # a patch with the same change as a patch file of an earlier line is that file (of any number)
    shared = {f"../{line}/{f.name}": f.read_bytes()
              for line in earlier for f in sorted((out.parent / line).glob("*.patch"))}
    entries = {name: next((e for e, old in shared.items() if same_change(old, data)), name)
               for name, data in new.items()}
    out.mkdir(parents=True, exist_ok=True)
    written = {n: data for n, data in new.items() if entries[n] == n and _read(out / n) != data}
    removed = [p.name for p in sorted(out.glob("*.patch")) if entries.get(p.name) != p.name]
    write_files(out, written)
    for name in removed:
        (out / name).unlink()
    series_file = "".join(f"{e}\n" for e in entries.values()).encode()
    if _read(out / "series") != series_file:
        (out / "series").write_bytes(series_file)
    log(f"exported {len(new)} patches from {dev_dir} ({tag}..HEAD) to {out}:\n{len(written)} "
        f"written, {sum('/' in e for e in entries.values())} shared with an earlier release line, "
        f"{len(removed)} removed.")
    if removed:
        log(f"removed: {', '.join(removed)}")
    return list(new)


def repo_files(repo: Path, top: str) -> List[str]:
    """The files under ``top`` (tracked, or untracked and not ignored), without caches."""
    if (repo / ".git").exists():
        out = run_git(["ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", top],
                      repo).stdout
        files = [f for f in out.decode().split("\0") if f and (repo / f).is_file()]
    else:
        files = [p.relative_to(repo).as_posix() for p in (repo / top).rglob("*") if p.is_file()]
    caches = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache"}
    return sorted(f for f in set(files)
                  if not caches & set(f.split("/")) and not f.endswith((".pyc", ".pyo")))


def _needs(named: str, repo: Path, available: List[str]) -> List[str]:
    """What `python <named>` needs: a benchmark its directory, a test the modules it imports."""
    directory = named.rsplit("/", 1)[0]
    if named.startswith("benchmarks/"):
        return [f for f in available if f.startswith(directory + "/")]
    needed, todo = set(), [named]
    while todo:
        needed.add(f := todo.pop())
        text = (repo / f).read_text(encoding="utf-8", errors="replace")
        imports = re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)\b", text, re.M)
        todo += {f"{directory}/{m}.py" for m in imports} & set(available) - needed
    return sorted(needed)


def _commit(work: Path, repo: Path, names: List[str], env: Dict[str, str], *args: str) -> None:
    """Copy the files ``names`` of ``repo`` into ``work`` and commit them (``args``: how)."""
    for f in names:  # in test/ or benchmarks/: no file of the library series, added once
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / f, work / f)
    run_git(["add", "-f", "--", *names], work, env=git_env(env))
    run_git(["commit", "-q", "--no-verify", *args], work, env=git_env(env))


def export(outdir: os.PathLike, *, force: bool = False, series_dir: Optional[os.PathLike] = None,
           repo: Optional[os.PathLike] = None, source: Optional[os.PathLike] = None,
           cut: str = "full", log: Log = print) -> List[str]:
    """Write the upstream series into OUTDIR (``cut="generic"``: its HuggingFace-free start)."""
    outdir = Path(outdir).expanduser().resolve()
    if outdir.exists() and any(outdir.iterdir()) and not force:
        raise TorchPatchError(f"{outdir} exists and is not empty.\n"
                              "Choose a new directory or pass --force.")
    src = resolve_target(source, require_venv=False)
    release, series = src.release, load_series(series_dir, line=src.line)
    repo = Path(repo).resolve() if repo is not None else PATCHES_DIR.parent.parent
    if not (repo / "test").is_dir():
        raise TorchPatchError(f"export takes the tests and benchmarks of a torch_patch checkout; "
                              f"{repo} has no test/.\nPass --repo DIR.")
    local = ("test/torch_patch/", "test/extended/")  # the tool's tests, and the suites kept here
    files = {"test": [f for f in repo_files(repo, "test") if not f.startswith(local)],
             "benchmarks": repo_files(repo, "benchmarks")}
    available, library = files["test"] + files["benchmarks"], series.patches
    per_patch, claimed = [], set()
    for patch in library:  # each library patch carries the files its Test Plan names first
        message = patch.data.decode(errors="replace").split("\n---\n", 1)[0]
        plan = message.partition("\nTest Plan:")[2]
        named = re.findall(r"^\s*python3?\s+(\S+\.py)\b", plan, re.M)
        per_patch.append(sorted({f for n in named if n in available
                                 for f in _needs(n, repo, available)} - claimed))
        claimed.update(per_patch[-1])
    if cut == "generic":
        hf = re.compile(r"^\+(?!\+\+).*\b(?:transformers|diffusers|HuggingFace|huggingface)\b",
                        re.M)  # an added line that names a HuggingFace library
        keep = next((i for i, p in enumerate(library)
                     if hf.search(p.data.decode(errors="replace").split("\n---\n", 1)[-1])),
                    len(library))
        if keep == 0:
            raise TorchPatchError("the series has no generic part: its first patch is already "
                                  "HuggingFace-specific")
        library, per_patch = library[:keep], per_patch[:keep]
        log(f"generic cut: {keep} of {len(series.patches)} library patches (up to "
            f"{library[-1].name}),\nwithout the {len(claimed) - sum(map(len, per_patch))} files "
            "only the others' Test Plans name")
    with tempfile.TemporaryDirectory(prefix="torch-patch-export-") as tmp:
        work, last = Path(tmp) / "pytorch", FIXED_IDENTITY
        write_files(work, stock_versions(src, series))
        (work / "README").write_text(f"stand-in for pytorch v{release}: only the files the "
                                     "series touches\n")
        init_repo(work, release)
        for patch, carried in zip(library, per_patch):
            git_am(work, [patch.path])
            author = run_git(["log", "-1", "--format=%an%n%ae%n%aI"], work).stdout.decode()
            last = identity(*author.split("\n")[:3])  # for the amend, and the commits on top
            if carried:
                _commit(work, repo, carried, last, "--amend", "--no-edit")
        for kind, what in (("test", "tests"), ("benchmarks", "benchmarks")):
            rest = [f for f in files[kind] if f not in claimed]
            plan = "\n".join(f"    python {f}" for f in rest if f.endswith(".py") and (
                kind == "benchmarks" or f.rsplit("/", 1)[-1].startswith("test_")))
            if rest:
                _commit(work, repo, rest, last, "-m", REST_COMMIT_MESSAGE.format(
                    kind=what, test_plan=plan or "    (no runnable files)"))
        patches = {f.name: f.read_bytes()
                   for f in format_patches(work, f"v{release}..HEAD", Path(tmp) / "out")}
    outdir.mkdir(parents=True, exist_ok=True)  # only now: a failure leaves OUTDIR as it was
    for old in list(outdir.glob("*.patch")) + [outdir / "series"] if force else []:
        old.unlink(missing_ok=True)
    write_files(outdir, {**patches, "series": "".join(f"{n}\n" for n in patches).encode()})
    log(f"exported {len(patches)} patches to {outdir}:\n{len(library)} library patches with the "
        f"{sum(map(len, per_patch))} files their Test Plans name,\nthen "
        f"{len(patches) - len(library)} commits of the other tests and benchmarks.\n"
        f"On a PyTorch v{release} checkout:  git am --keep-non-patch {outdir}/*.patch")
    return list(patches)
