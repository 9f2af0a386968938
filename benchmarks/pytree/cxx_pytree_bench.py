"""What ``_cxx_pytree`` costs code that uses no family: stock vs patched, one process.

The stock ``torch/utils/_cxx_pytree.py`` of the same release (``--baseline``) is loaded
as the module ``_cxx_pytree_stock``; it calls the same optree registry (namespace
``"torch"``) as ``torch.utils._cxx_pytree``. Trees are timed and counted as in
pytree_bench.py, in three states entered in this order: fresh; a family registered
whose members are not in the trees; transformers imported, if it is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
from typing import Any, TYPE_CHECKING

import pytree_bench as pb  # this directory

import torch.utils._cxx_pytree as cxx_pytree
import torch.utils._pytree as pytree


if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

TREES = ["single tensor", "list of 10", "list of 1,000", "dict of 1,000"]
TREES.append("100 x `{a: t, b: (t, t), c: [t, t, t]}`")


def family() -> None:
    """A family of 20 members, none of them in the trees."""

    @dataclasses.dataclass
    class Unused:
        x: Any = None

    getattr(cxx_pytree, "register_pytree_family", pytree.register_pytree_family)(Unused)
    for i in range(20):
        dataclasses.make_dataclass(f"Member{i}", [], bases=(Unused,))


def import_transformers() -> None:
    """Its families (``ModelOutput``, ``Cache``) registered, as an export does."""
    import transformers.cache_utils
    import transformers.modeling_outputs  # noqa: F401

    pytree._update_pytree_families()


def items(stock: Any) -> tuple[list[pb.Member | Callable[[], None]], list[str]]:
    """Each state's step that enters it, then its members."""
    out: list[pb.Member | Callable[[], None]] = []
    notes: list[str] = []
    steps = {"fresh": None, "family": family, "transformers": import_transformers}
    if not hasattr(pytree, "register_pytree_family"):
        del steps["family"]
    if importlib.util.find_spec("transformers") is None:
        del steps["transformers"]
        notes.append("transformers is not installed: no state 'transformers'")
    for state, step in steps.items():
        out += [step] if step else []
        cases = {f"{state}: {t}": pb.CASES[t] for t in TREES}
        members, skipped = pb.members_of(cases, {"stock": stock, "patched": cxx_pytree})
        out, notes = out + members, notes + skipped
    return out, notes


def callgrind_child(baseline: str, calls: list[int | None]) -> Iterator:
    if __name__ == "__main__":  # the parent: collect_callgrind checks the setup
        return itertools.repeat(lambda: None)
    stock = pb.load_alias("_cxx_pytree_stock", baseline)
    return pb.callgrind_jobs(items(stock)[0], calls)


def main(argv: list[str] | None = None) -> int:
    p = pb.parser(__doc__, rounds=60)
    stock = "stock _cxx_pytree.py: `torch-patch stock-file torch/utils/_cxx_pytree.py`"
    p.add_argument("--baseline", metavar="FILE", required=True, help=stock)
    args = pb.parse(p, argv)
    title = f"_cxx_pytree: stock ({args.baseline}) vs patched ({cxx_pytree.__file__})"
    info = pb.header(title, args)
    stock = pb.load_alias("_cxx_pytree_stock", args.baseline)
    if hasattr(stock, "register_pytree_family"):
        raise SystemExit(f"{args.baseline} is not a stock _cxx_pytree.py")
    todo, notes = items(stock)
    child = {"baseline": args.baseline}
    rows, measurements = pb.measure(
        todo, args, "cxx_pytree_bench", child, lambda c: True
    )
    return pb.report(info, rows, args, notes, measurements)


if __name__ == "__main__":
    sys.exit(main())
