"""Apply, revert and inspect the patch series on a PyTorch checkout or an installed torch.

Design (see README.md / CONTRIBUTING.md):

* The series is ``torch_patch/patches/series`` plus the ``git format-patch`` files it names.
* A *target* is either a PyTorch checkout (``torch/__init__.py`` and ``.git``) or a directory
  that contains an installed ``torch/`` package (e.g. a venv's site-packages).
* **The files are the truth.**  Every verb starts by examining the files the series touches
  (``_Exam``): each one is *stock*, *patched* or *other*, decided from its bytes: equal to what
  torch-patch wrote or to the original it saved, equal to the wheel's ``RECORD`` entry, or else
  by ``git apply`` / ``git apply --reverse`` of that file's part of every patch
  (``--include=<file>``) in a private copy.  The records in the state dir are only a cache of
  sha256 sums and the store of the byte-identical originals; records that no longer match the
  files (torch reinstalled, ``git checkout .``) are stale and ignored.  So a series committed
  with ``git am`` or applied with plain ``git apply`` is reported as applied, and a reinstalled
  torch as not applied.
* Patching happens in a *staging* copy inside the target's state dir (so on the same
  filesystem); ``git apply`` runs there with repository discovery fenced off, so an enclosing
  git repository (a ``.venv`` inside a clone) can never make it skip files.
* The switch from the old to the new files is journaled: a journal is written, then every file
  is moved into place with ``os.replace``.  A journal left by a killed process is reported by
  ``status`` as ``interrupted`` and resolved by the next ``apply`` (finish) or ``revert``
  (roll back).  SIGINT and SIGTERM are held back while the switch runs.
* One torch-patch at a time per target: an exclusive ``flock`` on the target's root directory
  (a checkout: its git dir), a directory the tool never creates or removes; ``status`` takes it
  shared, so it never reports a switch in progress as ``interrupted``.
* State (series id, sha256 of every touched file before/after, byte copies of the originals)
  lives in ``<root>/.torch-patch/`` for installed torch and ``<git-dir>/torch-patch/`` for a
  checkout.  It is untrusted input (root may run the tool on a tree another user owns): the
  state and the journal are validated before use, and records of a third user are refused
  (see "the state dir's files" below).
* After a switch, the ``__pycache__`` bytecode of the changed ``.py`` files is written with the
  target's interpreter (``_write_bytecode``); bytecode is not part of the state.
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
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

# The PyTorch release lines with a series, and the release each was generated from (its dev
# tree's base). A target of another patch release of a line gets that line's series, if its files
# take it.
RELEASE_LINES: Dict[str, str] = {"2.13": "2.13.0", "2.14": "2.14.1", "2.15": "2.15.0"}
DEFAULT_LINE = "2.13"  # for messages that name no target
EXPECTED_TORCH_VERSION = RELEASE_LINES[DEFAULT_LINE]
# One directory per release line (patches/2.13/series, ...). A series entry may name a patch of
# another line (`../2.13/0002-....patch`) that applies unchanged: one file, not a copy per line.
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
# Test hook: send this process SIGINT (a real Ctrl-C) after this many files were moved into
# place; 0 = while staging, before the journal is written.
SIGINT_ENV = "TORCH_PATCH_SIGINT_AFTER_FILES"
# Seconds to wait for another torch-patch working on the same target (default 600).
LOCK_TIMEOUT_ENV = "TORCH_PATCH_LOCK_TIMEOUT"
EXIT_SIGINT = 130  # Ctrl-C (the CLI says what state the target was left in)

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
    """Write ``path`` via a fresh ``<name>.tmp`` and ``os.replace``.  The temporary file is
    created with O_EXCL | O_NOFOLLOW, so a planted ``.tmp`` symlink is never written through,
    and it is removed again if writing fails (disk full), so the old file stays as it was."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
        raise TorchPatchError(f"cannot read {path}: {e}; the torch-patch state is damaged: remove {path} "
                              f"(the files themselves tell whether the series is applied)")


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
    creates: List[str] = dataclasses.field(default_factory=list)  # files this patch adds

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

    def patches_for(self, rel: str) -> List[Patch]:
        return [p for p in self.patches if rel in p.files]

    def creates(self, rel: str) -> bool:
        """True if stock torch has no ``rel``: the first patch that touches it creates it."""
        first = next(iter(self.patches_for(rel)), None)
        return first is not None and rel in first.creates


_DIFF_GIT_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def created_files(text: str) -> List[str]:
    """Paths that the patch adds (their section has ``--- /dev/null``)."""
    out = []
    for section in re.split(r"^(?=diff --git )", text, flags=re.M):
        m = _DIFF_GIT_RE.match(section)
        if m and re.search(r"^--- /dev/null$", section, re.M):
            out.append(m.group(2))
    return out


def patch_files(text: str) -> List[str]:
    files: Dict[str, None] = {}
    for a, b in _DIFF_GIT_RE.findall(text):
        files.setdefault(a, None)
        files.setdefault(b, None)
    return list(files)


def release_line(version: Optional[str]) -> Optional[str]:
    """The supported release line of a torch version ("2.14" for "2.14.1+cu130", "2.14.0" or
    "2.14.0a0"), or None."""
    m = re.match(r"(\d+)\.(\d+)\.\d+", version or "")
    line = f"{m.group(1)}.{m.group(2)}" if m else None
    return line if line in RELEASE_LINES else None


def release_of(version: str) -> str:
    """The release as x.y.z: "2.14.1" for "2.14.1+cu130", "2.13.0" for "2.13.0a0"."""
    m = re.match(r"\d+\.\d+\.\d+", version)
    return m.group(0) if m else version.split("+", 1)[0]


def series_dir_for(line: Optional[str]) -> Path:
    """The shipped series of a release line (default: the 2.13 line)."""
    return PATCHES_DIR / (line or DEFAULT_LINE)


def supported_releases() -> str:
    """"torch 2.13 (2.13.0), 2.14 (2.14.1) or 2.15 (2.15.0)", for messages."""
    items = [f"{line} ({release})" for line, release in RELEASE_LINES.items()]
    return "torch " + ", ".join(items[:-1]) + " or " + items[-1]


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


def load_series(series_dir: Optional[os.PathLike] = None, *, library_only: bool = True,
                line: Optional[str] = None) -> Series:
    """Read ``series`` and the patches it names; ``id`` is a sha256 over names and contents.
    ``series_dir`` defaults to the shipped series of release ``line`` (default: 2.13). An entry
    may be a path relative to ``series_dir`` (``../2.13/NAME``); the patch is called NAME."""
    series_dir = Path(series_dir) if series_dir is not None else series_dir_for(line)
    h = hashlib.sha256()
    patches = []
    for entry in read_series_names(series_dir):
        path = series_dir / entry
        name = Path(entry).name
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
        patches.append(Patch(name, path, data, files, created_files(text)))
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return Series(series_dir, patches, h.hexdigest())


# --------------------------------------------------------------------------------------------
# targets


@dataclasses.dataclass
class Target:
    root: Path
    kind: str  # "checkout" | "installed"
    state_dir: Path
    torch_missing: bool = False  # installed target whose torch was uninstalled (leftovers only)
    changed: bool = dataclasses.field(default=False, compare=False)  # this run replaced a file of it

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def journal_file(self) -> Path:
        return self.state_dir / "journal.json"

    @property
    def orig_dir(self) -> Path:
        return self.state_dir / "orig"

    @property
    def lock_path(self) -> Path:
        """A directory that exists as long as the target does and that the tool never creates or
        removes: the root of an installed target, the git dir of a checkout."""
        return self.state_dir.parent


def installed_torch_root() -> Optional[Path]:
    """Directory containing the ``torch`` package this interpreter would import (not importing it).
    Also returns the directory when ``torch`` is only a namespace package (torch uninstalled,
    leftovers remain), so that the caller can report it."""
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        # resolve the package directory, not torch/__init__.py: a symlinked file must not move
        # the target to wherever the link points
        return Path(spec.origin).parent.resolve().parent
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


def _venv_site_packages(venv: Path) -> List[Path]:
    cands = sorted(venv.glob("lib/python3*/site-packages")) + sorted(venv.glob("Lib/site-packages"))
    return [c for c in cands if c.is_dir()]


def _debris_target(root: Path) -> Optional[Target]:
    """``root`` holds no torch but what torch-patch leaves behind after `pip uninstall torch`
    (a ``torch/`` without ``__init__.py``, and/or ``.torch-patch/``)."""
    if (root / "torch" / "__init__.py").exists():
        return None
    if (root / "torch").is_dir() or (root / ".torch-patch").is_dir():
        return Target(root, "installed", root / ".torch-patch", torch_missing=True)
    return None


def resolve_target(target: Optional[os.PathLike] = None, *, allow_system: bool = False,
                   require_venv: bool = True, verb: str = "patch") -> Target:
    """Turn the TARGET argument (or the default: this interpreter's torch) into a Target.
    ``verb`` names the action in the refusal to touch a torch outside a venv."""
    if target is None:
        root = installed_torch_root()
        if root is None:
            raise TorchPatchError(f"no torch package importable by {sys.executable}; install it "
                                  f"(pip install torch=={EXPECTED_TORCH_VERSION}) or pass TARGET")
        if require_venv and not allow_system:
            if not _in_venv():
                raise TorchPatchError(
                    f"refusing to {verb} {root}: {sys.executable} is not running in a virtual environment; "
                    f"use a venv (python3 -m venv .venv), pass TARGET explicitly, or pass --allow-system")
            if _is_within(root, sys.base_prefix) and not _is_within(root, sys.prefix):
                raise TorchPatchError(
                    f"refusing to {verb} {root}: it is the system torch seen through this venv; "
                    f"install torch=={EXPECTED_TORCH_VERSION} into the venv, or pass --allow-system")
        debris = _debris_target(root)
        if debris is not None:
            return debris
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
        elif (p / "pyvenv.cfg").is_file():
            sps = _venv_site_packages(p)
            with_torch = [sp for sp in sps if (sp / "torch").is_dir()] or sps
            where = " or ".join(str(sp) for sp in with_torch) or f"{p}/lib/python3.X/site-packages"
            raise TorchPatchError(
                f"target {p} is a virtual environment, not the directory that contains torch/: pass its "
                f"site-packages, {where} (or run {p / 'bin' / 'torch-patch'} without TARGET)")
        else:
            debris = _debris_target(p) or (_debris_target(p.parent) if p.name == "torch" else None)
            if debris is not None:
                return debris
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
    # any patch release of a supported line, or "2.13.0a0", what version.txt of an unbuilt
    # checkout of the release branch may say; whether its files take the series is for apply
    return release_line(version) is not None


def _leftovers(t: Target) -> List[str]:
    """What is left in a target whose torch was uninstalled: files under torch/ and the state dir."""
    out = []
    if (t.root / "torch").is_dir():
        out = sorted(p.relative_to(t.root).as_posix() for p in (t.root / "torch").rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)
    if t.state_dir.exists():
        out.append(t.state_dir.relative_to(t.root).as_posix() + "/")
    return out


def _torch_missing_message(t: Target) -> str:
    left = _leftovers(t)
    shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
    return (f"torch is not installed in {t.root} (no torch/__init__.py: `pip uninstall torch`?), but "
            f"files torch-patch wrote are left: {shown or 'none'}; with them `import torch` finds an empty "
            f"namespace package: run `torch-patch revert {t.root}` to remove them, then reinstall "
            f"torch if you want it (next time, revert before uninstalling)")


def check_base(t: Target) -> str:
    if t.torch_missing:
        raise TorchPatchError(_torch_missing_message(t), EXIT_BASE_MISMATCH)
    version = read_torch_version(t.root)
    if version is None:
        raise TorchPatchError(f"cannot tell the torch version at {t.root} (no torch/version.py, "
                              f"torch-*.dist-info/METADATA or version.txt)", EXIT_BASE_MISMATCH)
    if not base_version_ok(version):
        raise TorchPatchError(
            f"base mismatch: found torch {version} at {t.root}, expected {supported_releases()}; "
            f"install one of them (pip install torch=={EXPECTED_TORCH_VERSION}) or use a checkout of "
            f"one of those tags", EXIT_BASE_MISMATCH)
    return version


def target_release(t: Target) -> str:
    """The target's torch release as x.y.z ("2.14.1" for "2.14.1+cu130", "2.13.0" for a checkout's
    "2.13.0a0"), for messages; the default line's release when it cannot be told or is not
    supported."""
    version = None if t.torch_missing else read_torch_version(t.root)
    if version is None or release_line(version) is None:
        return EXPECTED_TORCH_VERSION
    return release_of(version)


def target_line(t: Target) -> str:
    """The release line whose series fits the target (the default one if it has none)."""
    version = None if t.torch_missing else read_torch_version(t.root)
    return release_line(version) or DEFAULT_LINE


# --------------------------------------------------------------------------------------------
# state dir / locking


def _not_writable(path: Path, e: OSError) -> TorchPatchError:
    return TorchPatchError(f"target not writable: cannot write in {path} ({e.strerror or e}); "
                           f"run as a user who may write there or use a venv you own")


def _lock_timeout() -> float:
    v = os.environ.get(LOCK_TIMEOUT_ENV)
    try:
        return float(v) if v else 600.0
    except ValueError:
        raise TorchPatchError(f"{LOCK_TIMEOUT_ENV}={v!r} is not a number of seconds")


def _flock(t: Target, fd: int, shared: bool, log: Optional[Log]) -> None:
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    timeout = _lock_timeout()
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TorchPatchError(f"cannot lock {t.lock_path}: {e.strerror or e}")
        if time.monotonic() >= deadline:
            raise TorchPatchError(
                f"another torch-patch has been working on {t.root} for over {timeout:g} s (lock on "
                f"{t.lock_path}); wait for it to finish, or raise {LOCK_TIMEOUT_ENV}")
        if not told and log is not None:
            log(f"waiting for another torch-patch working on {t.root} to finish…")
            told = True
        time.sleep(0.02)


@contextlib.contextmanager
def _locked(t: Target, *, shared: bool = False, log: Optional[Log] = None) -> Iterator[None]:
    """Hold the target's lock (see ``Target.lock_path``).  Exclusive: also create the state dir
    (this is the writability check) and remove it again on exit if it is empty, so failed or
    reverted runs leave no trace.  Only the lock holder ever creates or removes the state dir."""
    try:
        fd = os.open(t.lock_path, os.O_RDONLY)
    except OSError as e:
        raise TorchPatchError(f"cannot open {t.lock_path} to lock it: {e.strerror or e}")
    try:
        _flock(t, fd, shared, log)
        _check_state_owners(t)
        if shared:
            yield
            return
        created = not t.state_dir.exists()
        try:
            t.state_dir.mkdir(exist_ok=True)
            tempfile.TemporaryFile(dir=t.state_dir).close()
        except OSError as e:
            raise _not_writable(t.state_dir.parent if created else t.state_dir, e)
        try:
            _clean_leftovers(t)
            yield
        finally:
            with contextlib.suppress(OSError):
                if not any(t.state_dir.iterdir()):
                    t.state_dir.rmdir()
    finally:
        os.close(fd)  # releases the lock


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


def _check_dirs_writable(t: Target, rels: Iterable[str]) -> None:
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


# --------------------------------------------------------------------------------------------
# the state dir's files: schema, paths, owners
#
# torch-patch may run as root on a tree that another user owns (a venv, a checkout).  That user
# can write the state dir, so ``state.json`` and ``journal.json`` are untrusted input: they are
# checked against a schema before anything acts on them, every path in them must name a file of
# the torch package inside the target root (relative, normalized, no symlinked directory leading
# out of the root), ``stage`` must be a ``stage-*`` directory directly inside the state dir, and
# files owned by a third user are refused.  Nothing is then written or deleted outside the
# target root and its state dir.  (This checks what is on disk when the run starts; an owner
# racing the run by swapping directories for symlinks meanwhile is not defended against.)

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_STAGE_RE = re.compile(r"stage-[A-Za-z0-9_]+")  # what _new_stage (tempfile.mkdtemp) creates


class _Invalid(Exception):
    """A state/journal file does not match the schema (the message says where)."""


def _bad_rel(rel: object) -> Optional[str]:
    """Why ``rel`` is not a path of a file of the torch package, relative to the target root
    (None if it is one)."""
    if not isinstance(rel, str) or not rel:
        return "not a non-empty string"
    if rel.startswith("/") or os.path.isabs(rel) or "\\" in rel or "\0" in rel:
        return "an absolute path" if rel.startswith("/") or os.path.isabs(rel) else "not a plain POSIX path"
    parts = rel.split("/")
    if ".." in parts:
        return "contains `..`"
    if any(part in ("", ".") for part in parts):
        return "not normalized"
    if parts[0] != "torch" or len(parts) < 2:
        return "outside the torch package"
    return None


def _check_sha(value: object, where: str) -> None:
    if value is not None and not (isinstance(value, str) and _SHA256_RE.fullmatch(value)):
        raise _Invalid(f"{where} is {value!r}, not a hex sha256 or null")


def _check_keys(obj: object, where: str, required: Dict[str, tuple], optional: Dict[str, tuple]) -> dict:
    if not isinstance(obj, dict):
        raise _Invalid(f"{where} is a {type(obj).__name__}, not an object")
    missing = [k for k in required if k not in obj]
    if missing:
        raise _Invalid(f"{where} has no {', '.join(repr(k) for k in missing)}")
    unknown = [k for k in obj if k not in required and k not in optional]
    if unknown:
        raise _Invalid(f"{where} has unknown key {unknown[0]!r}")
    for k, types in {**required, **optional}.items():
        if k in obj and (not isinstance(obj[k], types) or (isinstance(obj[k], bool) and bool not in types)):
            names = " or ".join("null" if ty is type(None) else ty.__name__ for ty in types)
            raise _Invalid(f"{where}: {k!r} is {type(obj[k]).__name__} {obj[k]!r:.60}, not {names}")
    return obj


def _check_files(files: dict, where: str) -> None:
    for rel, rec in files.items():
        why = _bad_rel(rel)
        if why is not None:
            raise _Invalid(f"{where}: file path {rel!r} is {why}")
        _check_keys(rec, f"{where}[{rel!r}]", {"before": (str, type(None)), "after": (str, type(None))}, {})
        _check_sha(rec["before"], f"{where}[{rel!r}]['before']")
        _check_sha(rec["after"], f"{where}[{rel!r}]['after']")


_STATE_KEYS = {"series_id": (str,), "patches": (list,), "files": (dict,)}
_STATE_OPTIONAL = {"format": (int,), "torch_version": (str, type(None)), "kind": (str,)}


def _check_state_schema(state: object, where: str = "state") -> dict:
    _check_keys(state, where, _STATE_KEYS, _STATE_OPTIONAL)
    if state.get("format", STATE_FORMAT) != STATE_FORMAT:
        raise _Invalid(f"{where}: format {state['format']!r} is not {STATE_FORMAT} (written by another "
                       f"version of torch-patch?)")
    if not all(isinstance(name, str) for name in state["patches"]):
        raise _Invalid(f"{where}: 'patches' is not a list of names")
    _check_files(state["files"], f"{where}['files']")
    return state


def _check_journal_schema(journal: object) -> dict:
    _check_keys(journal, "the journal", {"op": (str,), "stage": (str,), "files": (dict,)},
                {"layout": (int,), "state": (dict,)})
    if journal["op"] not in ("apply", "revert"):
        raise _Invalid(f"'op' is {journal['op']!r}, not 'apply' or 'revert'")
    if journal.get("layout", 1) not in (1, 2):
        raise _Invalid(f"'layout' is {journal['layout']!r}, not 1 or 2")
    if not _STAGE_RE.fullmatch(journal["stage"]):
        raise _Invalid(f"'stage' is {journal['stage']!r}, not the name of a stage-* directory in the state dir")
    _check_files(journal["files"], "'files'")
    if journal["op"] == "apply":
        if "state" not in journal:
            raise _Invalid("an apply journal has no 'state'")
        _check_state_schema(journal["state"], "'state'")
    return journal


def _damaged(path: Path, why: str, fix: str) -> TorchPatchError:
    return TorchPatchError(f"{path} is damaged or not written by torch-patch ({why}); {fix}")


def _state_fix(t: Target) -> str:
    return (f"remove {t.state_file} (the files themselves tell whether the series is applied; "
            f"`torch-patch revert` then restores stock torch with `git apply --reverse`)")


def _journal_fix(t: Target) -> str:
    return (f"remove {t.journal_file} (then `torch-patch status` tells the state from the files, and "
            f"`torch-patch revert` restores stock torch)")


def _within_real(path: Path, base: Path) -> bool:
    """``path``'s directory, symlinks resolved, is ``base`` or below it (``base`` resolved too)."""
    return _is_within(Path(os.path.realpath(path.parent)), Path(os.path.realpath(base)))


def _inside(base: Path, rel: str, fix: str) -> Path:
    """``base / rel`` for a file torch-patch keeps in its state dir, refusing symlinks: none of
    its directories may lead out of ``base``, and it may not be a symlink itself."""
    path = base / rel
    if not _within_real(path, base) or path.is_symlink():
        raise TorchPatchError(f"{path} is (or lies below) a symbolic link out of {base}; torch-patch "
                              f"never follows links in its state dir: {fix}")
    return path


def _check_target_file(t: Target, rel: str) -> Path:
    """``t.root / rel`` for a file torch-patch may replace: its directories must not lead out
    of the target root, and it must not be a symlink (torch-patch replaces files with os.replace,
    which would turn the link into a regular file, leaving its target stale)."""
    path = t.root / rel
    if not _within_real(path, t.root):
        real = os.path.realpath(path.parent)
        raise TorchPatchError(f"{path.parent} leads outside the target {t.root} (symbolic link to {real}); "
                              f"torch-patch writes only inside the target: replace the link by the "
                              f"directory it points to, or patch {real} itself — nothing was changed")
    if path.is_symlink():
        raise TorchPatchError(
            f"{path} is a symbolic link (to {os.readlink(path)}); torch-patch replaces the files it patches "
            f"and would turn the link into a regular file: replace the link by a copy of the file "
            f"(cp --remove-destination \"$(readlink -f {path})\" {path}) or patch the target it points "
            f"into — nothing was changed")
    return path


def _owner_uid(path: Path) -> Optional[int]:
    """Owner of ``path`` (not following a symlink), or None if it does not exist."""
    try:
        return os.lstat(path).st_uid
    except FileNotFoundError:
        return None


def _user(uid: Optional[int]) -> str:
    import pwd
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, TypeError):
        return f"uid {uid}"


def _check_state_owners(t: Target) -> None:
    """Refuse a state dir, journal or state file owned by someone other than the owner of the
    target's torch files.  Also accepted: files of the user running torch-patch (it wrote them
    itself, or they are theirs) and of root (who can change everything anyway), e.g. the state
    root left when it patched another user's tree.  A third user (say, a member of a group that
    may write site-packages) could plant records that make torch-patch write, as whoever runs it,
    into files that user may not write; so those are refused."""
    torch_path = next((p for p in (t.root / "torch" / "__init__.py", t.root / "torch", t.root)
                       if _owner_uid(p) is not None), t.root)
    owner = _owner_uid(torch_path)
    trusted = {owner, os.geteuid(), 0}
    for path in (t.state_dir, t.journal_file, t.state_file):
        uid = _owner_uid(path)
        if uid is not None and uid not in trusted:
            raise TorchPatchError(
                f"{path} is owned by {_user(uid)}, but the torch files in {t.root} by {_user(owner)}: "
                f"torch-patch does not act on records another user could have planted; remove {path} if "
                f"you did not make it (or `chown {owner} {path}` if you trust it), then retry")
    if t.state_dir.is_symlink():
        raise TorchPatchError(f"{t.state_dir} is a symbolic link (to {os.readlink(t.state_dir)}); torch-patch "
                              f"keeps its state only in a real directory: remove the link, then retry")


def read_state(t: Target) -> Optional[dict]:
    """The records of the last apply (validated: schema, paths inside the target), or None."""
    state = _read_json(t.state_file)
    if state is None:
        return None
    try:
        _check_state_schema(state)
    except _Invalid as e:
        raise _damaged(t.state_file, str(e), _state_fix(t)) from None
    for rel in state["files"]:
        _check_target_file(t, rel)
    return state


def read_journal(t: Target) -> Optional[dict]:
    """The journal of a switch that did not finish (validated: schema, paths inside the target
    root and stage), or None."""
    journal = _read_json(t.journal_file)
    if journal is None:
        return None
    try:
        _check_journal_schema(journal)
    except _Invalid as e:
        raise _damaged(t.journal_file, str(e), _journal_fix(t)) from None
    stage = t.state_dir / journal["stage"]
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        raise _damaged(t.journal_file, f"its stage {stage} is not a directory", _journal_fix(t))
    for rel in journal["files"]:
        _check_target_file(t, rel)
    return journal


def modified_files(t: Target, state: dict) -> List[str]:
    """Files recorded by apply that are no longer what apply wrote (a cache check; the state
    that verbs act on comes from ``_Exam``)."""
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


def _git_apply_in(stage: Path, patch: Patch, *, check: bool = False, reverse: bool = False,
                  include: Optional[str] = None, ceiling: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run git apply in the staging dir, with discovery of any enclosing repository disabled;
    ``include`` restricts it to that one file's part of the patch."""
    env = git_env({"GIT_CEILING_DIRECTORIES": str(ceiling or stage.parent)})
    args = ["apply", "--whitespace=nowarn", "-p1"]
    if check:
        args.append("--check")
    if reverse:
        args.append("--reverse")
    if include is not None:
        args.append("--include=" + re.sub(r"([\[\]*?\\])", r"\\\1", include))
    return run_git(args + [str(patch.path)], stage, env=env, check=False)


# --------------------------------------------------------------------------------------------
# examination: what the files are


STOCK, PATCHED, OTHER = "stock", "patched", "other"

# Status.state values
APPLIED = "applied"
NOT_APPLIED = "not applied"
MODIFIED_AFTER_APPLY = "modified after apply"
MODIFIED = "modified"
PARTLY_APPLIED = "partly applied"
INTERRUPTED = "interrupted"
BASE_MISMATCH = "base mismatch"
NOT_INSTALLED = "not installed"

_UNKNOWN = object()


@dataclasses.dataclass
class FileView:
    """What one file of the target is, derived from its bytes."""
    rel: str
    current: Optional[str]  # sha256 now, None = the file does not exist
    kind: str = OTHER  # stock | patched | other
    by: str = ""  # what decided: "records", "RECORD" (the wheel's), "git apply"
    created: bool = False  # stock torch has no such file (the series adds it)
    edited: bool = False  # torch-patch recorded it, and it is neither what apply wrote nor the original
    stock_src: Optional[Path] = None  # a file with the stock bytes (None: stock has no such file, or unknown)
    stock_sha: object = _UNKNOWN  # sha256 of the stock bytes, None = stock has no such file
    patched_src: Optional[Path] = None
    patched_sha: object = _UNKNOWN
    failure: Optional[Tuple[Patch, str]] = None  # first patch whose part for this file does not apply


class _Exam:
    """Classify every file that the series (or the records of an earlier apply) touches.

    ``work`` is a scratch directory (created; the caller removes it) where ``git apply`` runs on
    private copies.  Nothing in the target is changed."""

    def __init__(self, t: Target, series: Series, work: Path, record: Optional[Dict[str, str]] = None):
        self.t, self.series, self.work = t, series, work
        self.work.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self.records = read_state(t)
        rels = dict.fromkeys(series.files)
        rels.update(dict.fromkeys(sorted(self.records["files"]) if self.records else ()))
        for rel in rels:
            _check_target_file(t, rel)  # refuse symlinks up front: nothing examined or changed yet
        self.record = record
        if record is None and t.kind == "installed":
            with contextlib.suppress(TorchPatchError, OSError, ValueError):
                self.record = load_record(t.root, rels)
        self.files: Dict[str, FileView] = {rel: self._view(rel) for rel in rels}

    # -- per file

    def _chain(self, rel: str, reverse: bool) -> Tuple[bool, Optional[Path], Optional[Tuple[Patch, str]]]:
        """Apply (or reverse-apply, last patch first) every patch's part for ``rel`` to a private
        copy of the file.  Returns (ok, result file or None if the result is 'no file', failure)."""
        self._n += 1
        root = self.work / f"{'rev' if reverse else 'fwd'}-{self._n}"
        root.mkdir()
        src = self.t.root / rel
        if src.exists():
            _copy_file(src, root / rel)
        patches = self.series.patches_for(rel)
        for p in (reversed(patches) if reverse else patches):
            proc = _git_apply_in(root, p, reverse=reverse, include=rel, ceiling=self.work)
            if proc.returncode != 0:
                return False, None, (p, proc.stderr.decode(errors="replace"))
        out = root / rel
        return True, (out if out.exists() else None), None

    def _view(self, rel: str) -> FileView:
        path = self.t.root / rel
        cur = sha256_file(path)
        rec = self.records["files"].get(rel) if self.records else None
        v = FileView(rel, cur, created=self.series.creates(rel) or (rec is not None and rec["before"] is None))
        here = path if cur is not None else None
        if rec is not None and cur == rec["after"] and rec["after"] != rec["before"]:
            v.kind, v.by, v.patched_src, v.patched_sha = PATCHED, "records", here, cur
            v.stock_sha = rec["before"]
            v.stock_src = self.t.orig_dir / rel if rec["before"] is not None else None
            return v
        if rec is not None and cur == rec["before"]:
            v.kind, v.by, v.stock_src, v.stock_sha = STOCK, "records", here, cur
            return v
        if self.record is not None and rel in self.record and cur == self.record[rel]:
            v.kind, v.by, v.stock_src, v.stock_sha = STOCK, "RECORD", here, cur
            return v
        if not self.series.patches_for(rel):
            v.edited = rec is not None  # recorded by an earlier series that this one does not touch
            return v
        ok, out, failure = self._chain(rel, reverse=False)
        if ok:
            v.kind, v.by, v.stock_src, v.stock_sha = STOCK, "git apply", here, cur
            v.patched_src, v.patched_sha = out, sha256_file(out) if out else None
            return v
        v.failure = failure
        ok, out, _ = self._chain(rel, reverse=True)
        if ok:
            v.kind, v.by, v.patched_src, v.patched_sha = PATCHED, "git apply", here, cur
            v.stock_src, v.stock_sha = out, sha256_file(out) if out else None
        v.edited = rec is not None
        return v

    def patched_version(self, v: FileView) -> Tuple[Optional[Path], Optional[str]]:
        """The patched bytes of a stock file (runs git apply if not known yet)."""
        if v.patched_sha is _UNKNOWN:
            ok, out, failure = self._chain(v.rel, reverse=False)
            if not ok:
                p, stderr = failure
                raise TorchPatchError(
                    f"patch {p.name} does not apply to {self.t.root}: {describe_apply_failure(p, stderr)}, "
                    f"although {v.rel} is the stock file (per {v.by}); the series does not fit torch "
                    f"{target_release(self.t)} (regenerate it with `torch-patch dev --export`) — nothing was changed")
            v.patched_src, v.patched_sha = out, sha256_file(out) if out else None
        return v.patched_src, v.patched_sha  # type: ignore[return-value]

    # -- the whole target

    def views(self, kind: Optional[str] = None) -> List[FileView]:
        return [v for v in self.files.values() if kind is None or v.kind == kind]

    def bad(self) -> List[FileView]:
        """Files that are neither stock nor patched, or that were edited after apply."""
        return [v for v in self.files.values() if v.kind == OTHER or v.edited]

    @property
    def records_valid(self) -> bool:
        """The records describe the files: every recorded file is what apply wrote."""
        return bool(self.records) and all(self.files[rel].kind == PATCHED and self.files[rel].by == "records"
                                          for rel in self.records["files"])

    def summary(self) -> "Summary":
        t, series, recs = self.t, self.series, self.records
        current = (recs["series_id"] == series.id) if recs else None
        bad = [v.rel for v in self.bad()]
        bad_txt = ", ".join(v.rel + (" (missing)" if v.current is None and not v.created else "")
                            for v in self.bad())
        patched = self.views(PATCHED)
        stock = self.views(STOCK)
        if self.records_valid:
            msg = f"applied ({', '.join(recs['patches'])})"
            if not current:
                msg += " — an older/different series than this torch_patch ships; `torch-patch apply --reapply`"
            return Summary(EXIT_APPLIED, APPLIED, msg, list(recs["patches"]), [], current, "torch-patch")
        if bad:
            if recs:
                return Summary(EXIT_MODIFIED, MODIFIED_AFTER_APPLY, f"modified after apply ({bad_txt})",
                               list(recs["patches"]), bad, current, "torch-patch")
            return Summary(EXIT_MODIFIED, MODIFIED,
                           f"modified ({bad_txt}: neither the stock torch {target_release(self.t)} file "
                           f"nor patched by the series; `torch-patch apply` names the hunk that does not fit)",
                           [], bad, None, None)
        series_views = [self.files[rel] for rel in series.files]
        if series_views and all(v.kind == PATCHED for v in series_views):
            msg = f"applied ({', '.join(series.names)})"
            if recs:
                msg += f" — the records in {t.state_dir} are stale (the next apply or revert replaces them)"
            elif t.kind == "checkout" and _committed(t, [v.rel for v in patched]):
                msg += " — committed in this checkout (e.g. with `git am`), not by torch-patch"
            else:
                msg += " — not by torch-patch (e.g. plain `git apply`): no originals saved; revert uses `git apply -R`"
            return Summary(EXIT_APPLIED, APPLIED, msg, series.names, [], True, "other")
        stale = (f"; the records of an earlier apply in {t.state_dir} are stale (the files were replaced "
                 f"since, e.g. torch reinstalled or `git checkout`): the next apply or revert removes them"
                 if recs else "")
        if not patched:
            return Summary(EXIT_NOT_APPLIED, NOT_APPLIED, "not applied" + (" —" + stale[1:] if stale else ""),
                           [], [], current, None)
        leftover = [v.rel for v in patched if v.created]
        if len(leftover) == len(patched) and stock:
            return Summary(EXIT_NOT_APPLIED, NOT_APPLIED,
                           f"not applied — left over from an earlier apply: {', '.join(leftover)} (torch reinstalled, "
                           f"or `git checkout`?): `torch-patch apply` applies the series again, `torch-patch revert` "
                           f"removes it{stale}", [], [], current, None, leftover)
        return Summary(EXIT_MODIFIED, PARTLY_APPLIED,
                       f"partly applied ({', '.join(v.rel for v in patched)} patched; "
                       f"{', '.join(v.rel for v in stock)} not): `torch-patch apply` completes it, "
                       f"`torch-patch revert` undoes it", list(recs["patches"]) if recs else [],
                       [], current, "torch-patch" if recs else None)


@dataclasses.dataclass
class Summary:
    code: int
    state: str
    message: str
    patches: List[str]
    modified: List[str]
    current: Optional[bool]
    applied_by: Optional[str]  # "torch-patch" (records match) | "other" | None
    leftovers: List[str] = dataclasses.field(default_factory=list)


def _committed(t: Target, rels: List[str]) -> bool:
    """True if the checkout's HEAD already has these files as they are (the series was
    committed, e.g. `git am`), so reverting the working tree would not remove it."""
    if not rels:
        return False
    proc = run_git(["--no-optional-locks", "status", "--porcelain", "--untracked-files=all", "--", *rels],
                   t.root, check=False)
    return proc.returncode == 0 and not proc.stdout.strip()


@contextlib.contextmanager
def _scratch(parent: Optional[Path] = None) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="torch-patch-exam-", dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# journaled commit


def _fault_budget(env: str = FAULT_ENV) -> Optional[int]:
    v = os.environ.get(env)
    return int(v) if v else None


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while files are switched over (a few ms), then deliver them, so
    Ctrl-C never stops the switch midway.  (Only the main thread can set signal handlers.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: List[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM]
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


def _stage_src(stage: Path, journal: dict, rel: str, fix: str) -> Path:
    return _inside(stage, "new/" + rel if journal.get("layout", 1) >= 2 else rel, fix)


def _commit(t: Target, journal: dict) -> int:
    """Move staged files into place as recorded in the (already written) journal, then write the
    resulting state and drop the journal.  Safe to re-run after a crash at any point."""
    stage = t.state_dir / journal["stage"]
    budget = _fault_budget()
    sigint_budget = _fault_budget(SIGINT_ENV)
    moved = 0
    for rel, rec in sorted(journal["files"].items()):
        dst = _check_target_file(t, rel)
        cur = sha256_file(dst)
        if cur == rec["after"]:
            continue
        if cur != rec["before"]:
            raise TorchPatchError(
                f"{dst} changed while an interrupted {journal['op']} was pending (sha256 {cur}); "
                f"reinstall torch=={target_release(t)} and delete {t.state_dir}")
        t.changed = True
        if rec["after"] is None:
            dst.unlink()
        else:
            src = _stage_src(stage, journal, rel, _journal_fix(t))
            if sha256_file(src) != rec["after"]:
                raise TorchPatchError(f"staged copy {src} is missing or damaged; reinstall "
                                      f"torch=={target_release(t)} and delete {t.state_dir}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            _keep_owner(src, dst)
            os.replace(src, dst)
        moved += 1
        if budget is not None and moved >= budget:
            os._exit(FAULT_EXIT_CODE)  # fault injection for tests: simulate a kill
        if sigint_budget is not None and moved == sigint_budget:
            signal.raise_signal(signal.SIGINT)  # test hook: a real Ctrl-C (held back until the end)
    if journal["op"] == "apply":
        new_orig = stage / "orig"
        if journal.get("layout", 1) >= 2 and new_orig.exists():
            if new_orig.is_symlink() or t.orig_dir.is_symlink():
                raise _damaged(t.journal_file, f"{new_orig} or {t.orig_dir} is a symbolic link", _journal_fix(t))
            shutil.rmtree(t.orig_dir, ignore_errors=True)
            os.replace(new_orig, t.orig_dir)
        _write_json_atomic(t.state_file, journal["state"])
    else:
        with contextlib.suppress(FileNotFoundError):
            t.state_file.unlink()
        shutil.rmtree(t.orig_dir, ignore_errors=True)
    t.journal_file.unlink()
    shutil.rmtree(stage, ignore_errors=True)
    _drop_bytecode(t, [rel for rel, rec in journal["files"].items() if rec["after"] is None])
    return moved


def _drop_bytecode(t: Target, removed: Iterable[str]) -> None:
    """Remove the __pycache__ entries of deleted modules (and directories left empty)."""
    for rel in removed:
        path = t.root / rel
        if path.exists():
            continue
        cache = path.parent / "__pycache__"
        if cache.is_symlink() or not _within_real(cache / "x", t.root):
            continue  # never delete through a link out of the target
        for pyc in cache.glob(f"{path.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            cache.rmdir()


# The .pyc writer: stdlib only, so that it runs in the target's own interpreter (``python -I -S
# -c``, arguments: the target root and the sources) or, for the running interpreter, in process.
# Timestamp-checked .pyc files, as pip writes them for a wheel (py_compile would otherwise pick
# checked-hash ones when SOURCE_DATE_EPOCH is set), at optimization level 0 and at each level
# that already had a (now stale) .pyc.  A .pyc that is a symlink is replaced, never written
# through; a __pycache__ that leads out of the target is left alone.
_PYC_WRITER = r'''
import importlib.util, os, py_compile, sys


def write_pycs(root, sources):
    """Write the .pyc files of ``sources`` (paths of .py files below ``root``); return failures."""
    failed = []
    real_root = os.path.realpath(root)
    for src in sources:
        levels = [0] + [lvl for lvl in (1, 2)
                        if os.path.lexists(importlib.util.cache_from_source(src, optimization=lvl))]
        for lvl in levels:
            pyc = importlib.util.cache_from_source(src, optimization=lvl or "")
            try:
                cache = os.path.dirname(pyc)
                if os.path.islink(cache) or \
                        os.path.commonpath([real_root, os.path.realpath(cache)]) != real_root:
                    raise OSError(f"{cache} is outside {root} (a symbolic link, or PYTHONPYCACHEPREFIX)")
                if os.path.islink(pyc):
                    os.unlink(pyc)
                py_compile.compile(src, pyc, doraise=True, optimize=lvl,
                                   invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
            except (OSError, py_compile.PyCompileError) as e:
                failed.append(f"{pyc}: {e}")
    return failed


if __name__ == "__main__":
    for line in write_pycs(sys.argv[1], sys.argv[2:]):
        print(line)
'''


def _target_python(t: Target) -> Optional[str]:
    """The interpreter that imports the target's torch, or None if there is none to tell:

    * the running one, if the target is on its ``sys.path`` (the running venv's torch, or
      ``PYTHONPATH``);
    * for ``<prefix>/lib/pythonX.Y/site-packages``: ``<prefix>/bin/pythonX.Y`` (or ``python3``,
      ``python``) if it exists, e.g. another venv;
    * none for a checkout (a development install imports from the tree, which its owner builds
      and imports with their own Python, writing the bytecode as usual) or any other directory."""
    if t.kind != "installed":
        return None
    root = os.path.realpath(t.root)
    if any(p and os.path.realpath(p) == root for p in sys.path):
        return sys.executable
    lib = t.root.parent
    m = re.fullmatch(r"python(\d+)\.(\d+)t?", lib.name)
    if m and t.root.name in ("site-packages", "dist-packages") and lib.parent.name in ("lib", "lib64"):
        for name in (lib.name, f"python{m[1]}", "python"):
            exe = lib.parent.parent / "bin" / name
            if exe.is_file() and os.access(exe, os.X_OK):
                return str(exe)
    return None


def _write_bytecode(t: Target, rels: Iterable[str], log: Optional[Log]) -> None:
    """Write the ``__pycache__`` .pyc files of the .py files among ``rels`` (just switched
    over), compiled by the target's interpreter (``_target_python``), so that a process that
    cannot write bytecode there does not recompile them on every import.  Bytecode is not part
    of the state (``status`` ignores it).  Never fails: a problem is one warning line.

    Run as root on a tree another user owns, the compiler runs as that user (its bytecode is
    theirs, and root never executes an interpreter someone else could have replaced)."""
    srcs = [str(t.root / rel) for rel in dict.fromkeys(rels) if rel.endswith(".py") and (t.root / rel).is_file()]
    python = _target_python(t) if srcs else None
    if python is None:
        return
    as_owner = False
    try:
        owner = os.stat(t.root / "torch")
        as_owner = os.geteuid() == 0 and owner.st_uid != 0
        if python == sys.executable and not as_owner:
            ns: dict = {"__name__": "torch_patch.pyc_writer"}
            exec(compile(_PYC_WRITER, "<torch-patch pyc writer>", "exec"), ns)
            failed = ns["write_pycs"](str(t.root), srcs)
        else:
            kw = dict(user=owner.st_uid, group=owner.st_gid, extra_groups=[]) if as_owner else {}
            proc = subprocess.run([python, "-I", "-S", "-c", _PYC_WRITER, str(t.root), *srcs],
                                  capture_output=True, text=True, timeout=300, **kw)
            failed = proc.stdout.splitlines()
            if proc.returncode != 0:
                failed.append(f"{python} exited with {proc.returncode}: "
                              f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    except (OSError, subprocess.SubprocessError, SyntaxError, ValueError) as e:
        failed = [f"{python}{f' run as {_user(owner.st_uid)}' if as_owner else ''}: {e}"]
    if failed and log is not None:
        log(f"warning: could not write the bytecode of the patched files ({failed[0]}"
            f"{f' and {len(failed) - 1} more' if len(failed) > 1 else ''}); Python compiles them on "
            f"import instead (nothing else is affected)")


def _rollback_apply(t: Target, journal: dict) -> None:
    """Undo an interrupted apply: put the files back as they were before it."""
    stage = t.state_dir / journal["stage"]
    new_orig = stage / "orig"
    fix = _journal_fix(t)
    for rel, rec in sorted(journal["files"].items()):
        dst = _check_target_file(t, rel)
        cur = sha256_file(dst)
        if cur == rec["before"]:
            continue
        if cur != rec["after"]:
            raise TorchPatchError(f"{dst} changed while an interrupted apply was pending; reinstall "
                                  f"torch=={target_release(t)} and delete {t.state_dir}")
        if rec["before"] is None:
            t.changed = True
            dst.unlink()
            continue
        orig = _inside(stage, "orig/" + rel, fix)
        if not orig.exists():
            orig = _inside(t.state_dir, "orig/" + rel, fix)
        tmp = _inside(stage, "rollback/" + rel, fix)
        _copy_file(orig, tmp)
        if sha256_file(tmp) != rec["before"]:
            raise TorchPatchError(f"saved original {orig} is damaged; reinstall "
                                  f"torch=={target_release(t)} and delete {t.state_dir}")
        _keep_owner(tmp, dst)
        t.changed = True
        os.replace(tmp, dst)
    t.journal_file.unlink()
    shutil.rmtree(stage, ignore_errors=True)
    _drop_bytecode(t, [rel for rel, rec in journal["files"].items() if rec["before"] is None])


def _journal_progress(t: Target, journal: dict) -> Tuple[int, int]:
    done = sum(1 for rel, rec in journal["files"].items() if sha256_file(t.root / rel) == rec["after"])
    return done, len(journal["files"])


def _resolve_journal(t: Target, journal: dict, want: str, log: Log) -> None:
    done, total = _journal_progress(t, journal)
    if journal["op"] == "apply" and want == "revert":
        log(f"rolling back interrupted apply ({done} of {total} files had been replaced)")
        _rollback_apply(t, journal)
        _write_bytecode(t, [rel for rel, rec in journal["files"].items() if rec["before"] is not None], log)
    else:
        log(f"finishing interrupted {journal['op']} ({done} of {total} files had been replaced)")
        _commit(t, journal)
        _write_bytecode(t, [rel for rel, rec in journal["files"].items() if rec["after"] is not None], log)


def _switch(t: Target, journal: dict, stage: Path, log: Optional[Log] = None) -> None:
    """Write the journal and switch the files over, with Ctrl-C held back; then write the
    bytecode of the new files."""
    with _signals_held():
        _write_json_atomic(t.journal_file, journal)
        _commit(t, journal)
    _write_bytecode(t, [rel for rel, rec in journal["files"].items() if rec["after"] is not None], log)


# --------------------------------------------------------------------------------------------
# verbs


def _new_stage(t: Target) -> Path:
    return Path(tempfile.mkdtemp(prefix="stage-", dir=t.state_dir))


def _put(src: Optional[Path], dst: Path) -> None:
    if src is not None:
        _copy_file(src, dst)


def _check_original(t: Target, v: FileView) -> Optional[Path]:
    """The saved original of a file patched by torch-patch, verified by sha256."""
    if v.stock_sha is None:
        return None
    src = _inside(t.state_dir, "orig/" + v.rel, _state_fix(t))
    if sha256_file(src) != v.stock_sha:
        raise TorchPatchError(f"saved original {src} is missing or damaged; reinstall "
                              f"torch=={target_release(t)} (pip install --force-reinstall) "
                              f"and delete {t.state_dir}")
    return src


def _apply_series(t: Target, series: Series, exam: _Exam, version: str, stage: Path, log: Log) -> dict:
    """Apply to a target whose every file is stock or already patched by this series."""
    rels = series.files
    n = len(series.patches)
    log(f"checking {_n(n, 'patch')} against {t.root} ({t.kind})…")
    finals: Dict[str, Optional[str]] = {}
    state_files = {}
    for rel in rels:
        v = exam.files[rel]
        if v.kind == STOCK:
            src, sha = exam.patched_version(v)
            stock_src, stock_sha = v.stock_src, v.stock_sha
        else:  # PATCHED by this series
            src, sha = v.patched_src, v.patched_sha
            stock_src = _check_original(t, v) if v.by == "records" else v.stock_src
            stock_sha = v.stock_sha
        _put(src, stage / "new" / rel)
        _put(stock_src, stage / "orig" / rel)
        if stock_src is not None and sha256_file(stage / "orig" / rel) != stock_sha:
            raise TorchPatchError(f"{t.root / rel} changed while being patched; retry")
        finals[rel] = sha  # type: ignore[assignment]
        state_files[rel] = {"before": stock_sha, "after": sha}
    for p in series.patches:
        log(f"  ok {p.name} ({_n(len(p.files), 'file')})")
    unchanged = [rel for rel, rec in state_files.items() if rec["before"] == rec["after"]]
    if unchanged:
        raise TorchPatchError(f"git apply left {', '.join(unchanged)} unchanged although the series "
                              f"touches it; nothing was changed (please report this)")
    changing = {rel: {"before": exam.files[rel].current, "after": finals[rel]}
                for rel in rels if exam.files[rel].current != finals[rel]}
    _check_dirs_writable(t, changing)
    already = [rel for rel in rels if rel not in changing]
    if already:
        log(f"  already patched: {', '.join(already)}")
    state = {"format": STATE_FORMAT, "series_id": series.id, "patches": series.names,
             "torch_version": version, "kind": t.kind, "files": state_files}
    journal = {"op": "apply", "layout": 2, "stage": stage.name, "files": changing, "state": state}
    if _fault_budget() == 0:
        os._exit(FAULT_EXIT_CODE)  # fault injection: killed after staging, before the journal
    if _fault_budget(SIGINT_ENV) == 0:
        signal.raise_signal(signal.SIGINT)  # test hook: Ctrl-C while staging
    _switch(t, journal, stage, log)
    log(f"applied {_n(n, 'patch')} ({_n(len(rels), 'file')}) to {t.root}")
    return state


def _revert_files(t: Target, exam: _Exam, force: bool, stage: Path, log: Log) -> Optional[int]:
    """Put every file of the examination back to stock.  Returns the number of files changed
    (None if there was nothing to do)."""
    todo = [v for v in exam.views() if v.kind != STOCK]
    if not todo:
        return None
    if t.kind == "checkout" and not exam.records_valid and not exam.records and \
            _committed(t, [v.rel for v in todo]):
        raise TorchPatchError(
            f"the series is committed in {t.root} (HEAD has the patched files, e.g. after `git am`); "
            f"`torch-patch revert` only undoes working-tree changes: remove the commits with git "
            f"(`git revert`, or `git reset --hard v{target_release(t)}` on a branch made for them)")
    edited = [v.rel for v in todo if v.edited or v.kind == OTHER]
    if edited and not force:
        if exam.records:
            raise TorchPatchError(
                f"refusing to revert: edited after apply: {', '.join(edited)} (in {t.root}); save your "
                f"edits elsewhere, then rerun with --force to restore the originals", EXIT_MODIFIED)
        raise TorchPatchError(
            f"refusing to revert: {', '.join(edited)} in {t.root} is neither the stock torch "
            f"{target_release(t)} file nor patched by the series, and torch-patch saved no original "
            f"of it; restore it yourself (`pip install --force-reinstall torch=={target_release(t)}` "
            f"or `git checkout`)", EXIT_MODIFIED)
    if edited:
        log(f"--force: discarding edits to {', '.join(edited)}")
    files = {}
    for v in todo:
        if v.kind == PATCHED and not v.edited and v.by == "git apply":
            src, sha = v.stock_src, v.stock_sha
        else:  # patched by torch-patch, or (with --force) edited: the saved original
            rec = exam.records["files"].get(v.rel) if exam.records else None
            if rec is None:
                raise TorchPatchError(
                    f"--force cannot restore {t.root / v.rel}: torch-patch saved no original of it; "
                    f"restore it yourself (`pip install --force-reinstall torch=={target_release(t)}` "
                    f"or `git checkout`)")
            v.stock_sha = rec["before"]
            src, sha = _check_original(t, v), rec["before"]
        _put(src, stage / "new" / v.rel)
        files[v.rel] = {"before": v.current, "after": sha}
    _check_dirs_writable(t, files)
    _switch(t, {"op": "revert", "layout": 2, "stage": stage.name, "files": files}, stage, log)
    bad = [rel for rel, rec in files.items() if sha256_file(t.root / rel) != rec["after"]]
    if bad:
        raise TorchPatchError(f"after revert, {', '.join(bad)} do not match the originals (sha256)")
    return len(files)


def _drop_records(t: Target) -> bool:
    had = t.state_file.exists() or t.orig_dir.exists()
    with contextlib.suppress(FileNotFoundError):
        t.state_file.unlink()
    shutil.rmtree(t.orig_dir, ignore_errors=True)
    return had


def apply(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None,
          allow_system: bool = False, reapply: bool = False, force: bool = False,
          log: Log = _print) -> dict:
    """Apply the series to TARGET (default: the torch imported by this interpreter).

    What is applied is decided from the files (see ``_Exam``), not from earlier records.  All
    patches are applied in a staging copy first; the target's files are then switched over with
    a journal, so the result is either untouched or fully applied.  Returns the recorded state
    (dict; empty if the series was already contained in the files without records).
    Raises TorchPatchError (``.code`` = exit code).
    """
    if force and not reapply:
        raise TorchPatchError("apply: --force only takes effect together with --reapply (it lets the revert "
                              "of the earlier apply discard edits); add --reapply, or use `torch-patch revert "
                              "--force` first")
    t = resolve_target(target, allow_system=allow_system)
    version = check_base(t)
    series = load_series(series_dir, line=release_line(version))
    require_git()
    with _write_errors(t, "apply", series_dir):
        with _locked(t, log=log):
            journal = read_journal(t)
            if journal is not None:
                _resolve_journal(t, journal, "apply", log)
            for attempt in (1, 2):
                stage = _new_stage(t)
                try:
                    exam = _Exam(t, series, stage / "exam")
                    done = _apply_decide(t, series, exam, version, stage, reapply, force, attempt, log)
                except BaseException:
                    shutil.rmtree(stage, ignore_errors=True)
                    raise
                shutil.rmtree(stage, ignore_errors=True)
                if done is not None:
                    return done
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _write_errors(t: Target, verb: str, series_dir: Optional[os.PathLike]) -> Iterator[None]:
    """Turn an OSError of apply/revert (disk full, quota, I/O error) into one line that says what
    failed and what the target is now.  Until the journal is written, nothing in the target has
    changed (the stage is removed again); after it, the files are switched one ``os.replace`` at a
    time, so the target is either as before, or the journal records how to finish."""
    try:
        yield
    except OSError as e:
        what = (e.strerror or str(e)) + (f" (writing {e.filename})" if e.filename else "")
        fix = ("free some space on that filesystem" if e.errno in (errno.ENOSPC, errno.EDQUOT)
               else "fix that")
        if not t.changed and not t.journal_file.exists():
            raise TorchPatchError(f"{verb} failed: {what}; nothing was changed in {t.root} (it is as it "
                                  f"was before): {fix}, then retry") from None
        try:
            now = status(t.root, series_dir=series_dir).message
        except (TorchPatchError, OSError) as e2:
            now = f"unknown ({e2}; see `torch-patch status`)"
        raise TorchPatchError(f"{verb} failed: {what}; {t.root} is now: {now} — {fix}, then run "
                              f"`torch-patch {verb}` again") from None


def _apply_decide(t: Target, series: Series, exam: _Exam, version: str, stage: Path, reapply: bool,
                  force: bool, attempt: int, log: Log) -> Optional[dict]:
    """One round of apply: returns the state, or None to examine again (after --reapply's revert)."""
    s = exam.summary()
    recs = exam.records
    bad = exam.bad()
    other_series = bool(recs) and recs["series_id"] != series.id and \
        any(v.by == "records" and v.kind == PATCHED for v in exam.views())
    if s.state == APPLIED and not other_series:
        if s.applied_by == "torch-patch":
            log(f"already applied ({', '.join(recs['patches'])}) to {t.root}; nothing to do")
            return recs
        log(f"the series is already contained in the files of {t.root} (applied without torch-patch, "
            f"e.g. committed with `git am` or applied with `git apply`); nothing to do")
        return {}
    if s.state == MODIFIED_AFTER_APPLY and not other_series and not (reapply and force) and \
            series.files and all(exam.files[rel].kind == PATCHED for rel in series.files):
        log(f"already applied ({', '.join(series.names)}) to {t.root}; nothing to do "
            f"(note: edited after apply: {', '.join(s.modified)})")
        return recs
    if other_series or (reapply and force and bad):
        if attempt == 2:
            raise TorchPatchError(f"--reapply could not bring {t.root} back to stock; see `torch-patch status`")
        if not reapply:
            raise TorchPatchError(
                f"a different series is already applied to {t.root} ({', '.join(recs['patches'])}); "
                f"run `torch-patch revert` first, or `torch-patch apply --reapply`")
        log("--reapply: reverting the series applied before")
        _revert_files(t, exam, force, stage, log)
        _drop_records(t)
        return None
    if bad:
        if recs and s.state == MODIFIED_AFTER_APPLY:
            raise TorchPatchError(
                f"{', '.join(s.modified)} in {t.root} was edited after apply and no longer holds the "
                f"series; `torch-patch revert --force` restores the originals (discarding the edits), "
                f"then apply again (or: `torch-patch apply --reapply --force`)", EXIT_MODIFIED)
        v = bad[0]
        if v.failure is not None:
            p, stderr = v.failure
            why = describe_apply_failure(p, stderr)
        else:
            p, why = None, f"{v.rel} does not match"
        raise TorchPatchError(
            f"patch {p.name if p else '(recorded series)'} does not apply to {t.root}: {why}; the target is "
            f"not stock torch {target_release(t)} there (edited by hand, or patched by other means?) "
            f"— nothing was changed")
    if not series.patches:
        log(f"the series in {series.dir} is empty; nothing to apply")
        return {}
    if s.leftovers:
        log(f"note: {', '.join(s.leftovers)} is left over from an earlier apply (torch reinstalled?); "
            f"applying the whole series again")
    elif s.state == NOT_APPLIED and recs:
        log(f"note: the records of an earlier apply in {t.state_dir} are stale (the files were replaced "
            f"since); applying again")
    return _apply_series(t, series, exam, version, stage, log)


def revert(target: Optional[os.PathLike] = None, *, force: bool = False, allow_system: bool = False,
           series_dir: Optional[os.PathLike] = None, log: Log = _print) -> None:
    """Put the stock files back: the byte-identical originals recorded by ``apply`` (verified by
    sha256), or, for files patched without torch-patch, the result of ``git apply --reverse``.

    Refuses (exit code 2) if a patched file was edited after apply, unless ``force``.  On a
    target whose torch was uninstalled, removes what torch-patch had left there.
    """
    t = resolve_target(target, allow_system=allow_system, verb="revert")
    if t.torch_missing:
        _remove_debris(t, series_dir, log)
        return
    series = _series_or_empty(series_dir, release_line(check_base(t)))
    require_git()
    with _write_errors(t, "revert", series_dir), _locked(t, log=log):
        journal = read_journal(t)
        if journal is not None:
            _resolve_journal(t, journal, "revert", log)
        stage = _new_stage(t)
        try:
            exam = _Exam(t, series, stage / "exam")
            names = exam.records["patches"] if exam.records else series.names
            changed = _revert_files(t, exam, force, stage, log)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        stale = _drop_records(t)
        if changed is None:
            if journal is None:
                note = "; removed the stale records of an earlier apply" if stale else ""
                log(f"not applied to {t.root}; nothing to revert{note}")
            return
        log(f"reverted {_n(len(names), 'patch')} ({_n(changed, 'file')}) in {t.root}; "
            f"sha256 of every file matches the original")


def _series_or_empty(series_dir: Optional[os.PathLike], line: Optional[str] = None) -> Series:
    """The shipped series of ``line``, or an empty one if it cannot be read (revert/status then
    rely on the records alone)."""
    try:
        return load_series(series_dir, line=line)
    except TorchPatchError:
        if series_dir is not None:
            raise
        return Series(series_dir_for(line), [], "")


def _remove_debris(t: Target, series_dir: Optional[os.PathLike], log: Log) -> None:
    """torch was uninstalled: remove the files torch-patch created (if they still hold what it
    wrote), their bytecode, the state dir, and directories left empty.  Without ``series_dir``,
    the series of every release line is considered (the torch version is gone with torch)."""
    lines: List[Optional[str]] = [None] if series_dir is not None else list(RELEASE_LINES)
    serieses = [_series_or_empty(series_dir, line) for line in lines]
    with _locked(t, log=log):
        records = read_state(t)
        expected: Dict[str, set] = {}
        for rel, rec in (records or {}).get("files", {}).items():
            if rec["before"] is None and rec["after"] is not None:
                expected.setdefault(rel, set()).add(rec["after"])
        with _scratch() as work:
            n = 0
            for series in serieses:
                for rel in series.files:
                    if series.creates(rel) and (t.root / rel).exists():
                        n += 1
                        root = work / str(n)
                        root.mkdir()
                        ok = all(_git_apply_in(root, p, include=rel, ceiling=work).returncode == 0
                                 for p in series.patches_for(rel))
                        if ok and (root / rel).exists():
                            expected.setdefault(rel, set()).add(sha256_file(root / rel))
        removed, kept = [], []
        for rel, shas in sorted(expected.items()):
            path = _check_target_file(t, rel)
            if not path.exists():
                continue
            if sha256_file(path) in shas:
                path.unlink()
                removed.append(rel)
            else:
                kept.append(rel)
        _drop_bytecode(t, removed)
        shutil.rmtree(t.state_dir, ignore_errors=True)
    _prune_empty_dirs(t.root / "torch")
    what = ", ".join(removed + [t.state_dir.name + "/"])
    log(f"torch is not installed in {t.root}; removed what torch-patch had left there: {what}")
    rest = _leftovers(t)
    if kept or rest:
        log(f"note: left alone (not written by torch-patch, or edited since): {', '.join(kept + [r for r in rest if r not in kept])}")


def _prune_empty_dirs(top: Path) -> None:
    """Bottom-up: drop bytecode whose module is gone, then empty directories, ``top`` included
    (what `pip uninstall` leaves of a package; any directory with a real file stays)."""
    if not top.is_dir() or top.is_symlink():
        return
    for dirpath, dirnames, filenames in os.walk(top, topdown=False):
        d = Path(dirpath)
        if d.name == "__pycache__":
            for name in filenames:
                if name.endswith(".pyc") and not (d.parent / (name.split(".", 1)[0] + ".py")).exists():
                    (d / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()  # fails unless empty


@dataclasses.dataclass
class Status:
    code: int
    state: str  # applied | not applied | modified after apply | modified | partly applied | interrupted | base mismatch | not installed
    message: str
    target: str
    kind: str
    torch_version: Optional[str]
    patches: List[str]
    modified_files: List[str]
    series_current: Optional[bool]
    applied_by: Optional[str] = None  # "torch-patch" (its records match the files) | "other" | None
    leftovers: List[str] = dataclasses.field(default_factory=list)
    stock_files: Dict[str, str] = dataclasses.field(default_factory=dict)  # rel -> path of a stock copy
    state_dir: str = ""

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        line = release_line(self.torch_version)
        d["release_line"] = line
        d["expected_torch_version"] = RELEASE_LINES[line or DEFAULT_LINE]
        d["supported_releases"] = list(RELEASE_LINES.values())
        return d


def _stock_copies(t: Target, exam: _Exam) -> Dict[str, Optional[Path]]:
    """rel -> an on-disk file with the stock bytes, or None if stock torch has no such file.
    Files for which no stock copy is on disk are left out."""
    out: Dict[str, Optional[Path]] = {}
    for v in exam.views():
        if v.kind == STOCK:
            out[v.rel] = v.stock_src
        elif v.kind == PATCHED and v.by == "records":
            if v.stock_sha is None:
                out[v.rel] = None
            elif sha256_file(t.orig_dir / v.rel) == v.stock_sha:
                out[v.rel] = t.orig_dir / v.rel
    return out


def status(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None) -> Status:
    """Report the patch state of TARGET without changing anything (see EXIT_* for codes).
    The state is derived from the files (``_Exam``); it waits while another torch-patch is
    switching the same target over."""
    t = resolve_target(target, require_venv=False)
    version = read_torch_version(t.root)

    def mk(code, state, message, patches=(), modified=(), current=None, **kw):
        return Status(code, state, message, str(t.root), t.kind, version, list(patches), list(modified),
                      current, state_dir=str(t.state_dir), **kw)

    if t.torch_missing:
        return mk(EXIT_BASE_MISMATCH, NOT_INSTALLED, "not installed: " + _torch_missing_message(t),
                  leftovers=_leftovers(t))
    if not base_version_ok(version):
        return mk(EXIT_BASE_MISMATCH, BASE_MISMATCH,
                  f"base mismatch: found torch {version or 'unknown'}, expected {supported_releases()}")
    series = _series_or_empty(series_dir, release_line(version))
    with _locked(t, shared=True):
        journal = read_journal(t)
        if journal is not None:
            done, total = _journal_progress(t, journal)
            if 0 < done < total:
                names = journal.get("state", {}).get("patches", [])
                if journal["op"] == "apply":
                    msg = (f"interrupted (apply of {', '.join(names)}: {done} of {total} files replaced; "
                           f"`torch-patch apply` finishes it, `torch-patch revert` rolls it back)")
                else:
                    msg = (f"interrupted (revert: {done} of {total} files restored; "
                           f"`torch-patch revert` or `torch-patch apply` finishes it)")
                return mk(EXIT_INTERRUPTED, INTERRUPTED, msg, names)
        with _scratch() as work:
            exam = _Exam(t, series, work)
            s = exam.summary()
            copies = {rel: str(p) for rel, p in _stock_copies(t, exam).items() if p is not None}
    message = s.message
    if journal is not None:
        message += (" (a torch-patch run was killed before it finished its bookkeeping; the next "
                    "`torch-patch apply` or `revert` completes it)")
    return mk(s.code, s.state, message, s.patches, s.modified, s.current, applied_by=s.applied_by,
              leftovers=s.leftovers, stock_files=copies)


# --------------------------------------------------------------------------------------------
# stock files (used by dev and export, and by `torch-patch stock-file`)


def load_record(root: Path, only: Optional[Iterable[str]] = None) -> Dict[str, str]:
    """rel path -> sha256 hex from the torch wheel's dist-info RECORD (torch/ entries only;
    with ``only``, just those paths)."""
    di = find_dist_info(root)
    if di is None or not (di / "RECORD").is_file():
        raise TorchPatchError(f"no torch-*.dist-info/RECORD in {root}; cannot verify stock files "
                              f"(point --from at a pip-installed torch)")
    import base64
    import csv
    wanted = set(only) if only is not None else None
    out = {}
    with open(di / "RECORD", newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0].startswith("torch/") and row[1].startswith("sha256=") and \
                    (wanted is None or row[0] in wanted):
                b64 = row[1][len("sha256="):]
                out[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return out


def stock_files(t: Target, rels: Optional[Iterable[str]] = None, record: Optional[Dict[str, str]] = None,
                series: Optional[Series] = None) -> Dict[str, Optional[Path]]:
    """rel -> path of an on-disk copy of the stock (unpatched) ``rel`` in target ``t``, or None
    if stock torch has no such file.  ``rels`` defaults to every file the series or the records
    of an earlier apply touch.  Uses the shipped series (or ``series``) and the records to tell
    stock from patched files; verified against the wheel's RECORD when given.  Raises
    TorchPatchError if a file's stock bytes are not on disk."""
    series = series if series is not None else _series_or_empty(None, target_line(t))
    if t.torch_missing:
        raise TorchPatchError(_torch_missing_message(t), EXIT_BASE_MISMATCH)
    out: Dict[str, Optional[Path]] = {}
    with _locked(t, shared=True):
        journal = read_journal(t)
        if journal is not None and 0 < _journal_progress(t, journal)[0] < len(journal["files"]):
            raise TorchPatchError(f"an interrupted torch-patch operation is pending in {t.root}; "
                                  f"run `torch-patch apply` or `torch-patch revert` there first", EXIT_INTERRUPTED)
        with _scratch() as work:
            exam = _Exam(t, series, work, record)
            copies = _stock_copies(t, exam)
            for rel in dict.fromkeys(rels if rels is not None else exam.files):
                v = exam.files.get(rel)
                if v is None:
                    out[rel] = t.root / rel if (t.root / rel).exists() else None
                elif rel in copies:
                    out[rel] = copies[rel]
                elif v.kind == PATCHED:
                    raise TorchPatchError(
                        f"no stock copy of {rel} on disk: {t.root / rel} is patched, but not by torch-patch "
                        f"(no saved original); take it from git (`git show v{target_release(t)}:{rel}`) "
                        f"or the wheel")
                else:
                    raise TorchPatchError(
                        f"{t.root / rel} is neither the stock torch {target_release(t)} file nor patched "
                        f"by the series; no stock copy of it is on disk (pip install --force-reinstall "
                        f"torch=={target_release(t)})")
    if record is not None:
        for rel, path in out.items():
            if path is not None and rel in record and sha256_file(path) != record[rel]:
                raise TorchPatchError(
                    f"{path} is not the stock torch {target_release(t)} file (sha256 differs from the "
                    f"wheel's RECORD); pip install --force-reinstall torch=={target_release(t)}")
    return out


def stock_file(t: Target, rel: str, record: Optional[Dict[str, str]] = None) -> Optional[Path]:
    """Path of the stock (unpatched) copy of ``rel`` in target ``t``: the original saved by
    ``apply`` if the file is patched, else the file itself.  None if stock torch has no such file.
    Verified against RECORD when given."""
    return stock_files(t, [rel], record)[rel]


def stock_file_path(path: str, target: Optional[os.PathLike] = None, *,
                    series_dir: Optional[os.PathLike] = None) -> Path:
    """`torch-patch stock-file PATH [TARGET]`: the absolute path of an on-disk copy of the stock
    version of PATH (relative to the target, like ``torch/utils/_pytree.py``, or an
    absolute path inside it)."""
    t = resolve_target(target, require_venv=False)
    p = Path(path).expanduser()
    if p.is_absolute():
        try:
            try:
                rel = Path(os.path.abspath(p)).relative_to(t.root).as_posix()
            except ValueError:
                rel = (p.parent.resolve() / p.name).relative_to(t.root).as_posix()
        except ValueError:
            raise TorchPatchError(f"{p} is not inside the target {t.root}; pass a path like "
                                  f"torch/utils/_pytree.py (relative to the target) or a TARGET that contains it")
    else:
        rel = p.as_posix()
        if not rel.startswith("torch/"):
            raise TorchPatchError(f"{path} is not a path of the torch package; pass it relative to the "
                                  f"target, like torch/utils/_pytree.py")
    version = check_base(t)
    record = None
    if t.kind == "installed":
        with contextlib.suppress(TorchPatchError):
            record = load_record(t.root)
    series = _series_or_empty(series_dir, release_line(version))
    got = stock_files(t, [rel], record, series=series)[rel]
    if got is None:
        raise TorchPatchError(f"stock torch {target_release(t)} has no {rel} "
                              f"({'the series adds it' if series.creates(rel) else f'no such file in {t.root}'})")
    return Path(os.path.abspath(got))
