"""CompileWatch: Triton's compile hooks, chained, count compiles and their seconds (the GPU test
in test_gpu.py checks that the engine's warm-up leaves none for the steps)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from triton import knobs

from docproc.engine.jit_watch import CompileWatch


def test_hooks_count_compiles_and_chain_to_earlier_hooks(monkeypatch):
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("before") or False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append("after"))
    watch = CompileWatch()
    assert watch.install() and watch.install()  # a second install is a no-op
    mark = watch.mark()
    fn = SimpleNamespace(name="_paged_attn_kernel", jit_function=object())
    for key in ("k1", "k2"):
        skip = knobs.runtime.jit_cache_hook(key=key, fn=fn, repr=f"_paged_attn_kernel[num_warps=4]({key}: i32)")
        assert not skip  # a true answer would make Triton skip the compile
        time.sleep(0.01)
        knobs.runtime.jit_post_compile_hook(key=key, fn=fn, repr=f"_paged_attn_kernel[num_warps=4]({key}: i32)")
    late = watch.since(mark)
    assert [r.kernel for r in late] == ["_paged_attn_kernel"] * 2
    # which launch each was (what a warm-up missed: cache_info's kernel_variants_compiled_after_warmup)
    assert [r.variant for r in late] == [f"_paged_attn_kernel[num_warps=4]({k}: i32)" for k in ("k1", "k2")]
    assert all(r.seconds >= 0.009 for r in late)
    assert calls == ["before", "after"] * 2  # the hooks that were there still run
    assert watch.since(watch.mark()) == []


def test_an_earlier_hook_that_skips_a_compile_still_skips_it(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    watch.install()
    assert knobs.runtime.jit_cache_hook(key="k", fn=None, repr="x[...]") is True


def test_gluon_launches_run_without_the_hooks_and_report_their_compiles(monkeypatch):
    """Triton 3.6 serializes a kernel's constants to JSON before calling these hooks, which fails
    for the Gluon FP4 kernel's: its launches run with the hooks unset (and restored after), and a
    launch that compiled a variant is reported to the watch through the kernel module's listeners."""
    from kernels import fp4_gluon

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(fp4_gluon, "COMPILE_LISTENERS", [])
    watch = CompileWatch()
    assert watch.install() and fp4_gluon.COMPILE_LISTENERS == [watch._record]
    hooks = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    variants = [3]
    monkeypatch.setattr(fp4_gluon, "_variants", lambda: variants[0])
    seen = []

    def launch(compiles):
        seen.append((knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook))
        variants[0] += compiles

    mark = watch.mark()
    fp4_gluon._without_jit_hooks(lambda: launch(1))  # compiled a variant
    fp4_gluon._without_jit_hooks(lambda: launch(0))  # cached
    assert seen == [(None, None)] * 2
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == hooks
    assert [r.kernel for r in watch.since(mark)] == ["_fp4_decode_kernel"]
