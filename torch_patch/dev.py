"""The dev tree: a git work tree of the stock torch package with the series as commits.

``dev_create(DIR)`` copies the installed torch package (stock files, verified against the wheel's
RECORD) into ``DIR/torch``, tracks only ``*.py`` in git, commits it as ``v2.13.0`` with a fixed
identity and date, and ``git am``s the series on top, so ``PYTHONPATH=DIR python`` imports the
patched torch.  ``dev_export(DIR)`` turns ``v2.13.0..HEAD`` back into ``torch_patch/patches/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from .core import (EXPECTED_TORCH_VERSION, PATCHES_DIR, Log, TorchPatchError, _print, check_base,
                   git_env, load_record, load_series, patch_files, read_series_names, require_git,
                   resolve_target, run_git, sha256_file, stock_files)

BASE_TAG = f"v{EXPECTED_TORCH_VERSION}"
BASE_MESSAGE = f"PyTorch {BASE_TAG} (python sources of the torch=={EXPECTED_TORCH_VERSION} wheel)"
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
    series = load_series(series_dir)
    src = resolve_target(source, require_venv=False)
    check_base(src)
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
                f"{len(bad)} file(s) in {src.root} are not stock torch {EXPECTED_TORCH_VERSION} "
                f"(sha256 differs from the wheel's RECORD), e.g. {', '.join(bad[:3])}; "
                f"pip install --force-reinstall torch=={EXPECTED_TORCH_VERSION}")
        if unlisted:
            log(f"note: {len(unlisted)} .py file(s) not listed in RECORD, e.g. {unlisted[0]}")
        (dev_dir / ".gitignore").write_text(DEV_GITIGNORE, encoding="utf-8")
        env = git_env(FIXED_IDENTITY)
        run_git(["-c", "init.defaultBranch=main", "init", "-q"], dev_dir, env=env)
        _git_commit_all(dev_dir, BASE_MESSAGE)
        run_git(["tag", BASE_TAG], dev_dir, env=env)
        git_am(dev_dir, [p.path for p in series.patches])
    except BaseException:
        if created:
            shutil.rmtree(dev_dir, ignore_errors=True)
        raise
    log(f"dev tree ready at {dev_dir}: {BASE_TAG} + {len(series.patches)} patch(es) as commits")
    log(f"  edit and test:  PYTHONPATH={dev_dir} python -c 'import torch; print(torch.__file__)'")
    log(f"  then commit there and run:  torch-patch dev --export {dev_dir}")
    return dev_dir


def default_patches_dir() -> Path:
    """torch_patch/patches of this source checkout (refuse to write into an installed copy)."""
    if not (PATCHES_DIR.parent.parent / "setup.py").is_file():
        raise TorchPatchError(f"{PATCHES_DIR} is not inside a torch_patch source checkout (no setup.py "
                              f"next to the package); install with `pip install -e` or pass --patches-dir")
    return PATCHES_DIR


def dev_export(dev_dir: Optional[os.PathLike] = None, *, patches_dir: Optional[os.PathLike] = None,
               log: Log = _print) -> List[str]:
    """Regenerate ``patches_dir`` (default: torch_patch/patches of this checkout) from
    ``git format-patch v2.13.0..HEAD`` in the dev tree.  Returns the new series names."""
    if dev_dir is None:
        dev_dir = os.environ.get(DEV_ENV)
        if not dev_dir:
            raise TorchPatchError(f"no dev tree given: pass DIR or set {DEV_ENV}")
    dev_dir = Path(dev_dir).expanduser().resolve()
    require_git()
    if not (dev_dir / ".git").exists():
        raise TorchPatchError(f"{dev_dir} is not a dev tree (no .git); create one with `torch-patch dev DIR`")
    if run_git(["rev-parse", "-q", "--verify", f"{BASE_TAG}^{{commit}}"], dev_dir, check=False).returncode:
        raise TorchPatchError(f"{dev_dir} has no tag {BASE_TAG}; it is not a dev tree made by `torch-patch dev`")
    if run_git(["merge-base", "--is-ancestor", BASE_TAG, "HEAD"], dev_dir, check=False).returncode:
        raise TorchPatchError(f"HEAD of {dev_dir} does not descend from {BASE_TAG}; rebase onto {BASE_TAG}")
    dirty = run_git(["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], dev_dir).stdout.decode().splitlines()
    if dirty:
        raise TorchPatchError(f"{dev_dir} has uncommitted changes to tracked files "
                              f"({', '.join(l[3:] for l in dirty[:5])}); commit or stash them first")
    out = Path(patches_dir).resolve() if patches_dir is not None else default_patches_dir()
    with tempfile.TemporaryDirectory(prefix="torch-patch-export-") as tmp:
        files = format_patches(dev_dir, f"{BASE_TAG}..HEAD", Path(tmp))
        new: Dict[str, bytes] = {}
        for f in files:
            data = f.read_bytes()
            outside = [p for p in patch_files(data.decode(errors="replace")) if not p.startswith("torch/")]
            if outside:
                raise TorchPatchError(f"commit {f.name} touches {outside[0]}, outside torch/; library "
                                      f"patches may only change torch/ (tests live in this repo's test/)")
            new[f.name] = data
    out.mkdir(parents=True, exist_ok=True)
    changed = 0
    for name, data in new.items():
        path = out / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            changed += 1
    removed = [p.name for p in sorted(out.glob("*.patch")) if p.name not in new]
    for name in removed:
        (out / name).unlink()
    series_text = "".join(f"{n}\n" for n in new)
    series_path = out / "series"
    if not series_path.exists() or series_path.read_text(encoding="utf-8") != series_text:
        series_path.write_text(series_text, encoding="utf-8")
    log(f"exported {len(new)} patch(es) from {dev_dir} to {out} "
        f"({changed} written, {len(removed)} removed{': ' + ', '.join(removed) if removed else ''})")
    return list(new)


__all__ = ["dev_create", "dev_export", "BASE_TAG", "FORMAT_PATCH_OPTS", "read_series_names"]
