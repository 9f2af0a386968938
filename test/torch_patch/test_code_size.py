"""The tool's and CI's code stays one a maintainer reads at once: lines within 100 characters,
the tool under 900 lines (the demo aside) and noxfile.py under 300 (what its sessions run lives in
.ci/)."""

from __future__ import annotations

from tp_helpers import REPO

SOURCES = sorted([*(REPO / "torch_patch").glob("*.py"), REPO / "noxfile.py",
                  *(REPO / ".ci").glob("*.py"), *(REPO / ".ci" / "lint").glob("*.py")])


def test_every_line_is_within_100_characters():
    assert {"core.py", "cli.py", "noxfile.py", "lint_series.py"} <= {p.name for p in SOURCES}
    long = [f"{path.relative_to(REPO)}:{number}" for path in SOURCES
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100]
    assert not long, long


def test_noxfile_is_under_300_lines():
    assert len((REPO / "noxfile.py").read_text(encoding="utf-8").splitlines()) < 300


def test_the_tool_is_under_900_lines():
    tool = [p for p in (REPO / "torch_patch").glob("*.py") if p.name != "demo.py"]
    assert {"core.py", "cli.py", "dev.py"} <= {p.name for p in tool}
    assert sum(len(p.read_text(encoding="utf-8").splitlines()) for p in tool) < 900
