"""Command line interface: ``torch-patch`` / ``python -m torch_patch``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import core
from .core import EXPECTED_TORCH_VERSION, RELEASE_LINES, TorchPatchError, supported_releases

_LINES = ", ".join(f"{line}/" for line in RELEASE_LINES)

EXIT_CODES = f"""\
exit codes (all verbs):
  0  success / status: applied
  1  status: not applied
  2  the files are neither stock nor fully patched: modified after apply, partly applied
     (status; revert refuses to discard edits without --force)
  3  base mismatch: the target is not {supported_releases()} (any patch release of those lines
     whose files take the series), or torch is not installed there
     (only leftovers: `torch-patch revert` removes them)
  4  status: interrupted (an apply/revert was killed midway; apply finishes it, revert rolls it back)
  5  error (one line on stderr naming the problem and the fix; nothing was changed, unless it
     says what the target is now, e.g. the disk filled up after the files were switched)
  130  stopped by Ctrl-C (the message says what state the target was left in)
"""

STATE_HELP = ("The state is derived from the files themselves (git apply --check, forward and --reverse, "
              "of each file's part of the series, and the sha256 sums recorded by apply as a cache), "
              "never from torch-patch's records alone: a reinstalled torch or `git checkout .` is "
              "`not applied`, a series committed with `git am` or applied with plain `git apply` is "
              "`applied`.")

TRUST_HELP = ("state.json and journal.json (in the state dir) are checked before use: a damaged one, one "
              "owned by a user other than the owner of the torch files (or you, or root), or one naming a "
              "path outside the target is refused with the file and the fix; a file the series touches "
              "that is a symlink is refused before anything changes. Nothing is written outside the "
              "target and its state dir.")

TARGET_HELP = ("a PyTorch checkout root (torch/__init__.py + .git), or a directory containing an installed "
               "torch/ package such as a venv's site-packages (default: the torch this Python imports)")
SERIES_HELP = ("directory with a `series` file and its patches (default: the series shipped in torch_patch "
               "for the target's release line: torch_patch/patches/<line>/, one of " + _LINES + ")")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 5 like every other error (2 means "modified")
        self.print_usage(sys.stderr)
        self.exit(core.EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="torch-patch", formatter_class=_Formatter,
        description=f"Apply the pytree-family patch series to PyTorch (a checkout or an installed torch), "
                    f"revert it exactly, report its state, export it for upstream, and develop it in a "
                    f"dev tree. There is one series per release line: {supported_releases()}; the "
                    f"target's torch version picks it.",
        epilog=EXIT_CODES)
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True

    a = sub.add_parser("apply", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="apply the series (all patches or none)",
                       description="Examine the target's files, apply every patch in a staging copy with "
                                   "`git apply`, then switch the target's files over atomically (journaled; "
                                   "Ctrl-C is held back during the switch). Records the sha256 of every "
                                   "touched file and keeps the originals, so revert is exact. If the files "
                                   "already hold the series (applied before, `git am`, `git apply`), "
                                   "nothing is done; files left stock by a reinstall or `git checkout` are "
                                   "patched again. Waits while another torch-patch works on the same "
                                   "target. Then writes the __pycache__ bytecode of the changed .py files "
                                   "with the target's Python (the running one, or the venv's bin/python; "
                                   "not for a checkout), so processes that cannot write it do not "
                                   "recompile; a failure there is only a warning.\n\n" + STATE_HELP
                                   + "\n\n" + TRUST_HELP)
    a.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    a.add_argument("--allow-system", action="store_true",
                   help="allow the default target even if this Python is not in a virtual environment")
    a.add_argument("--reapply", action="store_true",
                   help="if a different series is applied, revert it first, then apply this one")
    a.add_argument("--force", action="store_true",
                   help="only with --reapply: let that revert discard edits made to patched files after "
                        "the earlier apply")
    a.add_argument("--series", metavar="DIR", help=SERIES_HELP)

    r = sub.add_parser("revert", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="restore the stock files (byte-identical originals)",
                       description="Put the stock files back: the originals saved by apply (verified by "
                                   "sha256), or `git apply --reverse` for files patched without torch-patch "
                                   "(plain `git apply`). Refuses and names the files if a patched file was "
                                   "edited after apply, unless --force. Rolls back an interrupted apply. "
                                   "Refuses on a checkout whose HEAD has the series committed (use git). "
                                   "After `pip uninstall torch`, removes what torch-patch left behind "
                                   "(the files the series adds, and .torch-patch/). Writes the bytecode "
                                   "of the restored files like apply.\n\n" + STATE_HELP + "\n\n" + TRUST_HELP)
    r.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    r.add_argument("--force", action="store_true", help="restore originals even over edits made after apply")
    r.add_argument("--allow-system", action="store_true",
                   help="allow the default target even if this Python is not in a virtual environment")
    r.add_argument("--series", metavar="DIR", help=SERIES_HELP + " (to recognise files patched without torch-patch)")

    s = sub.add_parser("status", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="print the patch state; the exit code tells it too",
                       description="Print one of: `not applied`, `applied (<patches>)`, `modified after "
                                   "apply (<files>)`, `modified (<files>: ...)`, `partly applied (...)`, "
                                   "`interrupted (...)`, `base mismatch: found torch X, expected "
                                   "torch ...`, `not installed: ...` (torch uninstalled, "
                                   "leftovers remain); a note after ` — ` says more (stale records, "
                                   "leftover files, applied by other means). Changes nothing.\n\n"
                                   + STATE_HELP + "\n\n--json fields: state, message, code, target, kind, "
                                   "torch_version, release_line, expected_torch_version (the release "
                                   "the line's series was made from), supported_releases, patches, modified_files, "
                                   "series_current, applied_by (torch-patch | other | null), leftovers, "
                                   "state_dir, and stock_files: {path in the target: absolute path of an "
                                   "on-disk copy of its stock version} for every file the series touches "
                                   "that stock torch has (`torch-patch stock-file PATH` prints one).")
    s.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    s.add_argument("--json", action="store_true", help="print a JSON object instead of one line")
    s.add_argument("--series", metavar="DIR", help=SERIES_HELP)

    f = sub.add_parser("stock-file", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="print the path of the stock version of a torch file (e.g. a benchmark baseline)",
                       description="Print the absolute path of an on-disk copy of the stock "
                                   "version of PATH: the original that apply "
                                   "kept if the file is patched, else the file itself (checked against "
                                   "the wheel's RECORD). For example:\n"
                                   "  python benchmarks/pytree/pytree_bench.py --baseline "
                                   "\"$(torch-patch stock-file torch/utils/_pytree.py)\"")
    f.add_argument("path", metavar="PATH",
                   help="the file, relative to the target (torch/utils/_pytree.py) or an absolute path in it")
    f.add_argument("target", nargs="?", metavar="TARGET", help=TARGET_HELP)
    f.add_argument("--series", metavar="DIR", help=SERIES_HELP + " (to recognise patched files)")

    e = sub.add_parser("export", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="write the upstream-ready series (library + tests + benchmarks)",
                       description="Write the library series, each commit with the files of this repo's "
                                   "tests (test/** except test/torch_patch/) and benchmarks/** that its Test "
                                   "Plan names first (a benchmark with its directory, a test with the modules "
                                   "of its directory it imports), then one commit with the tests and one with "
                                   "the benchmarks that no Test Plan names, if any, as "
                                   "`git format-patch` files and a `series`, to OUTDIR. The series is "
                                   "the one of the release line of the torch the stock files come from "
                                   f"(--from; e.g. v{EXPECTED_TORCH_VERSION}). On a PyTorch checkout of "
                                   "that release: git am --keep-non-patch OUTDIR/*.patch")
    e.add_argument("outdir", metavar="OUTDIR")
    e.add_argument("--force", action="store_true", help="write into a non-empty OUTDIR (replaces its patches)")
    e.add_argument("--repo", metavar="DIR", help="torch_patch repository checkout holding test/ and benchmarks/ "
                                                 "(default: the one this package is installed from)")
    e.add_argument("--from", dest="source", metavar="TARGET",
                   help="where to take the stock torch files from (default: the torch this Python imports)")
    e.add_argument("--series", metavar="DIR", help=SERIES_HELP)
    e.add_argument("--cut", choices=("full", "generic"), default="full",
                   help="full: the whole series; generic: only the library patches before the first "
                        "HuggingFace-specific one (a fork's generic part), with their tests")

    d = sub.add_parser("dev", formatter_class=_Formatter, epilog=EXIT_CODES,
                       help="create a dev tree, or export its commits back into torch_patch/patches",
                       description="`dev DIR`: copy the installed torch package (stock files, verified "
                                   "against the wheel's RECORD, no __pycache__) to DIR/torch, git-track only "
                                   "*.py, commit it as tag v<its release> (e.g. v2.14.1; fixed identity/date) "
                                   "and `git am` the series of that release line, so `PYTHONPATH=DIR python` "
                                   "imports the patched torch.\n`dev --export [DIR]`: regenerate "
                                   "torch_patch/patches/<line>/ (the line of DIR's v<release> tag) from "
                                   "`git format-patch v<release>..HEAD` in DIR (default: $TORCH_PATCH_DEV); "
                                   "byte-stable, refuses uncommitted changes. A patch that is the same change "
                                   "as one of an earlier line (but for line numbers and blob hashes) is not "
                                   "written again: the series names that file (../2.13/NAME).")
    d.add_argument("dir", nargs="?", metavar="DIR")
    d.add_argument("--export", action="store_true", help="export the dev tree's commits as the series")
    d.add_argument("--from", dest="source", metavar="TARGET",
                   help="installed torch to copy (default: the torch this Python imports)")
    d.add_argument("--patches-dir", metavar="DIR",
                   help="with --export: where to write (default: torch_patch/patches/<line> of this checkout)")
    d.add_argument("--series", metavar="DIR", help=SERIES_HELP + " (to create the dev tree)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb == "apply" and args.force and not args.reapply:
        parser.error("apply: --force only takes effect together with --reapply (it lets the revert of the "
                     "earlier apply discard edits); add --reapply, or run `torch-patch revert --force` first")
    try:
        if args.verb == "apply":
            core.apply(args.target, series_dir=args.series, allow_system=args.allow_system,
                       reapply=args.reapply, force=args.force)
        elif args.verb == "revert":
            core.revert(args.target, force=args.force, allow_system=args.allow_system, series_dir=args.series)
        elif args.verb == "status":
            st = core.status(args.target, series_dir=args.series)
            if args.json:
                print(json.dumps(st.as_dict(), indent=2, sort_keys=True))
            else:
                print(st.message)
            return st.code
        elif args.verb == "stock-file":
            print(core.stock_file_path(args.path, args.target, series_dir=args.series))
        elif args.verb == "export":
            from .export import export
            export(args.outdir, force=args.force, series_dir=args.series, repo=args.repo, source=args.source,
                   cut=args.cut)
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
    except OSError as e:  # e.g. no space left in the temporary directory while examining
        print(f"torch-patch: error: {e}", file=sys.stderr, flush=True)
        return core.EXIT_ERROR
    except KeyboardInterrupt:
        print(f"torch-patch: stopped by Ctrl-C{_after_interrupt(args)}", file=sys.stderr, flush=True)
        return core.EXIT_SIGINT
    return 0


def _after_interrupt(args) -> str:
    """What a Ctrl-C left: the target's state as `status` sees it (apply/revert only)."""
    if args.verb not in ("apply", "revert"):
        return ""
    try:
        st = core.status(args.target, series_dir=getattr(args, "series", None))
    except (TorchPatchError, KeyboardInterrupt, OSError) as e:
        return f"; could not tell the state of the target ({e}); run `torch-patch status`"
    return f"; {st.target} is now: {st.message} (check again with `torch-patch status`)"


if __name__ == "__main__":
    raise SystemExit(main())
