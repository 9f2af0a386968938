"""The dev tree (dev, dev --export) and the upstream series (export): byte-stable, and `git am` takes them.

Run: python -m pytest test/torch_patch -q
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tp_helpers import (NEW_FILE, RELEASE, TEST_FILES, git, run_cli, series_names, standin_checkout,
                        tree_digest)

import torch_patch
from torch_patch import core, dev


def test_dev_export_is_byte_stable_and_prunes(tmp_path, test_series, dev_tree):
    out = tmp_path / "patches"
    torch_patch.dev_export(dev_tree, patches_dir=out, log=lambda s: None)
    assert tree_digest(out) == tree_digest(test_series)  # the same commits give the same bytes
    text = (out / series_names(out)[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
    assert "Subject: [PATCH] Test patch one" in text and "\n-- \n" not in text  # no git version signature
    (out / "0099-stale.patch").write_text("stale")
    torch_patch.dev_export(dev_tree, patches_dir=out, log=lambda s: None)
    assert tree_digest(out) == tree_digest(test_series)


def test_dev_export_refuses(tmp_path, template, empty_series):
    tree = tmp_path / "dev"
    torch_patch.dev_create(tree, source=template, series_dir=empty_series, log=lambda s: None)
    (tree / TEST_FILES[0]).write_text((tree / TEST_FILES[0]).read_text() + "# uncommitted\n")
    r = run_cli("dev", "--export", tree, "--patches-dir", tmp_path / "out")
    assert r.returncode == 5 and f"uncommitted changes to tracked files ({TEST_FILES[0]})" in r.stderr
    git("commit", "-q", "-am", "edit", cwd=tree)
    (tree / "test").mkdir()
    (tree / "test" / "test_x.py").write_text("pass\n")
    git("add", "-f", "test/test_x.py", cwd=tree)
    git("commit", "-q", "-m", "a test", cwd=tree)
    r = run_cli("dev", "--export", tree, "--patches-dir", tmp_path / "out")
    assert r.returncode == 5 and "touches test/test_x.py, outside torch/" in r.stderr
    r = run_cli("dev", "--export", template, "--patches-dir", tmp_path / "out")  # an installed torch, no tag
    assert (r.returncode, r.stderr) == (5, f"torch-patch: error: {template} is not a dev tree (a git checkout "
                                           f"tagged v{RELEASE}).\nCreate one with `torch-patch dev DIR`.\n")
    git("tag", "-d", f"v{RELEASE}", cwd=tree)
    r = run_cli("dev", "--export", tree, "--patches-dir", tmp_path / "out")
    assert r.returncode == 5 and f"{tree} is not a dev tree (a git checkout tagged v" in r.stderr
    assert not (tmp_path / "out").exists()


def test_dev_create_from_a_patched_torch(tmp_path, target, test_series, dev_tree):
    """dev takes the stock files of a patched torch; the commit hashes depend only on the files and series."""
    assert run_cli("apply", target, "--series", test_series).returncode == 0
    tree = tmp_path / "dev"
    r = run_cli("dev", tree, "--from", target, "--series", test_series)
    assert r.returncode == 0 and f"PYTHONPATH={tree} python" in r.stdout, r.stderr
    assert (tree / ".gitignore").read_text() == "*\n!*/\n!*.py\n!.gitignore\n"
    assert git("log", "--format=%s", cwd=tree).stdout.splitlines() == [
        "Test patch two", "Test patch one", f"PyTorch v{RELEASE} (python sources of the torch=={RELEASE} wheel)"]
    for rel in TEST_FILES:
        saved = target / ".torch-patch" / "saved" / "orig" / rel
        assert git("show", f"v{RELEASE}:{rel}", cwd=tree).stdout == saved.read_text()
        assert (tree / rel).read_bytes() == (target / rel).read_bytes()
    assert git("rev-parse", f"v{RELEASE}", cwd=tree).stdout == git("rev-parse", f"v{RELEASE}", cwd=dev_tree).stdout
    assert run_cli("dev", tmp_path / "dev2", "--from", target, "--series", test_series).returncode == 0
    assert git("rev-parse", "HEAD", cwd=tree).stdout == git("rev-parse", "HEAD", cwd=tmp_path / "dev2").stdout
    r = run_cli("dev", tree, "--from", target, "--series", test_series)
    assert r.returncode == 5 and "not empty" in r.stderr


def test_dev_create_refuses_an_edited_torch(tmp_path, target, test_series):
    edited = target / TEST_FILES[0]
    edited.write_text(edited.read_text().replace("\ndef tree_flatten(", "\ndef tree_flatten_renamed(", 1))
    r = run_cli("dev", tmp_path / "dev", "--from", target, "--series", test_series)
    assert r.returncode == 5 and f"cannot tell the stock files of {target}:\nmodified: " in r.stderr
    assert not (tmp_path / "dev").exists()


def test_same_change_ignores_blob_hashes_and_line_numbers():
    a = (b"Subject: [PATCH] x\n\ndiff --git a/f.py b/f.py\nindex 1111111..2222222 100644\n--- a/f.py\n"
         b"+++ b/f.py\n@@ -10,3 +10,4 @@ def f():\n ctx\n+new\n ctx\n")
    b = a.replace(b"1111111..2222222", b"3333333..4444444").replace(b"-10,3 +10,4 @@ def f", b"-52,3 +52,4 @@ def g")
    assert dev.same_change(a, b)
    assert not dev.same_change(a, a.replace(b"+new", b"+other"))
    assert not dev.same_change(a, a.replace(b" ctx\n+new", b" context\n+new"))


def test_dev_export_shares_a_patch_of_an_earlier_line(tmp_path, dev_tree):
    """Exported to patches/2.14/ next to a 2.13/ with the same changes, the series names 2.13's files and writes
    none; a patch that changed is written again."""
    root = tmp_path / "patches"
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.13", log=lambda s: None)
    names = series_names(root / "2.13")
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.14", log=lambda s: None)
    assert series_names(root / "2.14") == [f"../2.13/{n}" for n in names]
    assert sorted(p.name for p in (root / "2.14").iterdir()) == ["series"]
    assert core.load_series(root / "2.14").same(core.load_series(root / "2.13"))
    first = root / "2.13" / names[0]
    first.write_text(first.read_text().replace("Adds a comment", "Adds one comment"))
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.14", log=lambda s: None)
    assert series_names(root / "2.14") == [names[0], f"../2.13/{names[1]}"]
    assert "Adds a comment" in (root / "2.14" / names[0]).read_text()
    # the same change under another number (a line that lacks an earlier patch) is shared too
    renamed = root / "2.13" / ("0009" + names[1][4:])
    (root / "2.13" / names[1]).rename(renamed)
    torch_patch.dev_export(dev_tree, patches_dir=root / "2.14", log=lambda s: None)
    assert series_names(root / "2.14") == [names[0], f"../2.13/{renamed.name}"]


def test_shipped_series_of_every_line():
    """Each line has the same concerns in the same order, but for the changes its release already has (2.14
    traces slot setters in Dynamo, 2.15 also serializes structseqs by name); a shared entry names a file of an
    earlier line."""
    subjects = []
    for i, line in enumerate(core.RELEASE_LINES):
        series = core.load_series(line=line)
        for entry, patch in zip(series_names(series.dir), series.patches):
            assert entry == patch.name or entry == f"../{patch.path.parent.name}/{patch.name}"
            assert patch.path.parent.name in list(core.RELEASE_LINES)[:i + 1] and patch.path.is_file()
        subjects.append([re.search(rb"^Subject: \[PATCH\] (.*)$", p.data, re.M)[1] for p in series.patches])
    dynamo = b"[dynamo] Trace member_descriptor.__set__"
    upstream_has = {"2.14": (dynamo,), "2.15": (dynamo, b"[pytree] Serialize the structseqs")}  # subjects' starts
    for line, s in zip(core.RELEASE_LINES, subjects):
        expected = [t for t in subjects[0] if not t.startswith(upstream_has.get(line, (b"\0",)))]
        assert s == expected, line
    assert sorted(p.name for p in core.PATCHES_DIR.iterdir()) == sorted(core.RELEASE_LINES)


def _fake_repo(path: Path) -> Path:
    (path / "test" / "torch_patch").mkdir(parents=True)
    (path / "test" / "torch_patch" / "test_tool.py").write_text("raise AssertionError('tool test')\n")
    (path / "test" / "test_fake_family.py").write_text("def test_ok():\n    assert True\n")
    (path / "test" / "data").mkdir()
    (path / "test" / "data" / "expected.txt").write_text("data\n")
    (path / "test" / "__pycache__").mkdir()
    (path / "test" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (path / "benchmarks" / "pytree").mkdir(parents=True)
    (path / "benchmarks" / "pytree" / "bench_family.py").write_text("print('bench')\n")
    return path


def _pytest(checkout: Path, test: str) -> None:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checkout / test)],
                         capture_output=True, text=True, cwd=checkout)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_export_git_am_and_byte_stable(tmp_path, template, test_series):
    repo, out = _fake_repo(tmp_path / "repo"), tmp_path / "out"
    args = ["--repo", repo, "--from", template, "--series", test_series]
    r = run_cli("export", out, *args)
    assert r.returncode == 0 and "note:" not in r.stdout, r.stderr
    names = series_names(out)
    assert len(names) == 4 and names[:2] == series_names(test_series)
    assert all((out / n).read_bytes() == (test_series / n).read_bytes() for n in names[:2])
    tests = (out / names[2]).read_text()
    assert "Subject: [PATCH] [pytree] Add the pytree tests that no commit's Test Plan" in tests
    assert "\n    python test/test_fake_family.py\n" in tests and "test/data/expected.txt" in tests
    assert "test/torch_patch" not in tests and "__pycache__" not in tests
    assert "\n    python benchmarks/pytree/bench_family.py\n" in (out / names[3]).read_text()
    co = standin_checkout(tmp_path / "pytorch", template)
    assert git("am", "--keep-non-patch", *[str(out / n) for n in names], cwd=co, check=False).returncode == 0
    assert all(s.startswith("[pytree] ") for s in git("log", "--format=%s", "-2", cwd=co).stdout.splitlines())
    assert (co / "benchmarks/pytree/bench_family.py").exists() and not (co / "test/torch_patch").exists()
    assert "# torch-patch test: second patch" in (co / TEST_FILES[1]).read_text() and (co / NEW_FILE).exists()
    _pytest(co, "test/test_fake_family.py")
    assert run_cli("export", tmp_path / "out2", *args).returncode == 0
    assert tree_digest(tmp_path / "out2") == tree_digest(out)
    r = run_cli("export", out, *args)
    assert r.returncode == 5 and "not empty" in r.stderr
    assert run_cli("export", out, "--force", *args).returncode == 0
    assert tree_digest(out) == tree_digest(tmp_path / "out2")


def test_export_puts_tests_in_the_commit_whose_test_plan_names_them(tmp_path, template, test_series):
    """The second patch's Test Plan names a test (importing a module next to it) and a benchmark: they go into
    that commit, the benchmark with its directory; the trailing tests commit carries the rest."""
    repo = _fake_repo(tmp_path / "repo")
    (repo / "test" / "fake_helpers.py").write_text("HELPER = 1\n")
    (repo / "test" / "test_fake_family.py").write_text("from fake_helpers import HELPER\n\n\ndef test_ok():\n"
                                                       "    assert HELPER == 1\n")
    (repo / "benchmarks" / "pytree" / "_shared.py").write_text("X = 1\n")
    series = tmp_path / "series"
    shutil.copytree(test_series, series)
    second = series / series_names(series)[1]
    second.write_text(second.read_text().replace("adds one.", "adds one.\n\nTest Plan:\npython test/test_fake_family.py"
                                                 "\npython benchmarks/pytree/bench_family.py --quick\n", 1))
    out = tmp_path / "out"
    assert run_cli("export", out, "--repo", repo, "--from", template, "--series", series).returncode == 0
    names = series_names(out)

    def added(name: str) -> list:
        return sorted(f for f in re.findall(r"^diff --git a/(\S+) ", (out / name).read_text(), re.M)
                      if not f.startswith("torch/"))

    assert [added(n) for n in names] == [[], ["benchmarks/pytree/_shared.py", "benchmarks/pytree/bench_family.py",
                                              "test/fake_helpers.py", "test/test_fake_family.py"],
                                         ["test/data/expected.txt"]]
    co = standin_checkout(tmp_path / "pytorch", template)
    assert git("am", "--keep-non-patch", *[str(out / n) for n in names[:2]], cwd=co, check=False).returncode == 0
    _pytest(co, "test/test_fake_family.py")


def test_export_generic_cut_of_the_real_series(tmp_path, template):
    """--cut generic: the library patches before the first HuggingFace-specific one, byte for byte, with the
    tests their Test Plans name and none of the HuggingFace tests; `git am` takes them."""
    full, generic = tmp_path / "full", tmp_path / "generic"
    assert run_cli("export", full, "--from", template).returncode == 0
    r = run_cli("export", generic, "--cut", "generic", "--from", template)
    assert r.returncode == 0 and r.stdout.startswith("generic cut: "), r.stderr
    keep = int(re.match(r"generic cut: (\d+) of", r.stdout)[1])
    names = series_names(generic)[:keep]  # the library patches (a commit of other tests may follow)
    assert 0 < keep < len(series_names(full)) and names == series_names(full)[:keep]
    assert all((generic / n).read_bytes() == (full / n).read_bytes() for n in names)
    hf = re.compile(r"^\+.*\b(?:transformers|diffusers|HuggingFace)\b", re.M | re.I)
    library = ["".join(s for s in re.split(r"^diff --git ", (full / n).read_text(), flags=re.M) if s.startswith(
        "a/torch/")) for n in series_names(full)]
    assert not any(map(hf.search, library[:len(names)])) and hf.search(library[len(names)])
    text = "".join((generic / n).read_text() for n in names)
    assert "diff --git a/test/export/test_export_pytree_family.py" in text
    assert "diff --git a/test/test_pytree_hf.py" not in text
    co = standin_checkout(tmp_path / "pytorch", template)
    assert git("am", "--keep-non-patch", *[str(generic / n) for n in names], cwd=co, check=False).returncode == 0
    r = run_cli("export", tmp_path / "bad", "--cut", "nope", "--from", template)
    assert r.returncode == 2 and "invalid choice" in r.stderr
