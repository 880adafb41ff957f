"""Triton kernels and their torch references (imports only torch and triton)."""
from pathlib import Path

_MODULES = frozenset(p.stem for p in Path(__file__).parent.glob("*.py"))


def __getattr__(name: str):
    # Hugging Face's `kernels` distribution (which transformers 5.25 and later require) has this
    # import name too. Whoever imports this package expecting that one (transformers' hub
    # kernels: `from kernels import CUDAProperties`) gets a message naming the fix, not a bare
    # ImportError from inside transformers. Dunders and this package's own modules stay
    # AttributeErrors, which the import system and hasattr() expect.
    if name.startswith("__") or name in _MODULES:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    raise ImportError(
        f"cannot import {name!r} from 'kernels': this 'kernels' is docproc's kernel package, which "
        "shares its import name with Hugging Face's 'kernels' distribution. docproc needs "
        "transformers<5.25, which does not require it: "
        "python3 -m pip install 'transformers>=5.0,<5.25' && python3 -m pip uninstall -y kernels")
