"""PyTorch's PYFMT lint gate: isort, then usort, then ruff format, as lintrunner runs them.

Usage: ``python pyfmt.py ROOT FILE...``, with FILE relative to ROOT, which holds PyTorch's
``pyproject.toml``.  For every file the three formatters would change, it prints one line,
``FILE: PYFMT would reformat this file``; it prints nothing when they leave all files alone.
It mirrors ``tools/linter/adapters/pyfmt_linter.py``, including the trick that lets isort keep
the ``# usort: skip`` blocks in place.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import isort
import usort


def formatted(root: Path, path: Path, text: str) -> str:
    """``text`` of ``path`` after isort, usort and ruff format with the settings in ``root``."""
    text = re.sub(r"(#.*\b)usort:\s*skip\b", r"\g<1>isort: split", text)
    text = isort.code(text, config=isort.Config(settings_path=str(root)), file_path=path)
    text = re.sub(r"(#.*\b)isort: split\b", r"\g<1>usort: skip", text)
    text = usort.usort_string(text, path=path, config=usort.Config.find(path))
    ruff_format = [
        sys.executable, "-m", "ruff", "format", "--config", str(root / "pyproject.toml"),
        "--stdin-filename", str(path), "-",
    ]
    return subprocess.run(
        ruff_format, input=text, capture_output=True, text=True, check=True
    ).stdout


def main() -> None:
    """Print one line for each of the given files that PYFMT would change."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the tree, with PyTorch's pyproject.toml")
    parser.add_argument("files", nargs="*", help="the files to check, relative to root")
    args = parser.parse_args()
    for name in args.files:
        path = args.root / name
        original = path.read_text(encoding="utf-8")
        if formatted(args.root, path, original) != original:
            print(f"{name}: PYFMT would reformat this file")


if __name__ == "__main__":
    main()
