"""Apply, revert and inspect the patch series on a PyTorch checkout or an installed torch.

Design (see README.md / CONTRIBUTING.md):

* The series is ``torch_patch/patches/series`` plus the ``git format-patch`` files it names.
* A *target* is either a PyTorch checkout (``torch/__init__.py`` and ``.git``) or a directory
  that contains an installed ``torch/`` package (e.g. a venv's site-packages).
* Patching happens in a *staging* copy of the touched files (inside the target's state dir, so
  on the same filesystem); ``git apply`` runs there with repository discovery fenced off, so an
  enclosing git repository (a ``.venv`` inside a clone) can never make it skip files.
* The switch from the old to the new files is journaled: a journal is written, then every file
  is moved into place with ``os.replace``.  A journal left by a killed process is reported by
  ``status`` as ``interrupted`` and resolved by the next ``apply`` (finish) or ``revert``
  (roll back).
* State (series id, sha256 of every touched file before/after, byte copies of the originals)
  lives in ``<root>/.torch-patch/`` for installed torch and ``<git-dir>/torch-patch/`` for a
  checkout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

EXPECTED_TORCH_VERSION = "2.13.0"
PATCHES_DIR = Path(__file__).resolve().parent / "patches"
STATE_FORMAT = 1

# Exit codes (shared by every verb; `status` uses all of them).
EXIT_APPLIED = 0
EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_MODIFIED = 2
EXIT_BASE_MISMATCH = 3
EXIT_INTERRUPTED = 4
EXIT_ERROR = 5

# Test hook: os._exit() after this many files were moved into place (simulates a kill);
# 0 = after staging, before the journal is written.
FAULT_ENV = "TORCH_PATCH_FAULT_AFTER_FILES"
FAULT_EXIT_CODE = 75

Log = Callable[[str], None]


class TorchPatchError(Exception):
    """A user-facing error: one line naming the problem and the fix; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def _print(msg: str) -> None:
    print(msg, flush=True)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else ('es' if word.endswith('h') else 's')}"


# --------------------------------------------------------------------------------------------
# hashing / small file helpers


def sha256_file(path: Path) -> Optional[str]:
    """sha256 hex digest of a file, or None if it does not exist."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") \
                else hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _copy_file(src: Path, dst: Path) -> None:
    """Copy bytes and permission bits (not times: the copy gets a fresh mtime, so .pyc files
    compiled from the previous content are invalidated)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)


def _keep_owner(new: Path, old: Path) -> None:
    """When root patches a tree owned by someone else, keep the files owned by that user."""
    if os.geteuid() != 0:
        return
    ref = old if old.exists() else old.parent
    with contextlib.suppress(OSError):
        st = ref.stat()
        os.chown(new, st.st_uid, st.st_gid)


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise TorchPatchError(f"cannot read {path}: {e}; the torch-patch state is damaged "
                              f"(reinstall torch=={EXPECTED_TORCH_VERSION} and delete {path.parent})")


# --------------------------------------------------------------------------------------------
# git


def git_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for every git call: no user/system config (so output and behaviour do not
    depend on the machine), no inherited repository selection."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("GIT_") and k not in ("GIT_EXEC_PATH",))}
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    env["GIT_TERMINAL_PROMPT"] = "0"
    env["LC_ALL"] = "C"
    env["LANGUAGE"] = "C"
    if extra:
        env.update(extra)
    return env


def require_git() -> str:
    git = shutil.which("git")
    if git is None:
        raise TorchPatchError("git not found on PATH; torch-patch needs git (`git apply`, `git am`): "
                              "install it (e.g. `apt-get install git`) or fix PATH")
    return git


def run_git(args: List[str], cwd: Path, *, env: Optional[Dict[str, str]] = None,
            check: bool = True, input: Optional[bytes] = None) -> subprocess.CompletedProcess:
    git = require_git()
    proc = subprocess.run([git, *args], cwd=cwd, env=env if env is not None else git_env(),
                          input=input, capture_output=True)
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise TorchPatchError(f"`git {' '.join(args)}` failed in {cwd}: {err}")
    return proc


# --------------------------------------------------------------------------------------------
# series


@dataclasses.dataclass
class Patch:
    name: str
    path: Path
    data: bytes
    files: List[str]  # paths touched (relative to the torch checkout root)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclasses.dataclass
class Series:
    dir: Path
    patches: List[Patch]
    id: str

    @property
    def names(self) -> List[str]:
        return [p.name for p in self.patches]

    @property
    def files(self) -> List[str]:
        seen: Dict[str, None] = {}
        for p in self.patches:
            for f in p.files:
                seen.setdefault(f, None)
        return list(seen)


_DIFF_GIT_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def patch_files(text: str) -> List[str]:
    files: Dict[str, None] = {}
    for a, b in _DIFF_GIT_RE.findall(text):
        files.setdefault(a, None)
        files.setdefault(b, None)
    return list(files)


def read_series_names(series_dir: Path) -> List[str]:
    series_file = series_dir / "series"
    try:
        lines = series_file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TorchPatchError(f"no series file at {series_file}; reinstall torch_patch "
                              f"(or pass --series DIR pointing at a directory with a `series` file)")
    names = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def load_series(series_dir: Optional[os.PathLike] = None, *, library_only: bool = True) -> Series:
    """Read ``series`` and the patches it names; ``id`` is a sha256 over names and contents."""
    series_dir = Path(series_dir) if series_dir is not None else PATCHES_DIR
    h = hashlib.sha256()
    patches = []
    for name in read_series_names(series_dir):
        path = series_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise TorchPatchError(f"series names {name} but {path} does not exist; "
                                  f"regenerate the series (`torch-patch dev --export`)")
        text = data.decode("utf-8", errors="replace")
        files = patch_files(text)
        if not files:
            raise TorchPatchError(f"{path} contains no `diff --git` section; it is not a git patch")
        if library_only:
            bad = [f for f in files if not f.startswith("torch/")]
            if bad:
                raise TorchPatchError(f"{name} touches {bad[0]}, outside torch/; library patches may "
                                      f"only change torch/ (tests and benchmarks are added by `export`)")
        patches.append(Patch(name, path, data, files))
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return Series(series_dir, patches, h.hexdigest())


# --------------------------------------------------------------------------------------------
# targets


@dataclasses.dataclass
class Target:
    root: Path
    kind: str  # "checkout" | "installed"
    state_dir: Path

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def journal_file(self) -> Path:
        return self.state_dir / "journal.json"

    @property
    def orig_dir(self) -> Path:
        return self.state_dir / "orig"


def installed_torch_root() -> Optional[Path]:
    """Directory containing the ``torch`` package this interpreter would import (not importing it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).resolve().parent.parent
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    return None


def _in_venv() -> bool:
    return sys.prefix != sys.base_prefix


def _is_within(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(Path(parent).resolve())
        return True
    except ValueError:
        return False


def _git_dir_of(root: Path) -> Path:
    dotgit = root / ".git"
    if dotgit.is_dir():
        return dotgit
    # worktree / submodule: ".git" is a file "gitdir: <path>"
    try:
        content = dotgit.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TorchPatchError(f"cannot read {dotgit}: {e}")
    if content.startswith("gitdir:"):
        p = Path(content[len("gitdir:"):].strip())
        return p if p.is_absolute() else (root / p).resolve()
    raise TorchPatchError(f"{dotgit} is neither a directory nor a `gitdir:` file")


def resolve_target(target: Optional[os.PathLike] = None, *, allow_system: bool = False,
                   require_venv: bool = True) -> Target:
    """Turn the TARGET argument (or the default: this interpreter's torch) into a Target."""
    if target is None:
        root = installed_torch_root()
        if root is None:
            raise TorchPatchError(f"no torch package importable by {sys.executable}; install it "
                                  f"(pip install torch=={EXPECTED_TORCH_VERSION}) or pass TARGET")
        if require_venv and not allow_system:
            if not _in_venv():
                raise TorchPatchError(
                    f"refusing to patch {root}: {sys.executable} is not running in a virtual environment; "
                    f"use a venv (python3 -m venv .venv), pass TARGET explicitly, or pass --allow-system")
            if _is_within(root, sys.base_prefix) and not _is_within(root, sys.prefix):
                raise TorchPatchError(
                    f"refusing to patch {root}: it is the system torch seen through this venv; "
                    f"install torch=={EXPECTED_TORCH_VERSION} into the venv, or pass --allow-system")
    else:
        p = Path(target).expanduser()
        if not p.exists():
            raise TorchPatchError(f"target {p} does not exist; pass a PyTorch checkout or a directory "
                                  f"containing an installed torch/ package (e.g. site-packages)")
        p = p.resolve()
        if (p / "torch" / "__init__.py").is_file():
            root = p
        elif p.name == "torch" and (p / "__init__.py").is_file():
            root = p.parent  # the package directory itself was given
        else:
            raise TorchPatchError(f"target {p} is neither a PyTorch checkout (torch/__init__.py + .git) "
                                  f"nor a directory containing an installed torch/ package; "
                                  f"pass the checkout root or the site-packages directory")
    if (root / ".git").exists() and (root / "torch" / "__init__.py").is_file():
        return Target(root, "checkout", _git_dir_of(root) / "torch-patch")
    return Target(root, "installed", root / ".torch-patch")


_VERSION_PY_RE = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", re.M)


def find_dist_info(root: Path) -> Optional[Path]:
    cands = sorted(root.glob("torch-[0-9]*.dist-info"))
    return cands[-1] if cands else None


def read_torch_version(root: Path) -> Optional[str]:
    vp = root / "torch" / "version.py"
    if vp.is_file():
        m = _VERSION_PY_RE.search(vp.read_text(encoding="utf-8", errors="replace"))
        if m:
            return m.group(1)
    di = find_dist_info(root)
    if di is not None and (di / "METADATA").is_file():
        for line in (di / "METADATA").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
            if not line.strip():
                break
    vt = root / "version.txt"  # a source checkout that was never built
    if vt.is_file():
        return vt.read_text(encoding="utf-8").strip()
    return None


def base_version_ok(version: Optional[str]) -> bool:
    # "2.13.0a0" is what version.txt of an unbuilt checkout of the release branch may say
    return version is not None and version.split("+", 1)[0] in (EXPECTED_TORCH_VERSION,
                                                                EXPECTED_TORCH_VERSION + "a0")


def check_base(t: Target) -> str:
    version = read_torch_version(t.root)
    if version is None:
        raise TorchPatchError(f"cannot tell the torch version at {t.root} (no torch/version.py, "
                              f"torch-*.dist-info/METADATA or version.txt)", EXIT_BASE_MISMATCH)
    if not base_version_ok(version):
        raise TorchPatchError(
            f"base mismatch: found torch {version} at {t.root}, expected {EXPECTED_TORCH_VERSION}; "
            f"install torch=={EXPECTED_TORCH_VERSION} or use a v{EXPECTED_TORCH_VERSION} checkout",
            EXIT_BASE_MISMATCH)
    return version


# --------------------------------------------------------------------------------------------
# state dir / locking


def _not_writable(path: Path, e: OSError) -> TorchPatchError:
    return TorchPatchError(f"target not writable: cannot write in {path} ({e.strerror or e}); "
                           f"run as a user who may write there or use a venv you own")


@contextlib.contextmanager
def _locked(t: Target) -> Iterator[None]:
    """Create the state dir (this is also the writability check) and hold an exclusive lock on it.
    An empty state dir is removed again on exit, so failed or reverted runs leave no trace."""
    created = not t.state_dir.exists()
    try:
        t.state_dir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=t.state_dir)
        probe.close()
    except OSError as e:
        raise _not_writable(t.state_dir.parent if created else t.state_dir, e)
    fd = os.open(t.state_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise TorchPatchError(f"another torch-patch is working on {t.root} (lock on {t.state_dir}); "
                                  f"wait for it to finish")
        _clean_leftovers(t)
        yield
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            if not any(t.state_dir.iterdir()):
                t.state_dir.rmdir()


def _clean_leftovers(t: Target) -> None:
    """Remove what a process killed *before* writing its journal left behind (nothing of it
    reached the target's files)."""
    journal = read_journal(t)
    keep = journal["stage"] if journal else None
    for d in t.state_dir.glob("stage-*"):
        if d.name != keep:
            shutil.rmtree(d, ignore_errors=True)
    for tmp in t.state_dir.glob("*.json.tmp"):
        tmp.unlink(missing_ok=True)
    if journal is None and not t.state_file.exists():
        shutil.rmtree(t.orig_dir, ignore_errors=True)


def _check_dirs_writable(t: Target, rels: List[str]) -> None:
    dirs = {}
    for rel in rels:
        d = (t.root / rel).parent
        while not d.exists():
            d = d.parent
        dirs[d] = None
    for d in dirs:
        try:
            tempfile.TemporaryFile(dir=d).close()
        except OSError as e:
            raise _not_writable(d, e)


def read_state(t: Target) -> Optional[dict]:
    return _read_json(t.state_file)


def read_journal(t: Target) -> Optional[dict]:
    return _read_json(t.journal_file)


def modified_files(t: Target, state: dict) -> List[str]:
    return [rel for rel, rec in sorted(state["files"].items())
            if sha256_file(t.root / rel) != rec["after"]]


# --------------------------------------------------------------------------------------------
# git apply error reporting

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@.*$")


def _hunks_by_file(text: str) -> Dict[str, List[tuple]]:
    hunks: Dict[str, List[tuple]] = {}
    cur = None
    for line in text.splitlines():
        m = _DIFF_GIT_RE.match(line)
        if m:
            cur = m.group(2) if m.group(2) != "/dev/null" else m.group(1)
            hunks.setdefault(cur, [])
            continue
        h = _HUNK_RE.match(line)
        if h and cur is not None:
            hunks[cur].append((int(h.group(1)), line))
    return hunks


def describe_apply_failure(patch: Patch, stderr: str) -> str:
    """Turn git apply's stderr into '<patch>: <file>, hunk #N (<header>)' style text."""
    hunks = _hunks_by_file(patch.text)
    m = re.search(r"patch failed: (.+):(\d+)", stderr)
    if m:
        path, line = m.group(1), int(m.group(2))
        file_hunks = hunks.get(path, [])
        idx = next((i for i, (start, _) in enumerate(file_hunks) if start == line), None)
        if idx is not None:
            header = file_hunks[idx][1]
            ranges, _, context = header[2:].partition("@@")
            hunk = f"hunk #{idx + 1} of {len(file_hunks)} (@@ {ranges.strip()} @@"
            hunk += f", in `{context.strip()}`)" if context.strip() else ")"
        else:
            hunk = f"hunk at line {line}"
        return f"{path}, {hunk} does not match"
    m = re.search(r"error: (\S+): (No such file or directory|does not exist in index)", stderr)
    if m:
        return f"{m.group(1)} is missing"
    m = re.search(r"error: (\S+): already exists in working directory", stderr)
    if m:
        return f"{m.group(1)} already exists (the patch creates it)"
    m = re.search(r"error: (\S+): patch does not apply", stderr)
    if m:
        return f"{m.group(1)} does not match"
    first = next((l for l in stderr.splitlines() if l.strip()), "git apply failed")
    return first.strip()


def _git_apply_in(stage: Path, patch: Patch, *, check: bool, reverse: bool = False) -> subprocess.CompletedProcess:
    """Run git apply in the staging dir, with discovery of any enclosing repository disabled."""
    env = git_env({"GIT_CEILING_DIRECTORIES": str(stage.parent)})
    args = ["apply", "--whitespace=nowarn", "-p1"]
    if check:
        args.append("--check")
    if reverse:
        args.append("--reverse")
    return run_git(args + [str(patch.path)], stage, env=env, check=False)


# --------------------------------------------------------------------------------------------
# journaled commit


def _fault_budget() -> Optional[int]:
    v = os.environ.get(FAULT_ENV)
    return int(v) if v else None


def _commit(t: Target, journal: dict) -> int:
    """Move staged files into place as recorded in the (already written) journal, then write the
    resulting state and drop the journal.  Safe to re-run after a crash at any point."""
    stage = t.state_dir / journal["stage"]
    budget = _fault_budget()
    moved = 0
    for rel, rec in sorted(journal["files"].items()):
        dst = t.root / rel
        cur = sha256_file(dst)
        if cur == rec["after"]:
            continue
        if cur != rec["before"]:
            raise TorchPatchError(
                f"{dst} changed while an interrupted {journal['op']} was pending (sha256 {cur}); "
                f"reinstall torch=={EXPECTED_TORCH_VERSION} and delete {t.state_dir}")
        if rec["after"] is None:
            dst.unlink()
        else:
            src = stage / rel
            if sha256_file(src) != rec["after"]:
                raise TorchPatchError(f"staged copy {src} is missing or damaged; reinstall "
                                      f"torch=={EXPECTED_TORCH_VERSION} and delete {t.state_dir}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            _keep_owner(src, dst)
            os.replace(src, dst)
        moved += 1
        if budget is not None and moved >= budget:
            os._exit(FAULT_EXIT_CODE)  # fault injection for tests: simulate a kill
    if journal["op"] == "apply":
        _write_json_atomic(t.state_file, journal["state"])
    else:
        with contextlib.suppress(FileNotFoundError):
            t.state_file.unlink()
        shutil.rmtree(t.orig_dir, ignore_errors=True)
    t.journal_file.unlink()
    shutil.rmtree(stage, ignore_errors=True)
    return moved


def _rollback_apply(t: Target, journal: dict) -> None:
    """Undo an interrupted apply: put the originals (kept in orig/) back."""
    stage = t.state_dir / journal["stage"]
    for rel, rec in sorted(journal["files"].items()):
        dst = t.root / rel
        cur = sha256_file(dst)
        if cur == rec["before"]:
            continue
        if cur != rec["after"]:
            raise TorchPatchError(f"{dst} changed while an interrupted apply was pending; reinstall "
                                  f"torch=={EXPECTED_TORCH_VERSION} and delete {t.state_dir}")
        if rec["before"] is None:
            dst.unlink()
            continue
        tmp = stage / (rel + ".rollback")
        _copy_file(t.orig_dir / rel, tmp)
        if sha256_file(tmp) != rec["before"]:
            raise TorchPatchError(f"saved original {t.orig_dir / rel} is damaged; reinstall "
                                  f"torch=={EXPECTED_TORCH_VERSION} and delete {t.state_dir}")
        _keep_owner(tmp, dst)
        os.replace(tmp, dst)
    t.journal_file.unlink()
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(t.orig_dir, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        t.state_file.unlink()


def _resolve_journal(t: Target, journal: dict, want: str, log: Log) -> None:
    done = sum(1 for rel, rec in journal["files"].items() if sha256_file(t.root / rel) == rec["after"])
    total = len(journal["files"])
    if journal["op"] == "apply" and want == "revert":
        log(f"rolling back interrupted apply ({done} of {total} files had been replaced)")
        _rollback_apply(t, journal)
    else:
        log(f"finishing interrupted {journal['op']} ({done} of {total} files had been replaced)")
        _commit(t, journal)


# --------------------------------------------------------------------------------------------
# verbs


def _new_stage(t: Target) -> Path:
    return Path(tempfile.mkdtemp(prefix="stage-", dir=t.state_dir))


def _series_already_present(t: Target, series: Series) -> bool:
    """True if the target's files already contain the whole series (e.g. a checkout where it
    was committed with `git am`): every patch reverse-applies, last to first."""
    stage = _new_stage(t)
    try:
        for rel in series.files:
            if (t.root / rel).exists():
                _copy_file(t.root / rel, stage / rel)
        for p in reversed(series.patches):
            if _git_apply_in(stage, p, check=False, reverse=True).returncode != 0:
                return False
        return True
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _apply_series(t: Target, series: Series, version: str, log: Log) -> dict:
    rels = series.files
    _check_dirs_writable(t, rels)
    stage = _new_stage(t)
    try:
        before = {}
        for rel in rels:
            src = t.root / rel
            before[rel] = sha256_file(src)
            if before[rel] is not None:
                _copy_file(src, stage / rel)
        n = len(series.patches)
        log(f"checking {_n(n, 'patch')} against {t.root} ({t.kind})…")
        for p in series.patches:
            for check in (True, False):
                proc = _git_apply_in(stage, p, check=check)
                if proc.returncode != 0:
                    if _series_already_present(t, series):
                        log(f"the series is already contained in the files of {t.root} (applied without "
                            f"torch-patch, e.g. committed with `git am`); nothing to do")
                        shutil.rmtree(stage, ignore_errors=True)
                        return {}
                    why = describe_apply_failure(p, proc.stderr.decode(errors="replace"))
                    raise TorchPatchError(
                        f"patch {p.name} does not apply to {t.root}: {why}; the target is not stock "
                        f"torch {EXPECTED_TORCH_VERSION} there (edited by hand, or patched by other means?) "
                        f"— nothing was changed")
            log(f"  ok {p.name} ({_n(len(p.files), 'file')})")
        after = {rel: sha256_file(stage / rel) for rel in rels}
        unchanged = [rel for rel in rels if after[rel] == before[rel]]
        if unchanged:
            raise TorchPatchError(f"git apply left {', '.join(unchanged)} unchanged although the series "
                                  f"touches it; nothing was changed (please report this)")
        shutil.rmtree(t.orig_dir, ignore_errors=True)
        for rel in rels:
            if before[rel] is not None:
                _copy_file(t.root / rel, t.orig_dir / rel)
                if sha256_file(t.orig_dir / rel) != before[rel]:
                    raise TorchPatchError(f"{t.root / rel} changed while being patched; retry")
        files = {rel: {"before": before[rel], "after": after[rel]} for rel in rels}
        state = {"format": STATE_FORMAT, "series_id": series.id, "patches": series.names,
                 "torch_version": version, "kind": t.kind, "files": files}
        journal = {"op": "apply", "stage": stage.name, "files": files, "state": state}
        if _fault_budget() == 0:
            os._exit(FAULT_EXIT_CODE)  # fault injection: killed after staging, before the journal
        _write_json_atomic(t.journal_file, journal)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if not t.journal_file.exists():
            shutil.rmtree(t.orig_dir, ignore_errors=True)
        raise
    _commit(t, journal)
    log(f"applied {_n(n, 'patch')} ({_n(len(rels), 'file')}) to {t.root}")
    return state


def _revert_state(t: Target, state: dict, force: bool, log: Log) -> None:
    modified = modified_files(t, state)
    if modified and not force:
        raise TorchPatchError(
            f"refusing to revert: edited after apply: {', '.join(modified)} (in {t.root}); save your "
            f"edits elsewhere, then rerun with --force to restore the originals", EXIT_MODIFIED)
    if modified:
        log(f"--force: discarding edits to {', '.join(modified)}")
    _check_dirs_writable(t, list(state["files"]))
    stage = _new_stage(t)
    try:
        files = {}
        for rel, rec in sorted(state["files"].items()):
            if rec["before"] is not None:
                src = t.orig_dir / rel
                if sha256_file(src) != rec["before"]:
                    raise TorchPatchError(f"saved original {src} is missing or damaged; reinstall "
                                          f"torch=={EXPECTED_TORCH_VERSION} (pip install --force-reinstall) "
                                          f"and delete {t.state_dir}")
                _copy_file(src, stage / rel)
            files[rel] = {"before": sha256_file(t.root / rel), "after": rec["before"]}
        journal = {"op": "revert", "stage": stage.name, "files": files}
        _write_json_atomic(t.journal_file, journal)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _commit(t, journal)
    bad = [rel for rel, rec in state["files"].items() if sha256_file(t.root / rel) != rec["before"]]
    if bad:
        raise TorchPatchError(f"after revert, {', '.join(bad)} do not match the originals (sha256)")
    log(f"reverted {_n(len(state['patches']), 'patch')} ({_n(len(state['files']), 'file')}) in {t.root}; "
        f"sha256 of every file matches the original")


def apply(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None,
          allow_system: bool = False, reapply: bool = False, force: bool = False,
          log: Log = _print) -> dict:
    """Apply the series to TARGET (default: the torch imported by this interpreter).

    All patches are checked and applied in a staging copy first; the target's files are then
    switched over with a journal, so the result is either untouched or fully applied.
    Returns the recorded state (dict).  Raises TorchPatchError (``.code`` = exit code).
    """
    series = load_series(series_dir)
    t = resolve_target(target, allow_system=allow_system)
    version = check_base(t)
    require_git()
    with _locked(t):
        journal = read_journal(t)
        if journal is not None:
            _resolve_journal(t, journal, "apply", log)
        state = read_state(t)
        if state is not None:
            if state["series_id"] == series.id:
                mod = modified_files(t, state)
                note = f" (note: edited after apply: {', '.join(mod)})" if mod else ""
                log(f"already applied ({', '.join(state['patches'])}) to {t.root}; nothing to do{note}")
                return state
            if not reapply:
                raise TorchPatchError(
                    f"a different series is already applied to {t.root} ({', '.join(state['patches'])}); "
                    f"run `torch-patch revert` first, or `torch-patch apply --reapply`")
            log("--reapply: reverting the series applied before")
            _revert_state(t, state, force, log)
        if not series.patches:
            log(f"the series in {series.dir} is empty; nothing to apply")
            return {}
        return _apply_series(t, series, version, log)


def revert(target: Optional[os.PathLike] = None, *, force: bool = False, allow_system: bool = False,
           log: Log = _print) -> None:
    """Restore the byte-identical originals recorded by ``apply`` (verified by sha256).

    Refuses (exit code 2) if a patched file was edited after apply, unless ``force``.
    """
    t = resolve_target(target, allow_system=allow_system)
    check_base(t)
    if not t.state_dir.exists():
        log(f"not applied to {t.root}; nothing to revert")
        return
    with _locked(t):
        journal = read_journal(t)
        if journal is not None:
            _resolve_journal(t, journal, "revert", log)
        state = read_state(t)
        if state is None:
            if journal is None:
                log(f"not applied to {t.root}; nothing to revert")
            return
        _revert_state(t, state, force, log)


@dataclasses.dataclass
class Status:
    code: int
    state: str  # applied | not applied | modified after apply | interrupted | base mismatch
    message: str
    target: str
    kind: str
    torch_version: Optional[str]
    patches: List[str]
    modified_files: List[str]
    series_current: Optional[bool]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["expected_torch_version"] = EXPECTED_TORCH_VERSION
        return d


def status(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None) -> Status:
    """Report the patch state of TARGET without changing anything (see EXIT_* for codes)."""
    t = resolve_target(target, require_venv=False)
    version = read_torch_version(t.root)

    def mk(code, state, message, patches=(), modified=(), current=None):
        return Status(code, state, message, str(t.root), t.kind, version, list(patches), list(modified),
                      current)

    if not base_version_ok(version):
        return mk(EXIT_BASE_MISMATCH, "base mismatch",
                  f"base mismatch: found torch {version or 'unknown'}, expected {EXPECTED_TORCH_VERSION}")
    journal = read_journal(t)
    if journal is not None:
        done = sum(1 for rel, rec in journal["files"].items() if sha256_file(t.root / rel) == rec["after"])
        total = len(journal["files"])
        names = journal.get("state", {}).get("patches", [])
        if journal["op"] == "apply":
            msg = (f"interrupted (apply of {', '.join(names)}: {done} of {total} files replaced; "
                   f"`torch-patch apply` finishes it, `torch-patch revert` rolls it back)")
        else:
            msg = (f"interrupted (revert: {done} of {total} files restored; "
                   f"`torch-patch revert` or `torch-patch apply` finishes it)")
        return mk(EXIT_INTERRUPTED, "interrupted", msg, names)
    state = read_state(t)
    if state is None:
        return mk(EXIT_NOT_APPLIED, "not applied", "not applied")
    current = None
    with contextlib.suppress(TorchPatchError):
        current = load_series(series_dir).id == state["series_id"]
    mod = modified_files(t, state)
    if mod:
        return mk(EXIT_MODIFIED, "modified after apply", f"modified after apply ({', '.join(mod)})",
                  state["patches"], mod, current)
    msg = f"applied ({', '.join(state['patches'])})"
    if current is False:
        msg += " — an older/different series than this torch_patch ships; `torch-patch apply --reapply`"
    return mk(EXIT_APPLIED, "applied", msg, state["patches"], (), current)


# --------------------------------------------------------------------------------------------
# stock files (used by dev and export)


def load_record(root: Path) -> Dict[str, str]:
    """rel path -> sha256 hex from the torch wheel's dist-info RECORD (torch/ entries only)."""
    di = find_dist_info(root)
    if di is None or not (di / "RECORD").is_file():
        raise TorchPatchError(f"no torch-*.dist-info/RECORD in {root}; cannot verify stock files "
                              f"(point --from at a pip-installed torch=={EXPECTED_TORCH_VERSION})")
    import base64
    import csv
    out = {}
    with open(di / "RECORD", newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0].startswith("torch/") and row[1].startswith("sha256="):
                b64 = row[1][len("sha256="):]
                out[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return out


def stock_file(t: Target, rel: str, record: Optional[Dict[str, str]] = None) -> Optional[Path]:
    """Path of the stock (unpatched) copy of ``rel`` in target ``t``: the original saved by
    ``apply`` if the file is patched, else the file itself.  None if stock torch has no such file.
    Verified against RECORD when given."""
    state = read_state(t)
    if state is not None and rel in state["files"]:
        if state["files"][rel]["before"] is None:
            return None
        path = t.orig_dir / rel
    else:
        path = t.root / rel
        if not path.exists():
            return None
    if record is not None and rel in record and sha256_file(path) != record[rel]:
        raise TorchPatchError(f"{path} is not the stock torch {EXPECTED_TORCH_VERSION} file (sha256 differs "
                              f"from the wheel's RECORD); pip install --force-reinstall torch=={EXPECTED_TORCH_VERSION}")
    return path
