"""Command line interface: ``torch-patch`` / ``python -m torch_patch``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import core
from .core import EXPECTED_TORCH_VERSION, TorchPatchError

EXIT_CODES = f"""\
exit codes (all verbs):
  0  success / status: applied
  1  status: not applied
  2  modified after apply (status; revert refuses without --force)
  3  base mismatch: the target is not torch {EXPECTED_TORCH_VERSION}
  4  status: interrupted (an apply/revert was killed midway; apply finishes it, revert rolls it back)
  5  error (message on stderr; nothing was changed)
"""

TARGET_HELP = ("a PyTorch checkout root (torch/__init__.py + .git), or a directory containing an installed "
               "torch/ package such as a venv's site-packages (default: the torch this Python imports)")
SERIES_HELP = "directory with a `series` file and its patches (default: the series shipped in torch_patch)"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 5 like every other error (2 means "modified")
        self.print_usage(sys.stderr)
        self.exit(core.EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="torch-patch", formatter_class=_Formatter,
        description=f"Apply the pytree-family patch series to PyTorch {EXPECTED_TORCH_VERSION} "
                    f"(a checkout or an installed torch), revert it exactly, report its state, "
                    f"export it for upstream, and develop it in a dev tree.",
        epilog=EXIT_CODES)
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True

    a = sub.add_parser("apply", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="apply the series (all patches or none)",
                       description="Check every patch with `git apply --check` in a staging copy, then "
                                   "switch the target's files over atomically (journaled). Records sha256 "
                                   "of every touched file and keeps the originals, so revert is exact. "
                                   "Applying the same series again is a no-op.")
    a.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    a.add_argument("--allow-system", action="store_true",
                   help="allow the default target even if this Python is not in a virtual environment")
    a.add_argument("--reapply", action="store_true",
                   help="if a different series is applied, revert it first, then apply this one")
    a.add_argument("--force", action="store_true",
                   help="with --reapply: discard edits made to patched files after the earlier apply")
    a.add_argument("--series", metavar="DIR", help=SERIES_HELP)

    r = sub.add_parser("revert", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="restore the byte-identical originals",
                       description="Restore the original files saved by apply (verified by sha256). Refuses "
                                   "and names the files if a patched file was edited after apply, unless "
                                   "--force. Rolls back an interrupted apply.")
    r.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    r.add_argument("--force", action="store_true", help="restore originals even over edits made after apply")
    r.add_argument("--allow-system", action="store_true",
                   help="allow the default target even if this Python is not in a virtual environment")

    s = sub.add_parser("status", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="print the patch state; the exit code tells it too",
                       description="Print one of: `not applied`, `applied (<patches>)`, `modified after "
                                   "apply (<files>)`, `interrupted (...)`, `base mismatch: found torch X, "
                                   f"expected {EXPECTED_TORCH_VERSION}`. Changes nothing.")
    s.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    s.add_argument("--json", action="store_true", help="print a JSON object instead of one line")
    s.add_argument("--series", metavar="DIR", help=SERIES_HELP)

    e = sub.add_parser("export", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="write the upstream-ready series (library + tests + benchmarks)",
                       description="Write the library series plus one commit adding this repo's tests "
                                   "(test/** except test/torch_patch/) and one adding benchmarks/**, as "
                                   "`git format-patch` files and a `series`, to OUTDIR. On a PyTorch "
                                   f"v{EXPECTED_TORCH_VERSION} checkout: git am --keep-non-patch OUTDIR/*.patch")
    e.add_argument("outdir", metavar="OUTDIR")
    e.add_argument("--force", action="store_true", help="write into a non-empty OUTDIR (replaces its patches)")
    e.add_argument("--repo", metavar="DIR", help="torch_patch repository checkout holding test/ and benchmarks/ "
                                                 "(default: the one this package is installed from)")
    e.add_argument("--from", dest="source", metavar="TARGET",
                   help="where to take the stock torch files from (default: the torch this Python imports)")
    e.add_argument("--series", metavar="DIR", help=SERIES_HELP)

    d = sub.add_parser("dev", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="create a dev tree, or export its commits back into torch_patch/patches",
                       description="`dev DIR`: copy the installed torch package (stock files, verified "
                                   "against the wheel's RECORD, no __pycache__) to DIR/torch, git-track only "
                                   f"*.py, commit it as tag v{EXPECTED_TORCH_VERSION} (fixed identity/date) "
                                   "and `git am` the series, so `PYTHONPATH=DIR python` imports the patched "
                                   "torch.\n`dev --export [DIR]`: regenerate torch_patch/patches/ from "
                                   f"`git format-patch v{EXPECTED_TORCH_VERSION}..HEAD` in DIR (default: "
                                   "$TORCH_PATCH_DEV); byte-stable, refuses uncommitted changes.")
    d.add_argument("dir", nargs="?", metavar="DIR")
    d.add_argument("--export", action="store_true", help="export the dev tree's commits as the series")
    d.add_argument("--from", dest="source", metavar="TARGET",
                   help="installed torch to copy (default: the torch this Python imports)")
    d.add_argument("--patches-dir", metavar="DIR",
                   help="with --export: where to write (default: torch_patch/patches of this checkout)")
    d.add_argument("--series", metavar="DIR", help=SERIES_HELP + " (to create the dev tree)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.verb == "apply":
            core.apply(args.target, series_dir=args.series, allow_system=args.allow_system,
                       reapply=args.reapply, force=args.force)
        elif args.verb == "revert":
            core.revert(args.target, force=args.force, allow_system=args.allow_system)
        elif args.verb == "status":
            st = core.status(args.target, series_dir=args.series)
            if args.json:
                print(json.dumps(st.as_dict(), indent=2, sort_keys=True))
            else:
                print(st.message)
            return st.code
        elif args.verb == "export":
            from .export import export
            export(args.outdir, force=args.force, series_dir=args.series, repo=args.repo, source=args.source)
        elif args.verb == "dev":
            from .dev import dev_create, dev_export
            if args.export:
                dev_export(args.dir, patches_dir=args.patches_dir)
            else:
                if not args.dir:
                    raise TorchPatchError("dev needs DIR (the dev tree to create); see `torch-patch dev --help`")
                dev_create(args.dir, source=args.source, series_dir=args.series)
    except TorchPatchError as e:
        print(f"torch-patch: error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print("torch-patch: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
