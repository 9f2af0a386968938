"""Apply, revert and report the patch series on a PyTorch checkout or an installed torch, as quilt does.

Before the first file the series touches changes, their stock versions and the series are saved in the state
dir (``saved/``, written as ``saved.tmp`` and renamed); each file is then replaced by a full copy written next
to it, so it is always stock or patched. The state comes from the files, compared with the saved stock files
and what `git apply` of the saved series makes of them (with nothing saved: with what `git apply` and `git
apply -R` make of the files). An apply or revert stopped anywhere is "partly applied": the next one finishes it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

RELEASE_LINES = {"2.13": "2.13.0", "2.14": "2.14.1", "2.15": "2.15.0"}  # the release each series is made from
PATCHES_DIR = Path(__file__).resolve().parent / "patches"
EXIT_APPLIED, EXIT_NOT_APPLIED, EXIT_MODIFIED, EXIT_BASE_MISMATCH, EXIT_PARTLY, EXIT_ERROR, EXIT_SIGINT = *range(6), 130
STOCK, PATCHED, OTHER = "stock", "patched", "modified"
Files = Dict[str, Optional[bytes]]  # a path in the target: its bytes (None: no such file)
Log = Callable[[str], None]
Patch = collections.namedtuple("Patch", "name path data files")


class TorchPatchError(Exception):  # one line that names the problem and the fix; ``code``: the exit code
    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def _read(path: Path) -> Optional[bytes]:
    return path.read_bytes() if path.is_file() else None


def git_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """No user or system config, no inherited GIT_* variables: git acts (and writes) the same anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k == "GIT_EXEC_PATH"}
    return {**env, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
            "LC_ALL": "C", "LANGUAGE": "C", **(extra or {})}


def run_git(args: List[str], cwd: Path, *, env: Optional[Dict[str, str]] = None, check: bool = True):
    if shutil.which("git") is None:
        raise TorchPatchError("git not found on PATH; torch-patch runs `git apply` and `git am`: install git "
                              "(e.g. `apt-get install git`) or fix PATH")
    proc = subprocess.run(["git", *args], cwd=cwd, env=env or git_env(), capture_output=True)
    if check and proc.returncode:
        err = " ".join(proc.stderr.decode(errors="replace").split())
        raise TorchPatchError(f"`git {' '.join(args)}` failed in {cwd}: {err}")
    return proc


@dataclasses.dataclass
class Series:
    dir: Path
    label: str  # "series 2.13" (or "series DIR")
    patches: List[Patch]
    files: List[str]  # every file the series touches
    created: List[str]  # the files it adds

    def same(self, other: "Series") -> bool:
        return [(p.name, p.data) for p in self.patches] == [(p.name, p.data) for p in other.patches]


def load_series(series_dir: Optional[os.PathLike] = None, *, line: Optional[str] = None) -> Series:
    """``series_dir``/series (default: the shipped series of ``line``) and the patches it names; an entry may
    be a path (``../2.13/NAME``). A patch may touch files in torch/ only."""
    d = Path(series_dir) if series_dir is not None else PATCHES_DIR / (line or "2.13")
    try:
        entries = [e.split("#", 1)[0].strip() for e in (d / "series").read_text(encoding="utf-8").splitlines()]
        patches = [Patch(Path(e).name, d / e, (d / e).read_bytes(), []) for e in filter(None, entries)]
    except OSError as e:
        raise TorchPatchError(f"cannot read {e.filename} ({e.strerror}); reinstall torch_patch, regenerate the series "
                              f"(`torch-patch dev --export`), or pass --series DIR") from None
    series = Series(d, f"series {d.name if d.parent == PATCHES_DIR else d}", patches, [], [])
    for patch in patches:
        for section in re.split(r"^(?=diff --git )", patch.data.decode(errors="replace"), flags=re.M)[1:]:
            for rel in re.match(r"diff --git a/(\S+) b/(\S+)\n", section).groups():
                if rel.split("/")[0] != "torch" or {"", ".", ".."} & set(rel.split("/")):
                    raise TorchPatchError(f"{patch.path} touches {rel}, outside torch/; a library patch changes only "
                                          f"torch/ (`torch-patch export` adds the tests and benchmarks)")
                if rel not in series.files:
                    series.files.append(rel)
                    series.created += [rel] if "\n--- /dev/null\n" in section else []
                patch.files.append(rel)
    return series


def release_line(version: Optional[str]) -> Optional[str]:
    """The supported line of a torch version ("2.14" for "2.14.1+cu130" or "2.14.0a0"), or None."""
    m = re.match(r"(\d+)\.(\d+)\.\d+", version or "")
    return f"{m[1]}.{m[2]}" if m and f"{m[1]}.{m[2]}" in RELEASE_LINES else None


@dataclasses.dataclass
class Target:
    root: Path
    kind: str  # "checkout" or "installed"
    state_dir: Path
    version: Optional[str]
    line: Optional[str]

    @property
    def saved(self) -> Path:
        return self.state_dir / "saved"

    @property
    def arg(self) -> str:  # TARGET in the commands messages suggest
        return shlex.quote(str(self.root))

    @property
    def release(self) -> str:  # x.y.z: "2.14.1" for "2.14.1+cu130", "2.13.0" for "2.13.0a0" (a checkout's)
        return re.match(r"\d+\.\d+\.\d+", self.version)[0]


def _within(path: os.PathLike, root: os.PathLike) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) == os.path.realpath(root)


def resolve_target(target: Optional[os.PathLike] = None, *, allow_system: bool = False, require_venv: bool = True,
                   verb: str = "patch", check_base: bool = True) -> Target:
    """TARGET, or the torch this Python imports (in a venv only, unless ``allow_system``); ``check_base``: refuse
    a torch of a release line without a series (exit code 3)."""
    if target is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            raise TorchPatchError(f"no torch is importable by {sys.executable}: install one (pip install "
                                  f"torch=={RELEASE_LINES['2.13']}) or pass TARGET")
        root = Path(list(spec.submodule_search_locations)[0]).resolve().parent
        if require_venv and not allow_system and (sys.prefix == sys.base_prefix or (
                _within(root, sys.base_prefix) and not _within(root, sys.prefix))):
            raise TorchPatchError(f"refusing to {verb} {root}: it is not the torch of a virtual environment that runs "
                                  f"{sys.executable}; use a venv, pass TARGET, or pass --allow-system")
    else:
        root = Path(target).expanduser().resolve()
        root = root.parent if root.name == "torch" and (root / "__init__.py").is_file() else root
    if not (root / "torch" / "__init__.py").is_file():
        left = f"; `pip uninstall torch` left files there? rm -r {shlex.quote(str(root / 'torch'))} " \
               f"{shlex.quote(str(root / '.torch-patch'))} removes them" * (root / "torch").is_dir()
        raise TorchPatchError(f"{root} has no torch/__init__.py: pass a PyTorch checkout, or the directory with an "
                              f"installed torch/ in it (of a venv: VENV/lib/python3.X/site-packages){left}")
    m = re.search(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)""",
                  (_read(root / "torch" / "version.py") or b"").decode(errors="replace"), re.M)
    version = m[1] if m else (_read(root / "version.txt") or b"").decode().strip() or None
    git_dir = (root / ".git").exists() and run_git(["rev-parse", "--absolute-git-dir"], root).stdout.decode().strip()
    t = Target(root, "checkout" if git_dir else "installed", Path(git_dir or root) / (
        "torch-patch" if git_dir else ".torch-patch"), version, release_line(version))
    if check_base and t.line is None:
        raise _mismatch(t)
    return t


def _mismatch(t: Target) -> TorchPatchError:
    major, minor = (int(n) for n in (re.findall(r"\d+", t.version or "") + ["0", "0"])[:2])
    near = min(RELEASE_LINES.values(), key=lambda release: abs(  # the nearest release: 2.15.0 for 2.16.0
        1000 * (int(release.split(".")[0]) - major) + int(release.split(".")[1]) - minor))
    return TorchPatchError(f"base mismatch: torch {t.version or '(version unknown)'} at {t.root}; the series are for "
                           f"torch {', '.join(RELEASE_LINES)}: install torch=={near} (or check out v{near})",
                           EXIT_BASE_MISMATCH)


def _apply(series: Series, files: Files, reverse: bool = False, only: Optional[str] = None) -> Tuple[Files, str]:
    """What `git apply` (``reverse``: `-R`, last patch first) of the series (``only``: its part for that file) makes
    of ``files``, in a private directory; ({}, why) if it does not apply."""
    patches = [p for p in series.patches if only is None or only in p.files][::-1 if reverse else 1]
    if not patches:
        return dict(files), ""
    with tempfile.TemporaryDirectory(prefix="torch-patch-") as d:
        for rel, data in files.items():
            if data is not None:
                (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(d) / rel).write_bytes(data)
        args = ["apply", "--whitespace=nowarn"] + ["--reverse"] * reverse + [f"--include={only}"] * bool(only)
        proc = run_git(args + [str(p.path) for p in patches], Path(d), check=False,
                       env=git_env({"GIT_CEILING_DIRECTORIES": str(Path(d).parent)}))
        if proc.returncode == 0:
            return {rel: _read(Path(d) / rel) for rel in files}, ""
    err = proc.stderr.decode(errors="replace")
    m = re.search(r"patch failed: (\S+):(\d+)", err)
    for p in patches if m else []:  # name the patch and the hunk
        section = next((s for s in p.data.decode(errors="replace").split("\ndiff --git ") if s.startswith(
            f"a/{m[1]} ")), "")
        heads = re.findall(r"^(@@ -(\d+)\S* \S+ @@.*)$", section, re.M)
        for i, (head, start) in enumerate(heads):
            if start == m[2]:
                return {}, f"patch {p.name} does not apply: {m[1]}, hunk #{i + 1} of {len(heads)} ({head}) does not fit"
    return {}, "git apply: " + "; ".join(line[7:] for line in err.splitlines() if line.startswith("error: "))


@dataclasses.dataclass
class Exam:
    """Each file the series touches: its bytes now, stock and patched (where known)."""
    t: Target
    series: Series
    saved: bool  # the stock versions come from the state dir
    label: str  # the series, as messages name it
    current: Files
    stock: Files
    patched: Files
    failure: str = ""  # why the series does not apply to the files as they are

    @property
    def kinds(self) -> Dict[str, str]:
        return {rel: STOCK if rel in self.stock and cur == self.stock[rel] else PATCHED if rel in self.patched
                and cur == self.patched[rel] else OTHER for rel, cur in self.current.items()}

    def of(self, *kinds: str) -> List[str]:
        return [rel for rel, kind in self.kinds.items() if kind in kinds]

    @property
    def head(self) -> str:  # what the status lines say after the state
        n = len(self.series.patches)
        return f"{n} patch{'es' * (n != 1)} ({self.label}) on torch {self.t.version} at {self.t.root}"


def _current(t: Target, series: Series) -> Files:
    state = [t.state_dir, *(t.state_dir / name for name in ("saved", "saved.tmp", "saved.old"))]
    for path in [*state, *(t.root / rel for rel in series.files)]:  # a write never goes through a link
        if path.is_symlink() or path not in state and not _within(path.parent, t.root):
            raise TorchPatchError(f"{path} is a symbolic link, or in a directory that links out of {t.root}; "
                                  f"torch-patch replaces files, inside the target only: put a copy there instead")
    return {rel: _read(t.root / rel) for rel in series.files}


def _fresh(t: Target, series: Series) -> Exam:
    """The files against what the series does to them, forwards and backwards: all files, else each one."""
    cur = _current(t, series)
    patched, why = _apply(series, cur)
    if patched or not cur:
        return Exam(t, series, False, series.label, cur, dict(cur), patched)
    stock = _apply(series, cur, reverse=True)[0]
    ex = Exam(t, series, False, series.label, cur, stock, dict(cur) if stock else {}, "" if stock else why)
    for rel in [] if stock else series.files:
        fwd = _apply(series, {rel: cur[rel]}, only=rel)[0]
        back = {} if fwd else _apply(series, {rel: cur[rel]}, reverse=True, only=rel)[0]
        if fwd or back:
            ex.stock[rel], ex.patched[rel] = (cur[rel], fwd[rel]) if fwd else (back[rel], cur[rel])
    return ex


def examine(t: Target, series: Series) -> Exam:
    """The files against the saved series and stock files while any of it is applied, else against ``series``;
    saved files are stale if the files are ``series``' stock ones (torch replaced by another release)."""
    if not t.saved.is_dir():
        return _fresh(t, series)
    saved = load_series(t.saved / "patches")
    stock = {rel: _read(t.saved / "orig" / rel) for rel in saved.files}
    patched, why = _apply(saved, stock)
    if not patched and saved.files:
        raise TorchPatchError(f"the stock files saved in {t.saved} do not take their series ({why}); remove {t.saved}")
    ex = Exam(t, saved, True, series.label if saved.same(series) else "an earlier series", _current(t, saved), stock,
              patched)
    fresh = _fresh(t, series) if ex.of(OTHER) or not ex.of(PATCHED) else None
    if fresh and (not ex.of(PATCHED, OTHER) or not fresh.of(PATCHED, OTHER)):
        return fresh  # none of the saved series is applied, or the files are another release's stock ones
    return ex


def _committed(t: Target, files: List[str]) -> bool:
    """A checkout whose HEAD has these files as they are (the series committed, e.g. with `git am`)."""
    return t.kind == "checkout" and not run_git(["--no-optional-locks", "status", "--porcelain",
                                                 "--untracked-files=all", "--", *files], t.root).stdout.strip()


def _state(ex: Exam) -> Tuple[int, str, str]:
    """(exit code, state, the line that status prints)."""
    t, head, other, patched = ex.t, ex.head, ex.of(OTHER), ex.of(PATCHED)
    fix = f"`torch-patch apply {t.arg}` finishes it, `torch-patch revert {t.arg}` undoes it"
    if other:
        fix = (f"`torch-patch revert --force {t.arg}` puts the stock files back, `torch-patch apply --force {t.arg}` "
               f"the patched ones (the edits are lost)" if ex.saved else f"put the stock files back (pip install "
               f"--force-reinstall torch=={t.release}, or git checkout), then apply")
        files = f"{', '.join(other)} {'is' if len(other) == 1 else 'are'}"
        return EXIT_MODIFIED, "modified", f"modified: {head} — {files} neither stock nor patched; {fix}"
    if not patched:
        return EXIT_NOT_APPLIED, "not applied", f"not applied: {head}"
    if len(patched) == len(ex.kinds):
        note = (f" — torch_patch now has another series for {t.line}: `torch-patch apply {t.arg}` replaces it" if
                ex.label == "an earlier series" else "" if ex.saved else " — committed in this checkout (e.g. with "
                "`git am`)" if _committed(t, patched) else " — not by torch-patch (e.g. plain `git apply`)")
        return EXIT_APPLIED, "applied", f"applied: {head}{note}"
    if set(patched) <= set(ex.series.created):
        return EXIT_NOT_APPLIED, "not applied", (f"not applied: {head} — left over from an earlier apply (torch "
                                                 f"reinstalled, or `git checkout`?): {', '.join(patched)}; {fix}")
    done = f"{len(patched)} of {len(ex.kinds)} files patched"
    return EXIT_PARTLY, "partly applied", f"partly applied: {head} — {done}; {fix}"


@contextlib.contextmanager
def _locked(t: Target, verb: str = "", series: Optional[Series] = None,
            log: Log = lambda message: print(message, file=sys.stderr)) -> Iterator[None]:
    """One torch-patch at a time per target: a flock on its root, shared unless ``verb`` changes files, whose OSError
    (disk full, read-only, EXDEV, EIO...) becomes one line: what failed, the fix, what the target is now."""
    fd, mode = os.open(t.root, os.O_RDONLY), fcntl.LOCK_EX if verb else fcntl.LOCK_SH
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another torch-patch working on {t.root} to finish…")
            fcntl.flock(fd, mode)
        yield
    except OSError as e:
        if not verb:
            raise
        fix = ("free some space there" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable (or run as "
               "a user who may write there)" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else "fix that")
        try:
            now = _state(examine(t, series))[2]
        except (TorchPatchError, OSError) as e2:
            now = f"unknown ({e2}): see `torch-patch status {t.arg}`"
        raise TorchPatchError(f"{verb} failed: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}: {fix}, "
                              f"then run `torch-patch {verb} {t.arg}` again; the target is now {now}") from None
    finally:
        os.close(fd)


def _forget(t: Target, keep_dir: bool = False) -> None:
    """Drop the saved files (a rename, then delete), and the state dir if that leaves it empty."""
    if t.saved.is_dir():
        os.rename(t.saved, t.state_dir / "saved.old")
    for name in ("saved.old", "saved.tmp"):
        shutil.rmtree(t.state_dir / name, ignore_errors=True)
    if not keep_dir and t.state_dir.is_dir() and not any(t.state_dir.iterdir()):
        t.state_dir.rmdir()


def _save(ex: Exam) -> None:
    """Keep the stock files and the series before the first file changes (all of them or none), unless kept."""
    if ex.saved:
        return
    tmp = ex.t.state_dir / "saved.tmp"
    _forget(ex.t, keep_dir=True)
    (tmp / "patches").mkdir(parents=True)
    for rel in (rel for rel, data in ex.stock.items() if data is not None):
        (tmp / "orig" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "orig" / rel).write_bytes(ex.stock[rel])
    for p in ex.series.patches:
        (tmp / "patches" / p.name).write_bytes(p.data)
    (tmp / "patches" / "series").write_text("".join(f"{p.name}\n" for p in ex.series.patches), encoding="utf-8")
    os.rename(tmp, ex.t.saved)
    ex.saved = True


def _switch(ex: Exam, to: str) -> None:
    """Each file to its stock or patched version, by an os.replace of a full copy written next to it. The files
    the series adds come last when patching and first when reverting: they alone are never left patched."""
    want = ex.stock if to == STOCK else ex.patched
    for rel in sorted(ex.series.files, key=lambda rel: (rel in ex.series.created, rel), reverse=to == STOCK):
        path = ex.t.root / rel
        tmp = path.with_name(f".{path.name}.torch-patch-tmp")
        tmp.unlink(missing_ok=True)  # left by a killed run
        if ex.current[rel] != want[rel] and want[rel] is None:
            path.unlink()  # its bytecode, if any, is never imported without it
        elif ex.current[rel] != want[rel]:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(want[rel])
                if path.exists():
                    shutil.copymode(path, tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        ex.current[rel] = want[rel]
    if any(os.path.realpath(p or ".") == os.path.realpath(ex.t.root) for p in sys.path):
        import py_compile  # the bytecode of a torch this Python imports, for processes that may not write it
        for rel in (rel for rel in ex.series.files if rel.endswith(".py") and want[rel] is not None):
            with contextlib.suppress(OSError):
                if not (ex.t.root / rel).parent.joinpath("__pycache__").is_symlink():
                    py_compile.compile(str(ex.t.root / rel), doraise=False, quiet=2,
                                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


def _revert(ex: Exam, force: bool) -> None:
    t, (code, _, message) = ex.t, _state(ex)
    if code == EXIT_MODIFIED and not (force and ex.saved):
        raise TorchPatchError(f"refusing to revert: {message}", EXIT_MODIFIED)
    if not ex.saved and _committed(t, ex.series.files):
        raise TorchPatchError(f"refusing to revert: the series is committed in {t.root} (e.g. with `git am`), and "
                              f"revert changes only the working tree: remove the commits with git (`git revert`, or "
                              f"`git reset --hard v{t.release}` on a branch made for them)", EXIT_MODIFIED)
    _save(ex)
    _switch(ex, STOCK)
    _forget(t)


def apply(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None,
          allow_system: bool = False, force: bool = False, log: Log = print) -> None:
    """Apply the series of the target's line (default target: the torch this Python imports), reverting an earlier
    one first. Files neither stock nor patched: exit code 2, unless ``force`` and their stock versions are saved."""
    t = resolve_target(target, allow_system=allow_system)
    series = load_series(series_dir, line=t.line)
    with _locked(t, "apply", series, log):
        ex = examine(t, series)
        if not ex.series.same(series) and (force or not ex.of(OTHER)):
            log(f"reverting {ex.head} first")
            _revert(ex, force=True)
            ex = examine(t, series)
        code, _, message = _state(ex)
        if code == EXIT_MODIFIED and not (force and ex.saved):
            raise TorchPatchError(f"cannot apply: {message}" + (f"; {ex.failure}" if ex.failure else ""), code)
        if code != EXIT_APPLIED:
            _save(ex)
            _switch(ex, PATCHED)
    log(f"already {message}; nothing to do" if code == EXIT_APPLIED else _state(ex)[2])


def revert(target: Optional[os.PathLike] = None, *, force: bool = False, allow_system: bool = False,
           series_dir: Optional[os.PathLike] = None, log: Log = print) -> None:
    """Put the stock files back: the saved ones, or what `git apply -R` makes (a series applied by other means).
    Files neither stock nor patched, or a series committed in a checkout: exit code 2 (files: unless ``force``)."""
    t = resolve_target(target, allow_system=allow_system, verb="revert")
    series = load_series(series_dir, line=t.line)
    with _locked(t, "revert", series, log):
        ex = examine(t, series)
        if not ex.of(PATCHED, OTHER):
            _forget(t)
            return log(f"{_state(ex)[2]}; nothing to revert")
        _revert(ex, force)
    log(f"reverted: {ex.head}; its {len(ex.series.files)} files are stock again")


@dataclasses.dataclass
class Status:
    code: int
    state: str  # applied | not applied | partly applied | modified | base mismatch
    message: str
    target: str
    kind: str
    torch_version: Optional[str]
    release_line: Optional[str]
    patches: List[str]  # of the series the state is about
    files: Dict[str, str] = dataclasses.field(default_factory=dict)  # stock | patched | modified
    stock_files: Dict[str, str] = dataclasses.field(default_factory=dict)  # a path of each stock version on disk


def status(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None) -> Status:
    """The state of the target's files (it waits while another torch-patch changes them)."""
    t = resolve_target(target, require_venv=False, check_base=False)
    if t.line is None:
        return Status(EXIT_BASE_MISMATCH, "base mismatch", str(_mismatch(t)), str(t.root), t.kind, t.version, None, [])
    with _locked(t):
        ex = examine(t, load_series(series_dir, line=t.line))
    stock = {rel: str(t.root / rel if kind == STOCK else t.saved / "orig" / rel) for rel, kind in ex.kinds.items()
             if ex.stock.get(rel) is not None and (kind == STOCK or ex.saved)}
    return Status(*_state(ex), str(t.root), t.kind, t.version, t.line, [p.name for p in ex.series.patches],
                  ex.kinds, stock)


def stock_versions(t: Target, series: Series) -> Files:
    """The stock bytes of each file that ``series``, or the series applied, touches (for dev and export)."""
    with _locked(t):
        ex = examine(t, series)
    if ex.of(OTHER):
        raise TorchPatchError(f"cannot tell the stock files of {t.root}: {_state(ex)[2]}")
    return {**{rel: _read(t.root / rel) for rel in series.files}, **ex.stock}


def stock_file_path(path: str, target: Optional[os.PathLike] = None, *,
                    series_dir: Optional[os.PathLike] = None) -> Path:
    """`torch-patch stock-file PATH`: a path of the stock version of PATH (torch/..., or an absolute path in the
    target): the saved one if the file is patched, else the file itself."""
    t = resolve_target(target, require_venv=False)
    rel = os.path.relpath(os.path.abspath(path), t.root) if os.path.isabs(path) else Path(path).as_posix()
    st = status(t.root, series_dir=series_dir)
    if rel in st.stock_files or rel not in st.files and rel.startswith("torch/") and (t.root / rel).is_file():
        return Path(st.stock_files.get(rel, t.root / rel))
    raise TorchPatchError(f"no stock version of {rel} is on disk: " + (
        f"{t.root / rel} is no file of the torch package (pass a path like torch/utils/_pytree.py)" if rel not in
        st.files else "stock torch has no such file (the series adds it)" if st.files[rel] != OTHER and rel in
        load_series(series_dir, line=t.line).created else f"{st.message}; take it from git (`git show "
        f"v{t.release}:{rel}`) or from the wheel"))
