"""Counting Triton's just-in-time compiles, so that a compile in the request path shows.

The engine compiles its kernels for every launch shape at start (the attention backends'
`warmup`); a kernel variant first launched later is compiled (or loaded from Triton's disk cache)
inside some request's step, which costs that step from milliseconds to seconds. `CompileWatch`
installs one process-wide pair of Triton hooks (`knobs.runtime.jit_cache_hook`, called before a
compile, and `jit_post_compile_hook`, after), chained to any hooks already installed, and counts
compiles with their seconds; the engine reads it before and after its warm-up, and
`LLM.cache_info()` reports what was compiled since (`kernel_compiles_after_warmup`).

The interpreter (TRITON_INTERPRET=1) and the CPU path compile nothing, so there the count stays 0.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


VARIANT_CHARS = 2000


@dataclass
class CompileRecord:
    kernel: str
    seconds: float
    variant: str = ""  # Triton's repr of the launch: options and each argument's specialization


@dataclass
class CompileWatch:
    records: list[CompileRecord] = field(default_factory=list)
    installed: bool = False
    _started: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> bool:
        """Install the hooks once per process; False where this Triton has no such hooks."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:  # Triton < 3.4: no knobs
            return False
        rt = knobs.runtime
        if not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
            return False
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

        def on_cache_miss(*args, **kwargs):
            with self._lock:
                self._started[_key(kwargs)] = time.perf_counter()
            # a true answer would make Triton skip the compile: pass on the earlier hook's answer only
            return before(*args, **kwargs) if before else None

        def on_compiled(*args, **kwargs):
            now = time.perf_counter()
            with self._lock:
                t0 = self._started.pop(_key(kwargs), now)
                fn = kwargs.get("fn")
                # str(): a Gluon kernel's name reaches here as a Triton constexpr
                name = str(getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0])
                self.records.append(CompileRecord(name, now - t0, str(kwargs.get("repr") or "")[:VARIANT_CHARS]))
            return after(*args, **kwargs) if after else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = on_cache_miss, on_compiled
        try:  # the Gluon kernel compiles with these hooks unset and reports here (kernels/fp4_gluon.py)
            from kernels import fp4_gluon

            fp4_gluon.COMPILE_LISTENERS.append(self._record)
        except ImportError:
            pass
        self.installed = True
        return True

    def _record(self, name: str, seconds: float) -> None:
        with self._lock:
            self.records.append(CompileRecord(name, seconds))

    def mark(self) -> int:
        """A position to count from."""
        with self._lock:
            return len(self.records)

    def since(self, mark: int) -> list[CompileRecord]:
        with self._lock:
            return list(self.records[mark:])


def _key(kwargs) -> tuple:
    return (id(getattr(kwargs.get("fn"), "jit_function", None)), str(kwargs.get("key")), threading.get_ident())


WATCH = CompileWatch()
