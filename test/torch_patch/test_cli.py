"""The command line a person reads: help, --version, exit codes, status lines, JSON, stock-file.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tp_helpers import NEW_FILE, REPO, RUNNING, TEST_FILES, git, run_cli, standin_checkout

from torch_patch import cli, core

VERBS = ["apply", "revert", "status", "stock-file", "export", "dev"]


def test_bare_command_prints_help():
    r = run_cli()
    assert r.returncode == 0 and r.stdout == run_cli("--help").stdout and r.stdout.startswith("usage: torch-patch")
    assert all(f"\n    {verb}" in r.stdout for verb in VERBS)


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and re.fullmatch(r"torch-patch \S+ \(series for torch 2\.13 \(2\.13\.0\), 2\.14 "
                                              r"\(2\.14\.1\), 2\.15 \(2\.15\.0\)\)\n", r.stdout), r.stdout


@pytest.mark.parametrize("verb", [None, *VERBS])
def test_help_is_wrapped_and_lists_the_exit_codes_once(verb):
    r = run_cli(*[verb] * bool(verb), "--help", env_extra={"COLUMNS": "100"})
    assert r.returncode == 0 and max(map(len, r.stdout.splitlines())) <= 100, r.stdout
    assert r.stdout.count("130  stopped by Ctrl-C") == (verb is None)
    assert verb is None or r.stdout.endswith("exit codes: torch-patch --help\n")


def test_documented_exit_codes_are_the_codes():
    """The --help list and docs/tool.md's paragraph name the codes that the code uses (and status's states)."""
    codes = {core.EXIT_APPLIED: "applied", core.EXIT_NOT_APPLIED: "not applied", core.EXIT_USAGE: "usage",
             core.EXIT_BASE_MISMATCH: "base mismatch", core.EXIT_PARTLY: "partly applied", core.EXIT_ERROR: "error",
             core.EXIT_MODIFIED: "modified", core.EXIT_SIGINT: "stopped by Ctrl-C"}
    assert (core.EXIT_USAGE, core.EXIT_MODIFIED) == (2, 6)
    assert {int(c): s for c, s in re.findall(r"^  (\d+) +([a-z]+(?: [a-z]+)?)", cli.EXIT_CODES, re.M)} == {
        c: s.replace(" by Ctrl-C", " by") for c, s in codes.items()}
    readme = " ".join((REPO / "docs" / "tool.md").read_text().split())
    paragraph = readme.split("Exit codes, the same for every verb: ", 1)[1].split(". ", 1)[0]
    assert [int(c) for c in re.findall(r"(?:^|, )(\d+) ", paragraph)] == list(codes)
    assert all(f"{c} {s}" in paragraph for c, s in codes.items()), paragraph


@pytest.mark.parametrize("args,error", [
    (["no-such-verb"], "torch-patch: error: argument VERB: invalid choice: 'no-such-verb'"),
    (["apply", "--no-such-option"], "torch-patch: error: unrecognized arguments: --no-such-option"),
    (["stock-file"], "torch-patch stock-file: error: the following arguments are required: PATH"),
    (["dev"], "torch-patch dev: error: dev needs DIR: the dev tree to create (or to --export)"),
    (["dev", "--export"], "torch-patch dev: error: dev needs DIR: the dev tree to create (or to --export)")])
def test_usage_error_exits_2_with_the_usage(args, error):
    """As argparse does: exit code 2, the usage, then the error (6, not 2, means modified)."""
    r = run_cli(*args)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("usage: torch-patch") and r.stderr.splitlines()[-1].startswith(error), r.stderr


def test_modified_exits_6(target, test_series):
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    (target / TEST_FILES[0]).write_text("# edited\n")
    r = run_cli("status", target, "--series", test_series, "--json")
    assert (r.returncode, json.loads(r.stdout)["code"], json.loads(r.stdout)["state"]) == (6, 6, "modified")
    for verb in ("status", "apply", "revert"):
        assert run_cli(verb, target, "--series", test_series).returncode == 6, verb


def test_status_json_and_its_errors_are_json(tmp_path, target, test_series):
    r = run_cli("status", target, "--series", test_series, "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 1 and data == {
        "code": 1, "state": "not applied", "target": str(target),
        "message": f"not applied: 2 patches (series {test_series}) on torch {RUNNING.version} at {target}",
        "kind": "installed", "torch_version": RUNNING.version, "release_line": RUNNING.line,
        "patches": (test_series / "series").read_text().split(), "stock_files": {rel: str(target / rel) for rel in
                                                                                TEST_FILES},
        "files": {rel: "stock" for rel in [TEST_FILES[1], TEST_FILES[0], NEW_FILE]}}
    r = run_cli("status", tmp_path / "nothing", "--json")
    assert r.returncode == 5 and r.stderr == "" and json.loads(r.stdout) == {
        "state": "error", "code": 5, "message": f"{tmp_path / 'nothing'} has no torch/__init__.py.\nPass a PyTorch "
                                                f"checkout, or the directory with an installed torch/ in it\n(of a "
                                                f"venv: VENV/lib/python3.X/site-packages)."}


def test_status_verbose_lists_patches_and_files(target, test_series):
    run_cli("apply", target, "--series", test_series)
    r = run_cli("status", target, "--series", test_series, "--verbose")
    names = (test_series / "series").read_text().split()
    assert r.stdout.splitlines()[1:] == [f"  {names[0]}", f"  {names[1]}", f"  {TEST_FILES[0]}: patched",
                                         f"  {TEST_FILES[1]}: patched", f"  {NEW_FILE}: patched"]


def test_stock_file(target, template, test_series):
    rel = TEST_FILES[0]
    r = run_cli("stock-file", rel, target, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"{target / rel}\n")
    run_cli("apply", target, "--series", test_series)
    r = run_cli("stock-file", rel, target, "--series", test_series)
    assert (r.returncode, r.stdout) == (0, f"{target / '.torch-patch' / 'saved' / 'orig' / rel}\n")
    assert (target / ".torch-patch" / "saved" / "orig" / rel).read_bytes() == (template / rel).read_bytes()
    assert run_cli("stock-file", target / rel, target, "--series", test_series).stdout == r.stdout
    r = run_cli("stock-file", "torch/version.py", target, "--series", test_series)  # not touched by the series
    assert (r.returncode, r.stdout) == (0, f"{target / 'torch/version.py'}\n")
    r = run_cli("stock-file", NEW_FILE, target, "--series", test_series)
    assert (r.returncode, r.stderr) == (5, f"torch-patch: error: no stock version of {NEW_FILE} is on disk:\nstock "
                                           f"torch has no such file (the series adds it).\n")
    r = run_cli("stock-file", "utils/_pytree.py", target, "--series", test_series)
    assert (r.returncode, r.stderr) == (5, f"torch-patch: error: no stock version of utils/_pytree.py is on disk:\n"
                                           f"{target}/utils/_pytree.py is no file of the torch package.\nPass a path "
                                           f"like torch/utils/_pytree.py.\n")


def test_no_line_of_a_message_is_over_100_characters(tmp_path, template, test_series, first_patch_only):
    """Each state and error the tool reports, on a target and series at short paths (the paths are
    the user's): every line of what it prints is at most 100 characters."""
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # /tmp/tXXXXXXXX
    try:
        t, s, s1, co = short / "t", short / "s", short / "1", short / "c"
        shutil.copytree(template, t)
        shutil.copytree(test_series, s)
        shutil.copytree(first_patch_only, s1)
        runs = [("status", t, "--series", s), ("apply", t, "--series", s1), ("status", t, "--series", s),
                ("apply", t, "--series", s), ("apply", t, "--series", s), ("stock-file", NEW_FILE, t, "--series", s),
                ("stock-file", "utils/x.py", t, "--series", s), ("dev", short / "d", "--from", t, "--series", s)]
        (t / TEST_FILES[1]).write_text("# edited\n")
        runs += [("status", t, "--series", s), ("apply", t, "--series", s), ("revert", t, "--series", s),
                 ("dev", short / "d", "--from", t, "--series", s), ("stock-file", TEST_FILES[1], t, "--series", s),
                 ("revert", t, "--series", s, "--force"), ("revert", t, "--series", s), ("status", short),
                 ("dev", "--export", short), ("no-such-verb",), ("dev",), ("apply", "--bad")]
        out = [run_cli(*args) for args in runs]
        shutil.copytree(template, t, dirs_exist_ok=True)
        assert run_cli("apply", t, "--series", s).returncode == 0
        shutil.copytree(template / "torch", t / "torch", dirs_exist_ok=True)  # reinstalled: left over
        out += [run_cli("status", t, "--series", s), run_cli("revert", t, "--series", s)]
        standin_checkout(co, template)
        git("am", *[str(s / n) for n in (s / "series").read_text().split()], cwd=co)
        out += [run_cli("status", co, "--series", s), run_cli("revert", co, "--series", s)]
        (t / "torch" / "version.py").write_text("__version__ = '2.16.0'\n")
        out += [run_cli("status", t), run_cli("apply", t)]
        lines = [line for r in out for line in (r.stdout + r.stderr).splitlines()
                 if not line.startswith("torch-patch: error: argument VERB: invalid choice")]  # argparse's
        assert any("Neither stock nor patched" in line for line in lines)
        assert [line for line in lines if len(line) > 100] == []
    finally:
        shutil.rmtree(short)
