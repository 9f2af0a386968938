"""The dev tree: a git work tree of the stock torch package with the series as commits.

``dev_create(DIR)`` copies the installed torch package (stock files, verified against the wheel's
RECORD) into ``DIR/torch``, tracks only ``*.py`` in git, commits it as ``v<its release>`` (e.g.
``v2.14.1``) with a fixed identity and date, and ``git am``s the series of that release line on
top, so ``PYTHONPATH=DIR python`` imports the patched torch.  ``dev_export(DIR)`` turns
``v<release>..HEAD`` back into ``torch_patch/patches/<line>/``; a patch that is the same as a
patch of an earlier line but for its line numbers and blob hashes is not written again: the
series names that line's file (``../2.13/NAME``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from .core import (PATCHES_DIR, RELEASE_LINES, Log, TorchPatchError, _print,
                   check_base, git_env, load_record, load_series, patch_files, read_series_names,
                   release_line, release_of, require_git, resolve_target, run_git, series_dir_for,
                   sha256_file, stock_files)


def base_tag(release: str) -> str:
    """The tag of the stock commit of a dev tree of torch ``release`` ("2.14.1" -> "v2.14.1")."""
    return f"v{release}"


def base_message(release: str) -> str:
    return f"PyTorch v{release} (python sources of the torch=={release} wheel)"


DEV_GITIGNORE = "*\n!*/\n!*.py\n!.gitignore\n"
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "torch-patch",
    "GIT_AUTHOR_EMAIL": "torch-patch@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "torch-patch",
    "GIT_COMMITTER_EMAIL": "torch-patch@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
DEV_ENV = "TORCH_PATCH_DEV"

# `git format-patch` options chosen so that the same commits always give the same bytes,
# whatever the machine, git config or terminal:
#   --zero-commit     "From 0000… Mon Sep 17 00:00:00 2001" instead of the commit hash (which
#                     changes with the committer date / parent)
#   --no-signature    no "-- \n2.39.5" git version trailer
#   --full-index      full blob hashes in "index" lines (independent of core.abbrev)
#   --no-numbered     "[PATCH]" subjects, so adding a patch does not rewrite every other one
#   --no-renames, --diff-algorithm=myers, --src/dst-prefix, --no-relative, --no-thread,
#   --no-cover-letter, --encode-email-headers: pin what config could otherwise change.
# Git itself is run with GIT_CONFIG_GLOBAL=/dev/null and GIT_CONFIG_NOSYSTEM=1 (see git_env).
FORMAT_PATCH_OPTS = [
    "format-patch", "--zero-commit", "--no-signature", "--full-index", "--no-numbered",
    "--no-renames", "--diff-algorithm=myers", "--src-prefix=a/", "--dst-prefix=b/", "--no-relative",
    "--no-thread", "--no-cover-letter", "--encode-email-headers", "--no-color",
]


def _git_commit_all(repo: Path, message: str, identity: Optional[Dict[str, str]] = None) -> None:
    env = git_env(identity or FIXED_IDENTITY)
    run_git(["add", "-A", "."], repo, env=env)
    run_git(["commit", "-q", "--no-verify", "-m", message], repo, env=env)


def git_am(repo: Path, patches: List[Path]) -> None:
    """`git am` patches with committer = fixed identity and committer date = author date, so the
    resulting commit hashes only depend on the patches and the base.  ``--keep-non-patch`` keeps a
    subject prefix such as ``[pytree]`` (plain `git am` strips every leading ``[...]``), so that
    exporting the commits again gives the same patch files."""
    env = git_env(FIXED_IDENTITY)
    for p in patches:
        proc = run_git(["am", "-q", "--committer-date-is-author-date", "--keep-cr", "--keep-non-patch",
                        str(p)], repo, env=env, check=False)
        if proc.returncode != 0:
            run_git(["am", "--abort"], repo, env=env, check=False)
            raise TorchPatchError(f"`git am {p.name}` failed in {repo}: "
                                  f"{proc.stderr.decode(errors='replace').strip().splitlines()[0]}")


def format_patches(repo: Path, rev_range: str, outdir: Path) -> List[Path]:
    proc = run_git([*FORMAT_PATCH_OPTS, "-o", str(outdir), rev_range], repo)
    return [Path(line) for line in proc.stdout.decode().splitlines() if line.strip()]


def _ignore_pycache(_dir, names):
    return [n for n in names if n == "__pycache__"]


def dev_create(dev_dir: os.PathLike, *, source: Optional[os.PathLike] = None,
               series_dir: Optional[os.PathLike] = None, log: Log = _print) -> Path:
    """Create the dev tree DIR from the installed torch (``source``: its site-packages dir;
    default: the torch this interpreter imports).  Returns DIR."""
    dev_dir = Path(dev_dir).expanduser().resolve()
    if dev_dir.exists() and any(dev_dir.iterdir()):
        raise TorchPatchError(f"{dev_dir} exists and is not empty; pass a new directory")
    require_git()
    src = resolve_target(source, require_venv=False)
    release = release_of(check_base(src))
    series = load_series(series_dir, line=release_line(release))
    record = load_record(src.root)
    # the installed torch may be patched: which files, and where their stock bytes are, is
    # decided from the files (the originals saved by apply, or the files themselves)
    stock = stock_files(src, None, series=series)
    created = not dev_dir.exists()
    try:
        log(f"copying {src.root / 'torch'} to {dev_dir / 'torch'} (stock files, no __pycache__)…")
        shutil.copytree(src.root / "torch", dev_dir / "torch", ignore=_ignore_pycache, symlinks=True,
                        dirs_exist_ok=True)
        # put the stock originals back where the installed torch is patched
        for rel, path in stock.items():
            dst = dev_dir / rel
            if path is None:
                dst.unlink(missing_ok=True)
            elif path != src.root / rel:
                shutil.copyfile(path, dst)
        bad, unlisted = [], []
        for path in sorted((dev_dir / "torch").rglob("*.py")):
            rel = path.relative_to(dev_dir).as_posix()
            if rel not in record:
                unlisted.append(rel)
            elif sha256_file(path) != record[rel]:
                bad.append(rel)
        if bad:
            raise TorchPatchError(
                f"{len(bad)} file(s) in {src.root} are not stock torch {release} "
                f"(sha256 differs from the wheel's RECORD), e.g. {', '.join(bad[:3])}; "
                f"pip install --force-reinstall torch=={release}")
        if unlisted:
            log(f"note: {len(unlisted)} .py file(s) not listed in RECORD, e.g. {unlisted[0]}")
        (dev_dir / ".gitignore").write_text(DEV_GITIGNORE, encoding="utf-8")
        env = git_env(FIXED_IDENTITY)
        run_git(["-c", "init.defaultBranch=main", "init", "-q"], dev_dir, env=env)
        _git_commit_all(dev_dir, base_message(release))
        run_git(["tag", base_tag(release)], dev_dir, env=env)
        git_am(dev_dir, [p.path for p in series.patches])
    except BaseException:
        if created:
            shutil.rmtree(dev_dir, ignore_errors=True)
        raise
    log(f"dev tree ready at {dev_dir}: {base_tag(release)} + {len(series.patches)} patch(es) of "
        f"{series.dir} as commits")
    log(f"  edit and test:  PYTHONPATH={dev_dir} python -c 'import torch; print(torch.__file__)'")
    log(f"  then commit there and run:  torch-patch dev --export {dev_dir}")
    return dev_dir


def default_patches_dir(line: Optional[str] = None) -> Path:
    """torch_patch/patches/<line> of this source checkout (refuse to write into an installed copy)."""
    if not (PATCHES_DIR.parent.parent / "setup.py").is_file():
        raise TorchPatchError(f"{PATCHES_DIR} is not inside a torch_patch source checkout (no setup.py "
                              f"next to the package); install with `pip install -e` or pass --patches-dir")
    return series_dir_for(line)


def _dev_base_tag(dev_dir: Path) -> str:
    """The ``v<release>`` tag of a dev tree's stock commit (of a supported release line)."""
    tags = run_git(["tag", "--list", "v*", "--merged", "HEAD"], dev_dir).stdout.decode().split()
    roots = set(run_git(["rev-list", "--max-parents=0", "HEAD"], dev_dir).stdout.decode().split())
    for tag in tags:
        commit = run_git(["rev-parse", f"{tag}^{{commit}}"], dev_dir).stdout.decode().strip()
        if commit in roots and release_line(tag[1:]) is not None:
            return tag
    lines = ", ".join(f"v{r}" for r in RELEASE_LINES.values())
    raise TorchPatchError(f"{dev_dir} has no tag of a supported release (e.g. {lines}) on its first "
                          f"commit; it is not a dev tree made by `torch-patch dev`")


_INDEX_LINE = re.compile(rb"^index [0-9a-f]+\.\.[0-9a-f]+(?: \d+)?\n", re.M)
_HUNK_HEADER = re.compile(rb"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@.*\n", re.M)


def same_change(a: bytes, b: bytes) -> bool:
    """Whether two patches are the same change (message, files, context and lines) and differ at
    most in their blob hashes and line numbers, so that one applies wherever the other does."""
    def norm(data: bytes) -> bytes:
        return _HUNK_HEADER.sub(b"@@\n", _INDEX_LINE.sub(b"", data))
    return norm(a) == norm(b)


def _shared_entry(name: str, data: bytes, out: Path) -> Optional[str]:
    """``../<line>/<name>`` if an earlier release line next to ``out`` has a file ``name`` that is
    the same change as ``data``; None otherwise.  Only files count (not entries that are
    themselves shared), so every shared entry names a file."""
    if out.name not in RELEASE_LINES:
        return None
    for line in RELEASE_LINES:
        if line == out.name:
            return None
        other = out.parent / line / name
        if other.is_file() and same_change(other.read_bytes(), data):
            return f"../{line}/{name}"
    return None


def dev_export(dev_dir: Optional[os.PathLike] = None, *, patches_dir: Optional[os.PathLike] = None,
               log: Log = _print) -> List[str]:
    """Regenerate ``patches_dir`` (default: torch_patch/patches/<line> of this checkout, the line
    of the dev tree's ``v<release>`` tag) from ``git format-patch v<release>..HEAD`` in the dev
    tree.  Returns the new patch names."""
    if dev_dir is None:
        dev_dir = os.environ.get(DEV_ENV)
        if not dev_dir:
            raise TorchPatchError(f"no dev tree given: pass DIR or set {DEV_ENV}")
    dev_dir = Path(dev_dir).expanduser().resolve()
    require_git()
    if not (dev_dir / ".git").exists():
        raise TorchPatchError(f"{dev_dir} is not a dev tree (no .git); create one with `torch-patch dev DIR`")
    if run_git(["rev-parse", "-q", "--verify", "HEAD"], dev_dir, check=False).returncode:
        raise TorchPatchError(f"{dev_dir} has no commits; it is not a dev tree made by `torch-patch dev`")
    tag = _dev_base_tag(dev_dir)
    dirty = run_git(["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], dev_dir).stdout.decode().splitlines()
    if dirty:
        raise TorchPatchError(f"{dev_dir} has uncommitted changes to tracked files "
                              f"({', '.join(l[3:] for l in dirty[:5])}); commit or stash them first")
    line = release_line(tag[1:])
    out = Path(patches_dir).resolve() if patches_dir is not None else default_patches_dir(line)
    with tempfile.TemporaryDirectory(prefix="torch-patch-export-") as tmp:
        files = format_patches(dev_dir, f"{tag}..HEAD", Path(tmp))
        new: Dict[str, bytes] = {}
        for f in files:
            data = f.read_bytes()
            outside = [p for p in patch_files(data.decode(errors="replace")) if not p.startswith("torch/")]
            if outside:
                raise TorchPatchError(f"commit {f.name} touches {outside[0]}, outside torch/; library "
                                      f"patches may only change torch/ (tests live in this repo's test/)")
            new[f.name] = data
    out.mkdir(parents=True, exist_ok=True)
    entries = {name: _shared_entry(name, data, out) or name for name, data in new.items()}
    changed = 0
    for name, data in new.items():
        path = out / name
        if entries[name] == name and (not path.exists() or path.read_bytes() != data):
            path.write_bytes(data)
            changed += 1
    removed = [p.name for p in sorted(out.glob("*.patch")) if entries.get(p.name) != p.name]
    for name in removed:
        (out / name).unlink()
    shared = [e for e in entries.values() if "/" in e]
    series_text = "".join(f"{e}\n" for e in entries.values())
    series_path = out / "series"
    if not series_path.exists() or series_path.read_text(encoding="utf-8") != series_text:
        series_path.write_text(series_text, encoding="utf-8")
    log(f"exported {len(new)} patch(es) from {dev_dir} ({tag}..HEAD) to {out} "
        f"({changed} written, {len(shared)} shared with an earlier release line, {len(removed)} removed"
        f"{': ' + ', '.join(removed) if removed else ''})")
    return list(new)


__all__ = ["dev_create", "dev_export", "FORMAT_PATCH_OPTS", "read_series_names", "base_tag", "same_change"]
