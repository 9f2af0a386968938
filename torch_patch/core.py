"""Apply, revert and report the patch series on a PyTorch checkout or an installed torch, as quilt
does: the state comes from the files (see docs/tool.md)."""

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

RELEASE_LINES = {"2.13": "2.13.0", "2.14": "2.14.1", "2.15": "2.15.0"}  # each series' base
PATCHES_DIR = Path(__file__).resolve().parent / "patches"
EXIT_APPLIED, EXIT_NOT_APPLIED, EXIT_BASE_MISMATCH, EXIT_PARTLY, EXIT_ERROR = 0, 1, 3, 4, 5
EXIT_USAGE, EXIT_MODIFIED, EXIT_SIGINT = 2, 6, 130  # 2: argparse's
STOCK, PATCHED, OTHER = "stock", "patched", "modified"
Files = Dict[str, Optional[bytes]]  # a path in the target: its bytes (None: no such file)
Log = Callable[[str], None]
Patch = collections.namedtuple("Patch", "name path data files")
FIXES = {errno.ENOSPC: "Free some space there", errno.EDQUOT: "Free some space there",
         **dict.fromkeys((errno.EROFS, errno.EACCES, errno.EPERM),
                         "Make it writable (or run as a user who may write there)")}


class TorchPatchError(Exception):  # names the problem and the fix; ``code``: the exit code
    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def _read(path: Path) -> Optional[bytes]:
    return path.read_bytes() if path.is_file() else None


def write_files(root: Path, files: Files) -> None:
    """Write each of ``files`` that exists (its bytes are not None) under ``root``."""
    for rel, data in files.items():
        if data is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)


def git_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """No user or system config, no inherited GIT_* variables: git acts the same anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k == "GIT_EXEC_PATH"}
    return {**env, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "LANGUAGE": "C", **(extra or {})}


def run_git(args: List[str], cwd: Path, *, env: Optional[Dict[str, str]] = None, check=True):
    if shutil.which("git") is None:
        raise TorchPatchError("git not found on PATH; torch-patch runs `git apply` and `git am`.\n"
                              "Install git (e.g. `apt-get install git`) or fix PATH.")
    proc = subprocess.run(["git", *args], cwd=cwd, env=env or git_env(), capture_output=True)
    if check and proc.returncode:
        err = " ".join(proc.stderr.decode(errors="replace").split())
        raise TorchPatchError(f"`git {' '.join(args)}` failed in {cwd}:\n{err}")
    return proc


@dataclasses.dataclass
class Series:
    dir: Path
    label: str  # "series 2.13" (or "series DIR", or "an earlier series": one applied before)
    patches: List[Patch]
    files: List[str]  # every file the series touches
    created: List[str]  # the files it adds

    def same(self, other: "Series") -> bool:
        return [(p.name, p.data) for p in self.patches] == [(p.name, p.data) for p in other.patches]


def load_series(series_dir: Optional[os.PathLike] = None, *, line: Optional[str] = None) -> Series:
    """``series_dir``/series (default: the shipped series of ``line``) and its patches."""
    d = Path(series_dir) if series_dir is not None else PATCHES_DIR / (line or "2.13")
    try:
        entries = [e.split("#", 1)[0].strip()
                   for e in (d / "series").read_text(encoding="utf-8").splitlines()]
        patches = [Patch(Path(e).name, d / e, (d / e).read_bytes(), []) for e in entries if e]
    except OSError as e:
        raise TorchPatchError(f"cannot read {e.filename} ({e.strerror}).\nReinstall torch_patch, "
                              "regenerate the series (`torch-patch dev --export`),\n"
                              "or pass --series DIR.") from None
    series = Series(d, f"series {d.name if d.parent == PATCHES_DIR else d}", patches, [], [])
    for patch in patches:
        text = patch.data.decode(errors="replace")
        for section in re.split(r"^(?=diff --git )", text, flags=re.M)[1:]:
            for rel in re.match(r"diff --git a/(\S+) b/(\S+)\n", section).groups():
                if rel.split("/")[0] != "torch" or {"", ".", ".."} & set(rel.split("/")):
                    raise TorchPatchError(f"{patch.path} touches {rel}, outside torch/.\nA library "
                                          "patch changes only torch/ (export adds the tests).")
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

    saved = property(lambda self: self.state_dir / "saved")
    arg = property(lambda self: shlex.quote(str(self.root)))  # TARGET in the commands we suggest
    release = property(lambda self: re.match(r"\d+\.\d+\.\d+", self.version)[0])  # x.y.z


def _within(path: os.PathLike, root: os.PathLike) -> bool:
    root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(path), root]) == root


def resolve_target(target: Optional[os.PathLike] = None, *, allow_system=False, require_venv=True,
                   verb: str = "patch", check_base: bool = True) -> Target:
    """TARGET, or the torch this Python imports (in a venv only, unless ``allow_system``)."""
    if target is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            raise TorchPatchError(f"no torch is importable by {sys.executable}.\nInstall one "
                                  f"(pip install torch=={RELEASE_LINES['2.13']}) or pass TARGET.")
        root = Path(list(spec.submodule_search_locations)[0]).resolve().parent
        if require_venv and not allow_system and (sys.prefix == sys.base_prefix or (
                _within(root, sys.base_prefix) and not _within(root, sys.prefix))):
            raise TorchPatchError(f"refusing to {verb} {root}: it is not the torch of a virtual "
                                  f"environment that runs {sys.executable}.\n"
                                  "Use a venv, pass TARGET, or pass --allow-system.")
    else:
        root = Path(target).expanduser().resolve()
        root = root.parent if root.name == "torch" and (root / "__init__.py").is_file() else root
    if not (root / "torch" / "__init__.py").is_file():
        message = (f"{root} has no torch/__init__.py.\nPass a PyTorch checkout, or the directory "
                   "with an installed torch/ in it\n(of a venv: VENV/lib/python3.X/site-packages).")
        if (root / "torch").is_dir():
            left = " ".join(shlex.quote(str(root / name)) for name in ("torch", ".torch-patch"))
            message += f"\n`pip uninstall torch` left files there? rm -r {left} removes them."
        raise TorchPatchError(message)
    m = re.search(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)""",
                  (_read(root / "torch" / "version.py") or b"").decode(errors="replace"), re.M)
    version = m[1] if m else (_read(root / "version.txt") or b"").decode().strip() or None
    git_dir = (root / ".git").exists() and run_git(["rev-parse", "--absolute-git-dir"],
                                                   root).stdout.decode().strip()
    state_dir = Path(git_dir) / "torch-patch" if git_dir else root / ".torch-patch"
    t = Target(root, "checkout" if git_dir else "installed", state_dir, version,
               release_line(version))
    if check_base and t.line is None:
        raise _mismatch(t)
    return t


def _mismatch(t: Target) -> TorchPatchError:
    older = [int(n) for n in re.findall(r"\d+", t.version or "")[:2]] < [2, 13]
    near = list(RELEASE_LINES.values())[0 if older else -1]  # every supported version has a line
    return TorchPatchError(f"base mismatch: torch {t.version or '(version unknown)'} at {t.root}\n"
                           f"The series are for torch {', '.join(RELEASE_LINES)}: install "
                           f"torch=={near} (or check out v{near}).", EXIT_BASE_MISMATCH)


def _apply(series: Series, files: Files, reverse=False, only: Optional[str] = None
           ) -> Tuple[Files, str]:
    """What `git apply` (-R if ``reverse``; of file ``only``) makes of ``files``, or ({}, why)."""
    patches = [p for p in series.patches if only is None or only in p.files][::-1 if reverse else 1]
    if not patches:
        return dict(files), ""
    with tempfile.TemporaryDirectory(prefix="torch-patch-") as d:
        write_files(Path(d), files)
        args = ["apply", "--whitespace=nowarn", *["--reverse"] * reverse,
                *[f"--include={only}"] * bool(only), *(str(p.path) for p in patches)]
        proc = run_git(args, Path(d), check=False,
                       env=git_env({"GIT_CEILING_DIRECTORIES": str(Path(d).parent)}))
        if proc.returncode == 0:
            return {rel: _read(Path(d) / rel) for rel in files}, ""
    err = proc.stderr.decode(errors="replace")
    m = re.search(r"patch failed: (\S+):(\d+)", err)
    for p in patches if m else []:  # name the patch and the hunk
        section = next((s for s in p.data.decode(errors="replace").split("\ndiff --git ")
                        if s.startswith(f"a/{m[1]} ")), "")
        heads = re.findall(r"^(@@ -(\d+)\S* \S+ @@.*)$", section, re.M)
        for i, (head, start) in enumerate(heads):
            if start == m[2]:
                return {}, (f"Patch {p.name} does not apply:\n{m[1]}, hunk #{i + 1} of "
                            f"{len(heads)} does not fit:\n{head}")
    errors = [line[7:] for line in err.splitlines() if line.startswith("error: ")]
    return {}, "git apply: " + "; ".join(errors)


@dataclasses.dataclass
class Exam:
    """Each file the series touches: its bytes now, stock and patched (where known)."""
    t: Target
    series: Series
    saved: bool  # the stock versions come from the state dir
    current: Files
    stock: Files
    patched: Files
    failure: str = ""  # why the series does not apply to the files as they are

    @property
    def kinds(self) -> Dict[str, str]:
        return {rel: STOCK if rel in self.stock and cur == self.stock[rel] else PATCHED
                if rel in self.patched and cur == self.patched[rel] else OTHER
                for rel, cur in self.current.items()}

    def of(self, *kinds: str) -> List[str]:
        return [rel for rel, kind in self.kinds.items() if kind in kinds]

    @property
    def head(self) -> str:  # what the status line says after the state
        n = len(self.series.patches)
        patches = "1 patch" if n == 1 else f"{n} patches"
        return f"{patches} ({self.series.label}) on torch {self.t.version} at {self.t.root}"


def _current(t: Target, series: Series) -> Files:
    state = [t.state_dir, *(t.state_dir / name for name in ("saved", "saved.tmp", "saved.old"))]
    for path in [*state, *(t.root / rel for rel in series.files)]:  # never write through a link
        if path.is_symlink() or path not in state and not _within(path.parent, t.root):
            raise TorchPatchError(f"{path} is a symbolic link, or in a directory that links out of "
                                  f"{t.root}.\ntorch-patch replaces files, inside the target only: "
                                  "put a copy there instead.")
    return {rel: _read(t.root / rel) for rel in series.files}


def examine(t: Target, series: Series, use_saved: bool = True) -> Exam:
    """The files against the saved series while any of it is applied, else against ``series``."""
    if use_saved and t.saved.is_dir():
        saved = load_series(t.saved / "patches")
        stock = {rel: _read(t.saved / "orig" / rel) for rel in saved.files}
        patched, why = _apply(saved, stock)
        if not patched and saved.files:
            raise TorchPatchError(f"the stock files saved in {t.saved} do not take their series.\n"
                                  f"{why}\nRemove {t.saved}.")
        saved.label = series.label if saved.same(series) else "an earlier series"
        ex = Exam(t, saved, True, _current(t, saved), stock, patched)
        fresh = examine(t, series, False) if ex.of(OTHER) or not ex.of(PATCHED) else None
        if fresh and (not ex.of(PATCHED, OTHER) or not fresh.of(PATCHED, OTHER)):
            return fresh  # none of the saved series is applied, or another release's stock files
        return ex
    cur = _current(t, series)
    patched, why = _apply(series, cur)
    stock = dict(cur) if patched else _apply(series, cur, reverse=True)[0]
    ex = Exam(t, series, False, cur, stock, patched or (dict(cur) if stock else {}),
              "" if stock else why)
    for rel in [] if stock else series.files:
        fwd = _apply(series, {rel: cur[rel]}, only=rel)[0]
        back = {} if fwd else _apply(series, {rel: cur[rel]}, reverse=True, only=rel)[0]
        if fwd or back:
            ex.stock[rel], ex.patched[rel] = (cur[rel], fwd[rel]) if fwd else (back[rel], cur[rel])
    return ex


def _committed(t: Target, files: List[str]) -> bool:
    """A checkout whose HEAD has these files as they are (the series committed with `git am`)."""
    return t.kind == "checkout" and not run_git(
        ["--no-optional-locks", "status", "--porcelain", "--untracked-files=all", "--", *files],
        t.root).stdout.strip()


def _state(ex: Exam) -> Tuple[int, str, str]:
    """(exit code, state, what status prints: the state and head, then what to do)."""
    t, other, patched = ex.t, ex.of(OTHER), ex.of(PATCHED)
    fix = f"`torch-patch apply {t.arg}` finishes it.\n`torch-patch revert {t.arg}` undoes it."
    if other:
        state = f"Neither stock nor patched: {', '.join(other)}."
        if ex.saved:
            fix = (f"`torch-patch revert --force {t.arg}` puts the stock files back.\n"
                   f"`torch-patch apply --force {t.arg}` the patched ones (the edits are lost).")
        else:
            fix = (f"Put the stock files back (pip install --force-reinstall torch=={t.release},\n"
                   "or git checkout), then apply.")
        return EXIT_MODIFIED, "modified", f"modified: {ex.head}\n{state}\n{fix}"
    if not patched:
        return EXIT_NOT_APPLIED, "not applied", f"not applied: {ex.head}"
    if len(patched) == len(ex.kinds):
        note = "" if ex.saved else "\nNot by torch-patch (e.g. plain `git apply`)."
        if ex.series.label == "an earlier series":
            note = (f"\ntorch_patch now has another series for {t.line}: "
                    f"`torch-patch apply {t.arg}` replaces it.")
        elif not ex.saved and _committed(t, patched):
            note = "\nCommitted in this checkout (e.g. with `git am`)."
        return EXIT_APPLIED, "applied", f"applied: {ex.head}{note}"
    if set(patched) <= set(ex.series.created):
        return EXIT_NOT_APPLIED, "not applied", (
            f"not applied: {ex.head}\nLeft over from an earlier apply (torch reinstalled, or "
            f"`git checkout`?):\n{', '.join(patched)}\n{fix}")
    done = f"{len(patched)} of {len(ex.kinds)} files patched."
    return EXIT_PARTLY, "partly applied", f"partly applied: {ex.head}\n{done}\n{fix}"


@contextlib.contextmanager
def _locked(t: Target, verb: str = "", series: Optional[Series] = None,
            log: Log = lambda message: print(message, file=sys.stderr)) -> Iterator[None]:
    """One torch-patch per target (a flock); while ``verb`` changes files, errors say the state."""
    fd, mode = os.open(t.root, os.O_RDONLY), fcntl.LOCK_EX if verb else fcntl.LOCK_SH
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another torch-patch working on {t.root} to finish…")
            fcntl.flock(fd, mode)
        yield
    except (OSError, KeyboardInterrupt) as e:
        if not verb:
            raise
        message, code = "stopped by Ctrl-C", EXIT_SIGINT
        if isinstance(e, OSError):
            message, code = (f"{verb} failed: {oserror(e)}\n{FIXES.get(e.errno, 'Fix that')}, "
                             f"then run `torch-patch {verb} {t.arg}` again."), EXIT_ERROR
        try:
            message += f"\nThe target is now:\n{_state(examine(t, series))[2]}"
        except (TorchPatchError, OSError) as error:
            message += (f"\nThe target's state is unknown ({error}):\n"
                        f"see `torch-patch status {t.arg}`.")
        raise TorchPatchError(message, code) from None
    finally:
        os.close(fd)


def oserror(e: OSError) -> str:
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def _forget(t: Target, keep_dir: bool = False) -> None:
    """Drop the saved files (a rename, then delete), and the state dir if that empties it."""
    if t.saved.is_dir():
        os.rename(t.saved, t.state_dir / "saved.old")
    for name in ("saved.old", "saved.tmp"):
        shutil.rmtree(t.state_dir / name, ignore_errors=True)
    if not keep_dir and t.state_dir.is_dir() and not any(t.state_dir.iterdir()):
        t.state_dir.rmdir()


def _switch(ex: Exam, to: str) -> None:
    """Save the stock files and series (all or none), then switch each file by an os.replace."""
    if not ex.saved:
        tmp = ex.t.state_dir / "saved.tmp"
        _forget(ex.t, keep_dir=True)
        write_files(tmp / "orig", ex.stock)
        names = "".join(f"{p.name}\n" for p in ex.series.patches).encode()
        write_files(tmp / "patches",
                    {"series": names, **{p.name: p.data for p in ex.series.patches}})
        os.rename(tmp, ex.t.saved)
        ex.saved = True
    want = ex.stock if to == STOCK else ex.patched
    for rel in sorted(ex.series.files, key=lambda rel: (rel in ex.series.created, rel),
                      reverse=to == STOCK):
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
    if not any(os.path.realpath(p or ".") == os.path.realpath(ex.t.root) for p in sys.path):
        return
    import py_compile  # the bytecode of a torch this Python imports, for read-only processes
    for path in (ex.t.root / rel for rel in ex.series.files if want[rel] is not None):
        with contextlib.suppress(OSError):
            if path.suffix == ".py" and not (path.parent / "__pycache__").is_symlink():
                py_compile.compile(str(path), quiet=2,
                                   invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


def _revert(ex: Exam, force: bool) -> None:
    t, (code, _, message) = ex.t, _state(ex)
    if code == EXIT_MODIFIED and not (force and ex.saved):
        raise TorchPatchError(f"refusing to revert:\n{message}", EXIT_MODIFIED)
    if not ex.saved and _committed(t, ex.series.files):
        raise TorchPatchError(
            f"refusing to revert: the series is committed in {t.root},\n"
            "and revert changes only the working tree. Remove the commits with git\n"
            f"(`git revert`, or `git reset --hard v{t.release}` on a branch made for them).",
            EXIT_MODIFIED)
    _switch(ex, STOCK)
    _forget(t)


def apply(target: Optional[os.PathLike] = None, *, series_dir: Optional[os.PathLike] = None,
          allow_system: bool = False, force: bool = False, log: Log = print) -> None:
    """Apply the target's series (reverting an earlier one); edited files need ``force``."""
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
            raise TorchPatchError("\n".join(filter(None, ["cannot apply:", message, ex.failure])),
                                  code)
        if code != EXIT_APPLIED:
            _switch(ex, PATCHED)
    log(f"already {message}\nNothing to do." if code == EXIT_APPLIED else _state(ex)[2])


def revert(target: Optional[os.PathLike] = None, *, force: bool = False, allow_system: bool = False,
           series_dir: Optional[os.PathLike] = None, log: Log = print) -> None:
    """Put the stock files back; edited files (without ``force``), committed series: exit 6."""
    t = resolve_target(target, allow_system=allow_system, verb="revert")
    series = load_series(series_dir, line=t.line)
    with _locked(t, "revert", series, log):
        ex = examine(t, series)
        if not ex.of(PATCHED, OTHER):
            _forget(t)
            return log(f"{_state(ex)[2]}\nNothing to revert.")
        _revert(ex, force)
    log(f"reverted: {ex.head}\nIts {len(ex.series.files)} files are stock again.")


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
    stock_files: Dict[str, str] = dataclasses.field(default_factory=dict)  # each stock version


def status(target: Optional[os.PathLike] = None, *,
           series_dir: Optional[os.PathLike] = None) -> Status:
    """The state of the target's files (it waits while another torch-patch changes them)."""
    t = resolve_target(target, require_venv=False, check_base=False)
    if t.line is None:
        return Status(EXIT_BASE_MISMATCH, "base mismatch", str(_mismatch(t)), str(t.root), t.kind,
                      t.version, None, [])
    with _locked(t):
        ex = examine(t, load_series(series_dir, line=t.line))
    stock = {rel: str(t.root / rel if kind == STOCK else t.saved / "orig" / rel)
             for rel, kind in ex.kinds.items()
             if ex.stock.get(rel) is not None and (kind == STOCK or ex.saved)}
    return Status(*_state(ex), str(t.root), t.kind, t.version, t.line,
                  [p.name for p in ex.series.patches], ex.kinds, stock)


def stock_versions(t: Target, series: Series) -> Files:
    """The stock bytes of each file that ``series``, or the series applied, touches."""
    with _locked(t):
        ex = examine(t, series)
    if ex.of(OTHER):
        raise TorchPatchError(f"cannot tell the stock files of {t.root}:\n{_state(ex)[2]}")
    return {**{rel: _read(t.root / rel) for rel in series.files}, **ex.stock}


def stock_file_path(path: str, target: Optional[os.PathLike] = None, *,
                    series_dir: Optional[os.PathLike] = None) -> Path:
    """The path of the stock version of PATH: the saved one if the file is patched, else PATH."""
    t = resolve_target(target, require_venv=False)
    rel = os.path.relpath(path, t.root) if os.path.isabs(path) else Path(path).as_posix()
    st = status(t.root, series_dir=series_dir)
    if rel in st.stock_files or (rel not in st.files and rel.startswith("torch/")
                                 and (t.root / rel).is_file()):
        return Path(st.stock_files.get(rel, t.root / rel))
    if rel not in st.files:
        why = (f"{t.root / rel} is no file of the torch package.\n"
               "Pass a path like torch/utils/_pytree.py.")
    elif st.files[rel] != OTHER and rel in load_series(series_dir, line=t.line).created:
        why = "stock torch has no such file (the series adds it)."
    else:
        why = f"{st.message}\nTake it from git (`git show v{t.release}:{rel}`) or from the wheel."
    raise TorchPatchError(f"no stock version of {rel} is on disk:\n{why}")
