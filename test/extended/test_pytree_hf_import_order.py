# Owner(s): ["module: pytree"]

"""torch's families of transformers and diffusers hold in every import order.

Each test runs a fresh process whose first line imports a part of transformers
(or diffusers): transformers.cache_utils, for one, imports torch while it is
half imported itself, before it defines the classes of its families. The
process must import, nothing of torch's may sit in sys.meta_path, and after a
boundary (an export, a load; ``_update_pytree_families()`` here) the classes
must be pytree nodes in both pytrees. Needs transformers; run under each
release the CI sessions install.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import unittest
from importlib.util import find_spec

from torch.testing._internal.common_utils import run_tests, TestCase


HAS_TRANSFORMERS = find_spec("transformers") is not None
HAS_DIFFUSERS = find_spec("diffusers") is not None

FIRST_LINES = [
    "from transformers import DynamicCache",  # transformers.cache_utils imports torch
    "import transformers.cache_utils",
    "import transformers; transformers.DynamicCache",
    "import transformers",
    "from transformers import BertModel",
    "from transformers.utils.generic import ModelOutput",
    "from transformers import BatchEncoding",
    "import torch",
]
DIFFUSERS_FIRST_LINES = [
    "from diffusers.utils.outputs import BaseOutput",
    "import diffusers",
]

# Run after the first line (or the threads): which classes are nodes, per pytree.
CHECK = """
import torch, transformers
import torch.utils._pytree as py_pytree
import torch.utils._cxx_pytree as cxx_pytree
from transformers import BatchEncoding
from transformers.modeling_outputs import BaseModelOutput

torch_finders = [
    f for f in sys.meta_path if str(getattr(f, "__module__", "")).split(".")[0] == "torch"
]
t = torch.ones(1, 1, 1, 1)
objects = {
    "BaseModelOutput": BaseModelOutput(last_hidden_state=t),
    "BatchEncoding": BatchEncoding({"input_ids": t}),
}
if hasattr(transformers, "DynamicCache"):  # transformers >= 4.36
    cache = transformers.DynamicCache()
    cache.update(t, t, 0)
    objects["DynamicCache"] = cache
if DIFFUSERS:
    import dataclasses
    from diffusers.utils.outputs import BaseOutput

    @dataclasses.dataclass
    class Out(BaseOutput):
        sample: torch.Tensor = None

    objects["diffusers BaseOutput"] = Out(sample=t)
py_pytree._update_pytree_families()  # what an export or a load does first
result = {
    f"{name} ({pytree.__name__.rpartition('.')[2]})": not pytree.tree_is_leaf(obj)
    and any(torch.is_tensor(leaf) for leaf in pytree.tree_leaves(obj))
    for name, obj in objects.items()
    for pytree in (py_pytree, cxx_pytree)
}
print(json.dumps({"nodes": result, "torch_finders": len(torch_finders)}))
"""

FIRST_LINE = """
import json, sys
try:
    exec(sys.argv[1])
except (ImportError, AttributeError) as e:  # a class this release does not have
    print(json.dumps({"missing": str(e)}))
    sys.exit(0)
"""

THREADS = """
import json, sys, threading

barrier = threading.Barrier(2)
errors, missing = [], []

def first(line):
    barrier.wait()
    try:
        exec(line, {})
    except (ImportError, AttributeError) as e:  # a class this release does not have
        missing.append(str(e))
    except BaseException as e:
        errors.append(repr(e))

threads = [threading.Thread(target=first, args=(line,)) for line in sys.argv[1:3]]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(timeout=300)
if errors or any(thread.is_alive() for thread in threads):
    print(json.dumps({"errors": errors or ["a thread hangs"]}))
    sys.exit(0)
if missing:
    print(json.dumps({"missing": missing}))
    sys.exit(0)
"""


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        return {"crash": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_all(script: str, runs: list[tuple[str, ...]]) -> list[dict]:
    # two processes at a time: each imports torch and transformers
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda args: _run(script, *args), runs))


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers")
class TestHFImportOrder(TestCase):
    def check(self, results: list[dict], runs: list[tuple[str, ...]]) -> None:
        for args, result in zip(runs, results):
            with self.subTest(first=" & ".join(args)):
                if "missing" in result:
                    continue  # e.g. DynamicCache under transformers 4.31
                self.assertNotIn("crash", result, result.get("crash"))
                self.assertNotIn("errors", result)
                self.assertTrue(result["nodes"])
                self.assertEqual(result["torch_finders"], 0)
                leaves = [name for name, node in result["nodes"].items() if not node]
                self.assertEqual(leaves, [], "leaves instead of nodes")

    def test_first_line(self) -> None:
        lines = FIRST_LINES + (DIFFUSERS_FIRST_LINES if HAS_DIFFUSERS else [])
        script = FIRST_LINE + f"DIFFUSERS = {HAS_DIFFUSERS}\n" + CHECK
        runs = [(line,) for line in lines]
        results = _run_all(script, runs)
        self.check(results, runs)

    def test_two_threads(self) -> None:
        # One thread imports torch while another imports transformers: the
        # second meets torch half imported, or torch meets it half imported.
        pairs = [
            ("import torch", "from transformers import DynamicCache"),
            ("import torch", "from transformers import BertModel"),
        ]
        script = THREADS + "DIFFUSERS = False\n" + CHECK
        self.check(_run_all(script, pairs), pairs)


if __name__ == "__main__":
    run_tests()
