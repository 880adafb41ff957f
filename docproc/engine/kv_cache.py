"""The paged KV pool: one cache object per layer in the attention backend's format, sized from a
memory budget and the real bytes per token."""
from __future__ import annotations

import torch

KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    if kv_cache_dtype == "auto":
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[model_dtype]
    return kv_cache_dtype


class KVCache:
    def __init__(self, backend, num_layers: int, block_size: int, dtype_name: str) -> None:
        self.backend = backend
        self.num_layers = num_layers
        self.block_size = block_size
        self.dtype_name = dtype_name
        self.num_blocks = 0
        self.layers: list = []

    @property
    def bytes_per_token(self) -> int:
        """Everything the cache stores per token: all layers, K and V (codes, scales, outliers)."""
        return self.num_layers * self.backend.bytes_per_token(self.block_size)

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        return max(0, num_bytes // (self.bytes_per_token * self.block_size))

    def allocate(self, num_blocks: int) -> None:
        self.layers = []  # free the old pool first
        self.layers = [self.backend.allocate(num_blocks, self.block_size) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks

    @property
    def allocated_bytes(self) -> int:
        """Measured from the allocation itself."""
        return sum(self.backend.layer_bytes(layer) for layer in self.layers)
