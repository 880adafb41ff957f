"""Triton kernels and their torch references (imports only torch and triton)."""

# Hugging Face's `kernels` distribution (which transformers 5.25 and later require) has this
# import name too. What transformers' hub-kernels module imports from it, asked of this package,
# gets a message naming the fix rather than a bare ImportError from inside transformers; any
# other missing name stays an AttributeError, as hasattr(), getattr() with a default and pickle
# expect.
_HUGGING_FACE_NAMES = frozenset((
    "CUDAProperties", "Device", "FuncRepository", "KernelizeFallback", "LayerRepository", "LocalFuncRepository",
    "LocalLayerRepository", "LockedLayerRepository", "Mode", "ROCMProperties", "get_kernel", "get_local_kernel",
    "has_kernel", "kernelize", "load_kernel", "register_kernel_mapping", "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub", "use_kernel_mapping", "use_kernelized_func"))


def __getattr__(name: str):
    if name not in _HUGGING_FACE_NAMES:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    raise ImportError(
        f"cannot import {name!r} from 'kernels': this 'kernels' is docproc's kernel package, which "
        "shares its import name with Hugging Face's 'kernels' distribution. docproc needs "
        "transformers<5.25, which does not require it: "
        "python3 -m pip install 'transformers>=5.0,<5.25' && python3 -m pip uninstall -y kernels")
