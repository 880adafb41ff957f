"""Triton, or where it is not installed (a CPU-only install: `pip install docproc` without the
dev extra), a stand-in that lets the kernel files define their kernels. Such a kernel is never
launched there, since without a GPU or Triton's interpreter the engine runs the torch
references; launching one anyway says what to install."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _NotInstalled:
        """Every attribute, call and subscript of Triton's API: a value that does nothing until a
        kernel is launched."""

        def __init__(self, name: str = "triton") -> None:
            self._name = name

        def __getattr__(self, attr: str) -> "_NotInstalled":
            return _NotInstalled(f"{self._name}.{attr}")

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs and self._name.endswith("jit"):
                return _NotInstalled(getattr(args[0], "__name__", "kernel"))  # @triton.jit
            if self._name.endswith("constexpr") and len(args) == 1:
                return args[0]  # tl.constexpr(value) at module level
            if self._name.endswith("jit"):
                return self  # @triton.jit(...)(fn)
            raise RuntimeError(f"{self._name}: Triton is not installed; it runs the GPU kernels (the CUDA "
                               f"build of torch brings it; for the interpreter: pip install triton)")

        def __getitem__(self, grid) -> "_NotInstalled":
            return _NotInstalled(f"{self._name}[grid]")  # kernel[grid](...) raises when called

    triton = _NotInstalled("triton")
    tl = _NotInstalled("triton.language")
    gdc_launch_dependents = gdc_wait = _NotInstalled("gdc")



def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (its `interpret` knob): CUDA-only features
    (PDL, Gluon) are then off."""
    if not HAVE_TRITON:
        return False
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4 has no knobs: no interpreter check, CUDA features stay on
        return False
    return bool(getattr(knobs.runtime, "interpret", False))


__all__ = ["HAVE_TRITON", "triton", "tl", "gdc_launch_dependents", "gdc_wait", "interpreting"]
