"""torch-patch run by root on a tree someone else owns (issue #18).

The state dir of such a tree is writable by its owner, so ``journal.json`` and ``state.json``
are untrusted input: a planted journal must not make torch-patch write or delete anything
outside the target root and its state dir, damaged records give a one-line error naming the
file and the fix, records owned by a third user are refused, a disk that fills up midway
leaves the target intact (and says so), and a touched file that is a symlink is refused
before anything changes.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tp_helpers import NEW_FILE, TEST_FILES, run_cli, tree_digest

from torch_patch import cli, core


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def no_state(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith(".torch-patch/")}


def one_line_error(r, *needles: str) -> None:
    """exit 5, exactly one line on stderr (no traceback), containing every needle."""
    assert r.returncode == 5, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("torch-patch: error: "), r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory next to the target that torch-patch must never touch."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim.txt").write_text("precious\n")
    return d


def plant_journal(target: Path, journal: dict, staged: dict = None) -> Path:
    """Write ``journal`` as the target's journal.json, and ``staged`` ({path below the state
    dir: bytes}) next to it."""
    state_dir = target / ".torch-patch"
    state_dir.mkdir(exist_ok=True)
    for rel, data in (staged or {}).items():
        (state_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (state_dir / rel).write_bytes(data)
    path = state_dir / "journal.json"
    path.write_text(json.dumps(journal))
    return path


def dummy_state() -> dict:
    return {"format": 1, "series_id": "x", "patches": ["0001-x.patch"], "torch_version": "2.13.0",
            "kind": "installed", "files": {}}


# ------------------------------------------------------------------------------------------
# a planted journal


@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_planted_journal_with_dotdot_path_writes_nothing_outside(target, test_series, outside, verb):
    """A path with `..` in the journal would make torch-patch move a planted file out of the
    target (root writes a file into any directory)."""
    payload = b"planted by the tree's owner\n"
    rel = "torch/../../outside/pwned"
    journal = {"op": "apply", "layout": 2, "stage": "stage-evil", "state": dummy_state(),
               "files": {rel: {"before": None, "after": sha(payload)}}}
    jpath = plant_journal(target, journal, {"stage-evil/outside/pwned": payload,  # = new/torch/../../outside
                                            "stage-evil/new/torch/.keep": b""})
    before, outside_before = tree_digest(target), tree_digest(outside)
    r = run_cli(verb, target, "--series", test_series)
    assert not (outside / "pwned").exists()
    assert tree_digest(outside) == outside_before and tree_digest(target) == before
    one_line_error(r, str(jpath), "remove", "`..`")


def test_planted_journal_with_absolute_path_deletes_nothing_outside(target, test_series, outside):
    victim = outside / "victim.txt"
    journal = {"op": "apply", "layout": 2, "stage": "stage-evil", "state": dummy_state(),
               "files": {str(victim): {"before": sha(victim.read_bytes()), "after": None}}}
    jpath = plant_journal(target, journal)
    before = tree_digest(target)
    r = run_cli("apply", target, "--series", test_series)
    assert victim.exists() and victim.read_text() == "precious\n"
    assert tree_digest(target) == before
    one_line_error(r, str(jpath), "absolute path", "remove")


@pytest.mark.parametrize("stage", ["ABS", "..", "stage-x/..", "orig"])
@pytest.mark.parametrize("verb", ["apply", "revert", "status"])
def test_planted_journal_stage_must_be_a_stage_dir(target, test_series, outside, stage, verb):
    """`stage` absolute would make torch-patch `rm -rf` it, `..` would delete torch's files."""
    stage = str(outside) if stage == "ABS" else stage
    jpath = plant_journal(target, {"op": "revert", "layout": 2, "stage": stage, "files": {}})
    before, outside_before = tree_digest(target), tree_digest(outside)
    r = run_cli(verb, target, "--series", test_series)
    assert outside.is_dir() and tree_digest(outside) == outside_before
    assert (target / "torch" / "__init__.py").exists() and no_state(tree_digest(target)) == no_state(before)
    one_line_error(r, str(jpath), "'stage'", "remove")
    assert tree_digest(target) == before


def test_planted_journal_through_symlinked_directory(target, test_series, outside):
    """A directory of the target that is a symlink out of it: nothing is written through it."""
    (target / "torch" / "evil").symlink_to(outside)
    payload = b"planted\n"
    rel = "torch/evil/pwned.py"
    journal = {"op": "apply", "layout": 2, "stage": "stage-evil", "state": dummy_state(),
               "files": {rel: {"before": None, "after": sha(payload)}}}
    plant_journal(target, journal, {"stage-evil/new/" + rel: payload})
    outside_before = tree_digest(outside)
    r = run_cli("apply", target, "--series", test_series)
    assert tree_digest(outside) == outside_before and not (outside / "pwned.py").exists()
    one_line_error(r, str(target / "torch" / "evil"), "leads outside the target", str(outside))


def test_planted_stage_with_symlink_out_of_it(target, test_series, outside):
    """The staged copy named by the journal lies below a symlink out of the state dir: torch-patch
    does not move the linked file (outside) into the target."""
    (outside / Path(NEW_FILE).name).write_text("secret = 1\n")  # what new/<NEW_FILE> leads to
    rel = NEW_FILE
    journal = {"op": "apply", "layout": 2, "stage": "stage-evil", "state": dummy_state(),
               "files": {rel: {"before": None, "after": sha(b"secret = 1\n")}}}
    plant_journal(target, journal)
    (target / ".torch-patch" / "stage-evil" / "new" / "torch").mkdir(parents=True)
    (target / ".torch-patch" / "stage-evil" / "new" / "torch" / "utils").symlink_to(outside)
    outside_before = tree_digest(outside)
    r = run_cli("apply", target, "--series", test_series)
    assert tree_digest(outside) == outside_before and not (target / rel).exists()
    one_line_error(r, "symbolic link out of", "remove")


# ------------------------------------------------------------------------------------------
# damaged (but valid JSON) records


STATE_DAMAGE = {
    "a list": lambda s: [s],
    "no files": lambda s: {k: v for k, v in s.items() if k != "files"},
    "files is a list": lambda s: {**s, "files": list(s["files"])},
    "series_id is a number": lambda s: {**s, "series_id": 7},
    "a record is a string": lambda s: {**s, "files": {rel: "x" for rel in s["files"]}},
    "hash not hex": lambda s: {**s, "files": {rel: {**rec, "after": "zz" * 32} for rel, rec in s["files"].items()}},
    "path absolute": lambda s: {**s, "files": {"/etc/passwd": {"before": None, "after": None}}},
    "unknown key": lambda s: {**s, "surprise": 1},
}


@pytest.mark.parametrize("damage", sorted(STATE_DAMAGE))
def test_damaged_state_is_a_one_line_error(target, test_series, damage):
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    state_file = target / ".torch-patch" / "state.json"
    state_file.write_text(json.dumps(STATE_DAMAGE[damage](json.loads(state_file.read_text()))))
    applied = tree_digest(target)
    for verb in ("status", "apply", "revert"):
        r = run_cli(verb, target, "--series", test_series)
        one_line_error(r, str(state_file), "remove")
    assert tree_digest(target) == applied
    state_file.unlink()  # the fix the message names
    assert run_cli("status", target, "--series", test_series).returncode == 0
    assert run_cli("revert", target, "--series", test_series).returncode == 0


JOURNAL_DAMAGE = {
    "a list": [],
    "no op": {"stage": "stage-abc", "files": {}},
    "op unknown": {"op": "explode", "stage": "stage-abc", "files": {}},
    "files is a list": {"op": "revert", "stage": "stage-abc", "files": []},
    "record without after": {"op": "revert", "stage": "stage-abc", "files": {TEST_FILES[0]: {"before": None}}},
    "apply without state": {"op": "apply", "stage": "stage-abc", "files": {}},
    "layout is a string": {"op": "revert", "layout": "2", "stage": "stage-abc", "files": {}},
}


@pytest.mark.parametrize("damage", sorted(JOURNAL_DAMAGE))
def test_damaged_journal_is_a_one_line_error(target, test_series, damage):
    jpath = plant_journal(target, JOURNAL_DAMAGE[damage])
    before = tree_digest(target)
    for verb in ("status", "apply", "revert"):
        one_line_error(run_cli(verb, target, "--series", test_series), str(jpath), "remove")
    assert tree_digest(target) == before


# ------------------------------------------------------------------------------------------
# records owned by another user


def _main(capsys, *args) -> tuple:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("which", ["state dir", "state.json", "journal.json"])
def test_records_owned_by_a_third_user_are_refused(target, test_series, monkeypatch, capsys, which):
    """(Ownership simulated through the tool's owner lookup: the tests run as one user.)"""
    assert _main(capsys, "apply", target, "--series", test_series)[0] == 0
    state_dir = target / ".torch-patch"
    if which == "journal.json":  # a journal of a revert that has nothing left to do
        plant_journal(target, {"op": "revert", "layout": 2, "stage": "stage-abc", "files": {}})
    path = {"state dir": state_dir, "state.json": state_dir / "state.json",
            "journal.json": state_dir / "journal.json"}[which]
    real = core._owner_uid
    monkeypatch.setattr(core, "_owner_uid", lambda p: 4242 if Path(p) == path else real(p))
    applied = tree_digest(target)
    for verb in ("status", "apply", "revert"):
        code, out, err = _main(capsys, verb, target, "--series", test_series)
        assert code == 5 and len(err.strip().splitlines()) == 1, (verb, out, err)
        assert f"{path} is owned by uid 4242" in err and f"remove {path}" in err and "chown" in err
    assert tree_digest(target) == applied
    monkeypatch.setattr(core, "_owner_uid", real)
    assert _main(capsys, "revert", target, "--series", test_series)[0] == 0


def test_records_of_the_torch_owner_are_accepted(target, test_series, monkeypatch, capsys):
    """The tree's owner (simulated: uid 1000 owns everything) may write the records: run as root,
    torch-patch acts on them (they are validated, not refused)."""
    real = core._owner_uid
    monkeypatch.setattr(core, "_owner_uid", lambda p: None if real(p) is None else 1000)
    before = tree_digest(target)
    assert _main(capsys, "apply", target, "--series", test_series)[0] == 0
    assert _main(capsys, "status", target, "--series", test_series)[0] == 0
    assert _main(capsys, "revert", target, "--series", test_series)[0] == 0
    assert tree_digest(target) == before


# ------------------------------------------------------------------------------------------
# disk full


def _enospc(filename):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))


@pytest.mark.parametrize("verb,where", [("apply", "staging"), ("apply", "journal"),
                                        ("revert", "staging"), ("revert", "journal")])
def test_disk_full_leaves_the_target_intact(target, test_series, monkeypatch, capsys, verb, where):
    """ENOSPC while staging (copying files into the stage) or while writing the journal: one
    line, exit 5, saying that nothing was changed; the files and `status` are as before."""
    if verb == "revert":
        assert run_cli("apply", target, "--series", test_series).returncode == 0
    before = tree_digest(target)
    status_before = run_cli("status", target, "--series", test_series)
    if where == "staging":
        real_copy = shutil.copyfile

        def copyfile(src, dst, **kw):
            if Path(dst).is_relative_to(target / ".torch-patch") and "/new/" in str(dst):
                raise _enospc(dst)
            return real_copy(src, dst, **kw)
        monkeypatch.setattr(shutil, "copyfile", copyfile)
    else:
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(_enospc("journal.json.tmp")))
    code, out, err = _main(capsys, verb, target, "--series", test_series)
    monkeypatch.undo()
    assert code == 5 and "Traceback" not in err and len(err.strip().splitlines()) == 1, out + err
    assert "No space left on device" in err and "nothing was changed" in err and str(target) in err
    assert tree_digest(target) == before  # also: no journal, no stage, no .tmp left
    r = run_cli("status", target, "--series", test_series)
    assert (r.returncode, r.stdout) == (status_before.returncode, status_before.stdout)


def test_disk_full_after_the_switch_says_what_the_target_is(target, test_series, monkeypatch, capsys):
    """ENOSPC when writing state.json, after every file was switched: the message says the
    target is now applied and the next apply finishes the bookkeeping."""
    calls = []
    real_write = core._write_json_atomic

    def write(path, data):
        calls.append(path.name)
        if path.name == "state.json":
            raise _enospc(path)
        return real_write(path, data)
    monkeypatch.setattr(core, "_write_json_atomic", write)
    code, out, err = _main(capsys, "apply", target, "--series", test_series)
    monkeypatch.undo()
    assert calls == ["journal.json", "state.json"]
    assert code == 5 and len(err.strip().splitlines()) == 1, out + err
    assert "No space left on device" in err and "is now: applied (" in err and "`torch-patch apply` again" in err
    assert "nothing was changed" not in err
    r = run_cli("apply", target, "--series", test_series)
    assert r.returncode == 0 and "finishing interrupted apply" in r.stdout, r.stdout + r.stderr
    r = run_cli("status", target, "--series", test_series)
    assert r.returncode == 0 and r.stdout.startswith("applied (") and "killed" not in r.stdout


# ------------------------------------------------------------------------------------------
# a touched file that is a symlink


def test_symlinked_touched_file_is_refused_up_front(target, test_series, tmp_path):
    """Replacing the file would turn the link into a regular file (and leave the file it points
    to unpatched): refused before anything changes, naming the link and where it points."""
    real = tmp_path / "elsewhere" / "_pytree.py"
    real.parent.mkdir()
    link = target / TEST_FILES[0]
    shutil.move(link, real)
    link.symlink_to(real)
    before, real_before = tree_digest(target), real.read_bytes()
    for verb in ("apply", "status", "revert"):
        r = run_cli(verb, target, "--series", test_series)
        assert link.is_symlink() and os.readlink(link) == str(real) and real.read_bytes() == real_before
        one_line_error(r, f"{link} is a symbolic link (to {real})", "cp --remove-destination")
    assert tree_digest(target) == before and not (target / ".torch-patch").exists()
