"""What the pipeline may ask about the device without holding an engine."""
from __future__ import annotations


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def peak_gpu_memory() -> int | None:
    """The most GPU memory this process has allocated (bytes); None without CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
