"""Before and after: what stock torch and the patched torch do with the same code.

Run it with ``python -m torch_patch.demo`` after ``torch-patch apply``. Each side runs the steps in
two subprocesses (export and run; then a fresh process that loads the saved programs), which write
their results as JSON: the patched side with the torch as installed, the stock side with
``install_stock`` below, which imports the modules the series changes from the stock files that
`torch-patch apply` saved. Then it prints a table: step | stock torch | patched torch, with the
first sentence of each error. The models are built from tiny configs (random weights, nothing is
downloaded).
"""

from __future__ import annotations

import argparse
import copy
import importlib.machinery
import importlib.util
import inspect
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

from . import core

STEPS = {
    "family": "your own dataclass outputs (a family): export, save, load in a fresh process, run",
    "cache": "GPT-2 with its KV cache: export, 3 decode steps feeding the cache back",
    "onnx": "GPT-2 with its KV cache: export to ONNX (dynamo=True), run in onnxruntime",
    "load": "BERT: export, save, load in a fresh process that ran `import torch, transformers`, "
            "run",
    "bert": "BERT (transformers < 4.32): export, run",
}
WIDTHS = (26, 40, 30)  # of the table's columns
NEED = ("You need the series for: your own output classes (every subclass, present and future, of "
        "a registered base); KV caches (transformers >= 4.36); programs loaded in a fresh process; "
        "transformers < 4.32 and diffusers < 0.22 (which do not register their output classes).")
# The line that opts the user's classes in, and the user's module, which the processes that
# export and load import. Stock torch has no families: there its classes stay leaves.
REGISTER = "pytree.register_pytree_family(Output)"
OUTPUTS = '''import dataclasses
import torch
import torch.utils._pytree as pytree

@dataclasses.dataclass
class Output:
    logits: torch.Tensor

if hasattr(pytree, "register_pytree_family"):
    REGISTER

@dataclasses.dataclass
class ScoredOutput(Output):  # created after the registration: a member too
    scores: torch.Tensor | None = None

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        logits = self.linear(x)
        return ScoredOutput(logits, logits.softmax(-1))
'''.replace("REGISTER", REGISTER)


def opt_in() -> str:
    """What the reader writes to opt their own output classes in: the demo's line."""
    return (f"Your own output classes: demo_outputs.py opts them in with one line, after the base\n"
            f"class (import torch.utils._pytree as pytree):\n\n    {REGISTER}\n\n"
            "Output and every subclass of it, present and future, are then pytree nodes.")


# The stock side: in a venv whose torch `torch-patch apply` patched, install_stock(stock_modules())
# before torch imports the modules the series changes from the stock files that apply saved.
def stock_modules(target: os.PathLike | None = None) -> dict[str, str | None]:
    """Each module the applied series touches: its saved stock file (None: the series adds it)."""
    st = core.status(target)
    if st.code != core.EXIT_APPLIED or not st.stock_files:  # not applied, or applied by other means
        raise core.TorchPatchError(f"the torch at {st.target} is not patched by torch-patch:\n"
                                   f"{st.message}\nRun `torch-patch apply` first, then this again.",
                                   st.code or core.EXIT_ERROR)
    return {rel[:-3].replace("/", ".").removesuffix(".__init__"): st.stock_files.get(rel)
            for rel in st.files if rel.endswith(".py")}


class _Loader(importlib.machinery.SourceFileLoader):
    def set_data(self, *args, **kwargs) -> None:  # no bytecode in the state dir
        pass


class StockFinder:  # a sys.meta_path finder of the stock modules
    def __init__(self, modules: dict[str, str | None]):
        self.modules = modules

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        stock = self.modules[name]
        if stock is None:  # the series adds it: stock torch has no such module
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        package = None
        if os.path.basename(stock) == "__init__.py":  # its submodules are the installed ones
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            package = list(spec.submodule_search_locations) if spec else None
        return importlib.util.spec_from_file_location(
            name, stock, loader=_Loader(name, stock), submodule_search_locations=package)


def install_stock(modules: dict[str, str | None]) -> StockFinder:
    """Serve ``modules`` (from :func:`stock_modules`) from their stock files, before torch."""
    imported = sorted(name for name in modules if name in sys.modules)
    if imported:
        raise RuntimeError(f"{', '.join(imported)} already imported: install the stock finder "
                           "before torch")
    finder = StockFinder(modules)
    sys.meta_path.insert(0, finder)
    return finder


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_patch.demo",
        description="Show what stock torch and the patched torch do with the same code: a model "
        "that returns your own dataclass outputs, GPT-2 with its KV cache (export and decode "
        "steps; ONNX in onnxruntime), a saved HuggingFace program loaded in a fresh process, and "
        "BERT under transformers < 4.32. Each side runs in its own processes: the patched one with "
        "the torch as installed, the stock one with the stock files that `torch-patch apply` "
        "saved. Needs a torch patched by `torch-patch apply`; the HuggingFace steps need "
        "transformers, the ONNX step onnx, onnxscript and onnxruntime (all in `pip install "
        "torch_patch[test]`). Tiny models with random weights, nothing is downloaded. Takes about "
        "30 s.",
        epilog="exit status: 0 when every step of the patched torch matches eager (stock torch "
        "failing is expected), 1 otherwise, or when torch is not patched by torch-patch",
    )
    p.add_argument("--child", nargs=2, metavar=("STAGE", "DIR"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        return _child(*args.child)
    try:
        modules = stock_modules()
    except core.TorchPatchError as e:
        print(f"python -m torch_patch.demo: error: {e}", file=sys.stderr)
        return 1
    start, results = time.perf_counter(), {}
    with tempfile.TemporaryDirectory(prefix="torch-patch-demo-") as tmp:
        (Path(tmp) / "demo_outputs.py").write_text(OUTPUTS)
        for side in ("stock", "patched"):
            print(f"running the steps with {side} torch ...", flush=True)
            (Path(tmp) / side).mkdir()
            if side == "stock":
                (Path(tmp) / side / "stock-modules.json").write_text(json.dumps(modules))
            results[side] = _run_side(Path(tmp), side)
    stock_info, info = (results[side].pop("info", None) for side in ("stock", "patched"))
    if stock_info and stock_info["has_family"]:
        print("python -m torch_patch.demo: error: the stock side imported the patched pytree",
              file=sys.stderr)
        return 1
    info = info or stock_info or {"torch": "?", "transformers": "?"}
    width = sum(WIDTHS) + 4
    versions = f"torch {info['torch']}, transformers {info['transformers'] or '(not installed)'}."
    print("\n" + textwrap.fill(f"{versions} stock torch: the stock files that torch-patch saved, "
                               "imported instead of the patched ones. ok: the same output "
                               "classes, structure and values as eager.", width), end="\n\n")
    rows = [(STEPS[s], results["stock"].get(s, {"text": "(not run)"})["text"],
             results["patched"][s]["text"]) for s in STEPS if s in results["patched"]]
    for i, row in enumerate([("step", "stock torch", "patched torch"), *rows]):
        cells = [textwrap.wrap(text, width) for text, width in zip(row, WIDTHS)]
        for line in itertools.zip_longest(*cells, fillvalue=""):
            print("  ".join(text.ljust(width) for text, width in zip(line, WIDTHS)).rstrip())
        print("  ".join("-" * width for width in WIDTHS) if i == 0 else "")
    print(opt_in(), end="\n\n")
    notes = [f"{side}: {r['note']}"
             for side in results for r in results[side].values() if "note" in r]
    print("".join(textwrap.fill(text, width) + "\n" for text in notes) + "\n" * bool(notes)
          + textwrap.fill(NEED, width))
    ok = all(r["ok"] is not False for r in results["patched"].values())
    verdict = "OK: the patched torch matches" if ok else "FAILED: the patched torch does not match"
    print(f"\n{verdict} eager in every step ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


def _run_side(tmp: Path, side: str) -> dict:
    """Both stages of one side: {step: {"ok": True, False or None (skipped), "text": ...},
    "info": {...}}."""
    path = os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    results: dict = {}
    for stage in ("export", "load"):
        proc = subprocess.run(
            [sys.executable, "-m", "torch_patch.demo", "--child", stage, str(tmp / side)],
            env=env, cwd=tmp, capture_output=True, text=True)
        out = tmp / side / f"{stage}.json"
        if proc.returncode or not out.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            last = (lines or [f"exit status {proc.returncode}"])[-1]
            return {**results, **{s: {"ok": False, "text": f"crashed: {last}"} for s in STEPS}}
        for step, result in json.loads(out.read_text()).items():
            results[step] = {**results.get(step, {}), **result}
    return results


def _child(stage: str, side_dir: str) -> int:
    d = Path(side_dir)
    if (d / "stock-modules.json").exists():
        install_stock(json.loads((d / "stock-modules.json").read_text()))
    warnings.simplefilter("ignore")  # the output is captured; a crash shows its last line
    import torch
    import torch.utils._pytree as pytree

    has_hf, results = importlib.util.find_spec("transformers") is not None, {}

    def step(name: str, fn, *args) -> None:
        try:
            results[name] = fn(*args)
        except Exception as e:  # the table shows it
            results[name] = {"ok": False, "text": _short(e)}

    if stage == "load":  # a fresh process: `import torch, transformers`, then the saved programs
        if has_hf and (d / "bert.pt2").exists():
            import transformers

            step("load", _load, d / "bert")
        if (d / "family.pt2").exists():
            import demo_outputs  # as the user's program does

            step("family", _load, d / "family")
        (d / "load.json").write_text(json.dumps(results))
        return 0
    import demo_outputs

    torch.manual_seed(0)
    step("family", _export_and_save, demo_outputs.Model(), (torch.randn(2, 4),), d / "family")
    version = None
    if has_hf:
        import transformers

        version, (bert, gpt2) = transformers.__version__, _models()
        ids = torch.randint(0, 99, (2, 7))
        step("cache", _decode, gpt2, torch.randint(0, 99, (1, 6)))
        step("onnx", _onnx, gpt2, ids)
        mask = torch.ones_like(ids)  # attention mask
        step("load", _export_and_save, bert, (ids, mask), d / "bert")
        if tuple(int(n) for n in version.split(".")[:2]) < (4, 32):
            step("bert", _export_and_run, bert, (ids, mask))
    else:
        skipped = {"ok": None, "text": "skipped: pip install transformers"}
        results.update({s: dict(skipped) for s in ("cache", "onnx", "load")})
    results["info"] = {"torch": torch.__version__, "transformers": version,
                       "has_family": hasattr(pytree, "register_pytree_family")}
    (d / "export.json").write_text(json.dumps(results))
    return 0


def _short(e: BaseException) -> str:
    """The first sentence of the error that caused ``e`` (the ONNX exporter wraps export's),
    classes by name."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = re.sub(r"<class '([\w.]+)'>", r"\1", (str(e).strip().splitlines() or [""])[0])
    # transformers.cache_utils.DynamicCache: DynamicCache
    text = re.sub(r"\b(?:[a-z_]\w*\.)+([A-Z]\w*)", r"\1", text)
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) > 20 else f"{type(e).__name__}: {text}"


def _models() -> tuple:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    bert = BertModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=37))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=99,
                                      bos_token_id=98, eos_token_id=98))
    return bert.eval(), gpt2.eval()


def _diff(expected, actual) -> float:
    import torch
    import torch.utils._pytree as pytree

    (e, e_spec), (a, a_spec) = pytree.tree_flatten(expected), pytree.tree_flatten(actual)
    if e_spec != a_spec or type(expected) is not type(actual):
        raise AssertionError(f"the output is a {type(actual).__name__}, "
                             f"not a {type(expected).__name__} like eager")
    return max((x - y).abs().max().item() for x, y in zip(e, a) if isinstance(x, torch.Tensor))


def _ok(diff: float, what: str = "matches eager") -> dict:
    verdict = "ok" if diff < 1e-5 else "WRONG"
    return {"ok": diff < 1e-5, "text": f"{verdict}, {what} (max diff {diff:.2g})"}


def _export_and_run(model, args: tuple) -> dict:
    import torch

    with torch.no_grad():
        return _ok(_diff(model(*args), torch.export.export(model, args).module()(*args)))


def _export_and_save(model, args: tuple, path: Path) -> dict:
    import torch

    torch.export.save(torch.export.export(model, args), f"{path}.pt2")
    torch.save(args, f"{path}.args.pt")
    with torch.no_grad():
        torch.save(model(*args), f"{path}.expected.pt")
    return {"ok": None, "text": "saved"}  # the load stage tells


def _load(path: Path) -> dict:
    import torch

    errors: list = []  # torch.export.load logs the error it meets, then raises a vaguer one
    handler = logging.Handler()
    handler.emit = lambda record: errors.append(record.exc_info and record.exc_info[1])
    logging.getLogger("torch.export").addHandler(handler)
    try:
        program = torch.export.load(f"{path}.pt2")
    except RuntimeError as e:
        raise next(filter(None, errors), e) from None
    got = program.module()(*torch.load(f"{path}.args.pt"))
    # unpickling imports the module of its class
    expected = torch.load(f"{path}.expected.pt", weights_only=False)
    return _ok(_diff(expected, got))


def _decode(model, prefill) -> dict:
    import torch
    import torch.utils._pytree as pytree

    parameters = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in parameters else "past_key_values"  # transformers < 5.0
    tokens = [torch.randint(0, 99, (1, 1)) for _ in range(3)]
    with torch.no_grad():
        cache = model(input_ids=prefill, use_cache=True)[name]
        # transformers < 4.36: strided views after the prefill, as the steps make
        if isinstance(cache, tuple):
            cache = pytree.tree_map(torch.Tensor.contiguous, cache)
        expected, c = [], cache
        for token in tokens:  # eager; a cache object is updated in place, hence the copies
            expected.append(model(input_ids=token, use_cache=True, **{name: copy.deepcopy(c)}))
            c = expected[-1][name]
        kwargs = {"input_ids": tokens[0], name: copy.deepcopy(cache), "use_cache": True}
        # its lengths and counters vary from step to step: Dim.AUTO for the whole cache
        shapes = {"input_ids": None, name: torch.export.Dim.AUTO, "use_cache": None}
        program = torch.export.export(model, (), kwargs, dynamic_shapes=shapes)
        run, diffs, c = program.module(), [], copy.deepcopy(cache)
        for token, want in zip(tokens, expected):
            got = run(input_ids=token, use_cache=True, **{name: c})
            diffs.append(_diff(want, got))
            c = got[name]
    return _ok(max(diffs), f"{len(tokens)} steps match eager")


def _onnx(model, ids) -> dict:
    missing = [p for p in ("onnx", "onnxscript", "onnxruntime")
               if importlib.util.find_spec(p) is None]
    if missing:
        return {"ok": None, "text": f"skipped: pip install {' '.join(missing)}"}
    import onnxruntime
    import torch
    import torch.utils._pytree as pytree

    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=True)
        program = torch.onnx.export(model, (), kwargs={"input_ids": ids, "use_cache": True},
                                    dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
    want = pytree.tree_leaves(eager)
    diff = max((torch.from_numpy(g) - w).abs().max().item()
               for g, w in zip(got, want, strict=True))
    outputs = ", ".join(o.name for o in session.get_outputs())
    return {**_ok(diff), "note": f"ONNX graph outputs: {outputs}"}


if __name__ == "__main__":
    sys.exit(main())
