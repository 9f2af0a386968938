"""Callgrind client requests from Python, for the benchmarks' instruction-count modes.

Used by ``pytree_bench.py --instructions`` and ``compile_time_bench.py --instructions``,
each of which runs itself again under
``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no`` and counts
regions of its own code with :class:`Callgrind`.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import platform
import re
import sys
from typing import Any, TYPE_CHECKING


if TYPE_CHECKING:
    from collections.abc import Callable


CALLGRIND_OPTIONS = (
    "-q",
    "--tool=callgrind",
    "--instr-atstart=no",
    "--collect-atstart=no",
)


class Callgrind:
    """Callgrind client requests, in a process that runs under callgrind.

    A client request is a magic instruction sequence that valgrind recognizes and that does
    nothing natively (``valgrind.h``). ``_CODE`` is that sequence for x86-64 wrapped in a
    function ``size_t request(size_t args[6])``, put in an executable page and called through
    ctypes. The process runs with ``--instr-atstart=no --collect-atstart=no``: ``import torch``
    runs uninstrumented (about 10x slower than native instead of about 50x), ``start()``
    switches the instrumentation on, and ``count(fn)`` switches collection on around ``fn()``
    only, then dumps; the dump holds exactly the instructions of that region, and its total is
    read back. ``out_file`` is the ``--callgrind-out-file`` the process was started with.
    """

    _BASE = 0x43540000  # VG_USERREQ_TOOL_BASE('C', 'T') in callgrind.h
    TOGGLE_COLLECT, DUMP_STATS_AT, START_INSTRUMENTATION = (
        _BASE + 2,
        _BASE + 3,
        _BASE + 4,
    )
    RUNNING_ON_VALGRIND = 0x1001
    # mov rax,rdi; xor edx,edx; rol rdi,3; rol rdi,13; rol rdi,61; rol rdi,51; xchg rbx,rbx;
    # mov rax,rdx; ret  -- rax: the request block, rdx: the default/result
    _CODE = "4889f8 31d2 48c1c703 48c1c70d 48c1c73d 48c1c733 4887db 4889d0 c3"

    def __init__(self, out_file: str, keep: bool = False) -> None:
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise SystemExit(
                "--instructions: the callgrind client requests are implemented for x86-64 Linux only"
            )
        self._mem = mmap.mmap(
            -1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
        )
        self._mem.write(bytes.fromhex(self._CODE))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        self._fn = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(addr)
        self._args = (ctypes.c_size_t * 6)()
        self.out_file, self.keep, self.dumps = out_file, keep, 0
        if not self._request(self.RUNNING_ON_VALGRIND):
            raise SystemExit(
                "--instructions: this child process does not run under valgrind"
            )

    def _request(self, code: int, arg: int = 0) -> int:
        self._args[0], self._args[1] = code, arg
        return self._fn(self._args)

    def start(self) -> None:
        self._request(self.START_INSTRUMENTATION)

    def count(self, fn: Callable[[], Any], tag: str) -> int:
        """Instructions of ``fn()``, GC disabled, plus a constant few thousand of the toggling."""
        gc_was = gc.isenabled()
        gc.disable()
        try:
            self._request(self.TOGGLE_COLLECT)
            try:
                fn()
            finally:
                self._request(self.TOGGLE_COLLECT)
        finally:
            if gc_was:
                gc.enable()
        tag = re.sub(r"\s+", " ", tag)[:200]
        buf = ctypes.create_string_buffer(tag.encode())
        self._request(self.DUMP_STATS_AT, ctypes.addressof(buf))
        self.dumps += 1
        path = f"{self.out_file}.{self.dumps}"
        trigger = total = None
        with open(path) as f:
            for line in f:
                if line.startswith("desc: Trigger:"):
                    trigger = line.split(":", 2)[2].strip()
                elif line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
                    break
        if trigger != f"Client Request: {tag}" or total is None:
            raise RuntimeError(
                f"{path}: expected the dump {tag!r}, found {trigger!r} (total {total})"
            )
        if not self.keep:
            os.unlink(path)
        return total

    def per_call(self, fn: Callable[[Any], Any], objs: list[Any]) -> float:
        """``Measure`` for the one-off family cases: instructions per ``fn(o)`` over ``objs``."""

        def loop(xs: list[Any]) -> None:
            for o in xs:
                fn(o)

        full = self.count(
            lambda: loop(objs), f"{getattr(fn, '__qualname__', 'fn')} x{len(objs)}"
        )
        empty = self.count(lambda: loop([]), "empty loop")
        return (full - empty) / len(objs)
