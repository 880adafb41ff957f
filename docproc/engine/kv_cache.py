"""The paged KV pool: one tensor per layer, sized from a memory budget and the real bytes per token."""
from __future__ import annotations

import torch

KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype]:
    if kv_cache_dtype == "auto":
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[model_dtype]
        return name, model_dtype
    return kv_cache_dtype, KV_DTYPES[kv_cache_dtype]


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype_name: str, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype_name = dtype_name
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        self.layers: list[torch.Tensor] = []

    @property
    def bytes_per_token(self) -> int:
        """Everything the cache stores per token: all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        return max(0, num_bytes // (self.bytes_per_token * self.block_size))

    def allocate(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.layers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
