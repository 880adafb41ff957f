"""The attention seam: one interface over the paged KV cache.

`TorchPagedAttention` is the reference (used on CPU and as the oracle for kernels): it gathers each
sequence's blocks and runs causal attention for that sequence's query tokens. The Triton kernels
and the FP4 cache implement the same two calls, `store` and `attend`, over their own layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each sequence's query tokens sit in the flattened batch and in the cache.

    Sequence b owns query rows query_start[b]:query_start[b+1]; those tokens are the last ones of
    its first context_lens[b] tokens, so query row i of b has absolute index
    context_lens[b] - num_q(b) + i and attends to cache positions 0..that index.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat slot = block * block_size + offset
    query_start: list[int]  # (num_seqs + 1,) host ints
    context_lens: list[int]  # (num_seqs,) host ints, KV length after this step's tokens are stored
    block_tables: list[list[int]]  # per sequence, host ints
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


class TorchPagedAttention:
    """KV layout per layer: (2, num_blocks, block_size, num_kv_heads, head_dim), K then V."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        # k, v: (num_tokens, num_kv_heads, head_dim)
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)  # (2, num_slots, Hkv, D)
        flat[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: (num_tokens, num_heads, head_dim) -> (num_tokens, num_heads, head_dim)
        out = torch.empty_like(q)
        bs = meta.block_size
        for b in range(meta.num_seqs):
            q0, q1 = meta.query_start[b], meta.query_start[b + 1]
            ctx = meta.context_lens[b]
            num_q = q1 - q0
            blocks = torch.tensor(meta.block_tables[b][: -(-ctx // bs)], device=kv_cache.device)
            kv = kv_cache[:, blocks].reshape(2, -1, self.num_kv_heads, self.head_dim)[:, :ctx]
            k = kv[0].to(q.dtype).transpose(0, 1)  # (Hkv, ctx, D)
            v = kv[1].to(q.dtype).transpose(0, 1)
            qb = q[q0:q1].transpose(0, 1)  # (H, num_q, D)
            q_pos = torch.arange(ctx - num_q, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # (num_q, ctx)
            o = F.scaled_dot_product_attention(
                qb.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[q0:q1] = o[0].transpose(0, 1)
        return out
