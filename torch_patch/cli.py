"""The command line: ``torch-patch`` and ``python -m torch_patch``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import __version__, core
from .dev import dev_create, dev_export, export

LINES = ", ".join(f"{line} ({release})" for line, release in core.RELEASE_LINES.items())
EXIT_CODES = """exit codes, the same for every verb:
  0    applied (status), or success
  1    not applied (status)
  2    usage: a bad verb, option or argument (argparse's usage message)
  3    base mismatch: no series for the target's torch (the message names the nearest release)
  4    partly applied: an apply or revert was stopped midway; the next one finishes it
  5    error: the message on stderr names the problem and the fix
  6    modified: a file is neither stock nor patched; apply and revert refuse it without --force
  130  stopped by Ctrl-C (the message says what state the target is in)
"""
DESCRIPTION = f"""Apply the pytree-family patch series to an installed torch or a PyTorch checkout,
revert it, report its state, develop and export it. One series per release line, picked by the
target's torch: {LINES}."""
VERBS = {  # the first sentence is the verb's line in the list of verbs
    "apply": "Apply the series. The stock files are saved first, in TARGET/.torch-patch (a "
             "checkout's: in its git dir); a reinstalled torch is patched again, a series an "
             "earlier torch_patch applied is replaced.",
    "revert": "Put the stock files back. A series committed in a checkout is left to git.",
    "status": "Print the state of the files the series touches; the exit code tells it too.",
    "stock-file": "Print the path of the stock version of PATH (of a benchmark's baseline, say).",
    "export": "Write the upstream-ready series to OUTDIR. On a checkout: "
              "git am --keep-non-patch OUTDIR/*.patch",
    "dev": "Create a dev tree DIR (PYTHONPATH=DIR python imports it), or export its commits as "
           "the series.",
}
HELP = {  # (verbs, flags, argparse keywords)
    "target": (("apply", "revert", "status", "stock-file"), ["target"], dict(
        nargs="?", metavar="TARGET", help="a PyTorch checkout, or the directory with torch/ in it "
        "(a venv's site-packages); default: the torch this Python imports")),
    "series": (tuple(VERBS), ["--series"], dict(metavar="DIR", help="a directory with a series "
               "file and its patches (default: the series of the target's release line)")),
    "force": (("apply", "revert"), ["--force"], dict(action="store_true", help="also replace "
              "files edited since the apply (the edits are lost; only where the stock files are "
              "saved)")),
    "system": (("apply", "revert"), ["--allow-system"], dict(
        action="store_true", help="let the default TARGET be outside a venv")),
    "from": (("export", "dev"), ["--from"], dict(dest="source", metavar="TARGET",
                                                 help="the installed torch to take files from")),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("torch-patch", description=DESCRIPTION, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version",
                   version=f"torch-patch {__version__} (series for torch {LINES})")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    v = {name: sub.add_parser(name, help=text.split(". ")[0], description=text,
                              epilog="exit codes: torch-patch --help")
         for name, text in VERBS.items()}
    v["stock-file"].add_argument("path", metavar="PATH",
                                 help="torch/... (relative to the target), or a path in it")
    v["export"].add_argument("outdir", metavar="OUTDIR")
    v["dev"].add_argument("dir", nargs="?", metavar="DIR")
    for verbs, flags, kwargs in HELP.values():
        for name in verbs:
            v[name].add_argument(*flags, **kwargs)
    v["status"].add_argument("--verbose", "-v", action="store_true",
                             help="list the patches and each file's state")
    v["status"].add_argument("--json", action="store_true", help="print a JSON object (errors "
                             "too): state, code, message, target, kind, torch_version, "
                             "release_line, patches, files, stock_files")
    v["export"].add_argument("--cut", choices=("full", "generic"), default="full", help="generic: "
                             "only the patches before the first HuggingFace-specific one, with "
                             "their tests")
    v["export"].add_argument("--force", action="store_true", help="write into a non-empty OUTDIR")
    v["export"].add_argument("--repo", metavar="DIR",
                             help="the torch_patch checkout with test/ and benchmarks/")
    v["dev"].add_argument("--export", action="store_true",
                          help="export the dev tree's commits as the series")
    v["dev"].add_argument("--patches-dir", metavar="DIR",
                          help="with --export: where to write the series")
    p.verbs = v
    return p


def main(argv: Optional[List[str]] = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # each line at once, through a pipe too
    parser = _parser()
    try:  # a usage error: argparse's usage message, exit code 2
        args = parser.parse_args((sys.argv[1:] if argv is None else argv) or ["--help"])
        if args.verb == "dev" and not args.dir:
            parser.verbs["dev"].error("dev needs DIR: the dev tree to create (or to --export)")
    except SystemExit as e:
        return e.code
    try:
        if args.verb in ("apply", "revert"):
            getattr(core, args.verb)(args.target, series_dir=args.series, force=args.force,
                                     allow_system=args.allow_system)
        elif args.verb == "status":
            st = core.status(args.target, series_dir=args.series)
            print(json.dumps(st.__dict__, indent=2, sort_keys=True) if args.json else st.message)
            if args.verbose and not args.json:
                for line in [*st.patches, *map(": ".join, st.files.items())]:
                    print(f"  {line}")
            return st.code
        elif args.verb == "stock-file":
            print(core.stock_file_path(args.path, args.target, series_dir=args.series))
        elif args.verb == "export":
            export(args.outdir, force=args.force, series_dir=args.series, repo=args.repo,
                   source=args.source, cut=args.cut)
        elif args.export:
            dev_export(args.dir, patches_dir=args.patches_dir)
        else:
            dev_create(args.dir, source=args.source, series_dir=args.series)
    except core.TorchPatchError as e:
        message, code = str(e), e.code
    except OSError as e:
        message, code = core.oserror(e), core.EXIT_ERROR
    except KeyboardInterrupt:  # apply and revert say what they left: a TorchPatchError
        message, code = "stopped by Ctrl-C", core.EXIT_SIGINT
    else:
        return 0
    if getattr(args, "json", False):
        print(json.dumps({"state": "error", "code": code, "message": message}, indent=2,
                         sort_keys=True))
    else:
        print(f"torch-patch: error: {message}", file=sys.stderr, flush=True)
    return code
