"""The attention seam: one interface over the paged KV cache, two cache formats, two
implementations.

A backend owns the per-layer cache objects and implements `store` (write the new tokens' K/V into
their slots) and `attend` (causal attention of the step's query tokens over their sequence's
cache). `DenseAttention` keeps bf16/fp16/fp32 K/V; `FP4Attention` keeps the FP4 format of
kernels/fp4.py. On CUDA both run our Triton kernels; on CPU they run the torch references. Each
layer stores before it attends, so a token always reads every K/V -- its own, its window's, its
prefix's -- exactly as stored (quantized, in FP4 mode), the same way in prefill, decode and
speculative verification.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.fp4 import DEFAULT_NUM_OUTLIERS, DEFAULT_THRESHOLD, FP4PagedLayer
from kernels.fused import rotary_, rotary_store_
from kernels.options import DEFAULT, KernelOptions
from kernels.attention_plan import TilePlan, plan_tiles, warmup_launches
from kernels.paged_attention import paged_attention, paged_attention_ref


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
    plan: TilePlan | None = None  # kernel tiling, built once per step by the backend

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step (a CUDA graph's slot_mapping also holds padding rows)."""
        return self.query_start[-1]


class _Backend:
    # whether decode plans may take the dense kernel's wide shape (kernels/paged_attention.py,
    # dense_wide_decode): the dense kernel over a bf16/fp16 cache only (DenseAttention)
    wide_decode = False
    # whether decode steps run the Gluon FP4 kernel (kernels/fp4_gluon.py), which takes its own
    # split count (plan_tiles' fp4_gluon): FP4Attention where it can
    fp4_gluon = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, device: torch.device,
                 kernels: KernelOptions = DEFAULT) -> None:
        self.kernels = kernels  # the engine's kernel choices (kernels/options.py)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.device = device
        self.use_triton = device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if self.use_triton else 1

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers."""
        if self.use_triton:
            meta.plan = plan_tiles(meta.query_start, meta.context_lens, meta.block_tables,
                                   self.num_heads // self.num_kv_heads, self.device, num_sms=self.num_sms,
                                   num_kv_heads=self.num_kv_heads, dense=self.wide_decode,
                                   fp4_gluon=self.fp4_gluon, invariant=self.kernels.batch_invariant)

    def rotary_store(self, layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata, norm: tuple | None = None) -> torch.Tensor:
        """CUDA: rotate the q and k heads of a fused projection output (N, H + 2 Hkv, D) in place
        (norm (q_weight, k_weight, eps): each RMS-normalised first, Qwen3's q and k norms) and
        store k and v; returns q. A backend may do both in one kernel."""
        h, hkv = self.num_heads, self.num_kv_heads
        qk = rotary_(qkv[:, : h + hkv], cos, sin, None if norm is None else (*norm, h))
        self.store(layer, qk[:, h:], qkv[:, h + hkv:], meta)
        return qk[:, :h]

    def warmup(self, layer, block_size: int, qk_norm: bool = False) -> float:
        """Compile the kernels for every launch shape the engine can ask for (each tile shape:
        decode, verify windows, prefill chunks; each split count: kernels/paged_attention.py's
        warmup_launches; qk_norm: the rotation with Qwen3's q and k norms), so no request pays
        Triton's JIT. Returns seconds."""
        if not self.use_triton or self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        n_blocks = self.num_blocks(layer)
        invariant = self.kernels.batch_invariant
        for q_len, splits, dense_block_n in warmup_launches(self.num_heads // self.num_kv_heads,
                                                            dense=self.wide_decode,
                                                            num_kv_heads=self.num_kv_heads, invariant=invariant):
            ctx = q_len
            blocks = list(range(min(n_blocks, -(-ctx // block_size))))
            if len(blocks) * block_size < ctx:
                continue
            meta = AttentionMetadata(torch.arange(ctx - q_len, ctx, device=self.device), [0, q_len], [ctx], [blocks],
                                     block_size)
            meta.plan = plan_tiles(meta.query_start, meta.context_lens, meta.block_tables,
                                   self.num_heads // self.num_kv_heads, self.device, num_splits=splits,
                                   dense_block_n=dense_block_n, invariant=invariant)
            q = torch.zeros(q_len, self.num_heads, self.head_dim, device=self.device, dtype=self.compute_dtype)
            kv = torch.zeros(q_len, self.num_kv_heads, self.head_dim, device=self.device, dtype=self.compute_dtype)
            self.store(layer, kv, kv, meta)
            self.attend(q, layer, meta)
            qkv = torch.zeros(q_len, self.num_heads + 2 * self.num_kv_heads, self.head_dim, device=self.device,
                              dtype=self.compute_dtype)
            cs = torch.zeros(q_len, self.head_dim, device=self.device, dtype=self.compute_dtype)
            w = torch.ones(self.head_dim, device=self.device, dtype=self.compute_dtype)
            # the model's path on CUDA (fused qkv)
            self.rotary_store(layer, qkv, cs, cs, meta, (w, w, 1e-6) if qk_norm else None)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


class DenseAttention(_Backend):
    """K/V as bf16/fp16/fp32; per layer a (2, num_blocks, block_size, Hkv, D) tensor."""

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, device, dtype: torch.dtype,
                 compute_dtype: torch.dtype, kernels: KernelOptions = DEFAULT) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, device, kernels)
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        # the wide decode shape for 2-byte caches and compute, head_dim <= 128 only (as measured:
        # bf16, 128): 128 keys of float32 K and V a step in 2 stages, or of bf16 at head_dim 256,
        # would need 256 KB of shared memory
        half = (torch.bfloat16, torch.float16)
        self.wide_decode = dtype in half and compute_dtype in half and head_dim <= 128

    def allocate(self, num_blocks: int, block_size: int) -> torch.Tensor:
        return torch.zeros(2, num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def bytes_per_token(self, block_size: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @staticmethod
    def layer_bytes(layer: torch.Tensor) -> int:
        return layer.numel() * layer.element_size()

    @staticmethod
    def num_blocks(layer: torch.Tensor) -> int:
        return layer.shape[1]

    def store(self, layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        # k, v: (num_tokens, Hkv, D)
        flat = layer.view(2, -1, self.num_kv_heads, self.head_dim)  # (2, num_slots, Hkv, D)
        flat[0].index_copy_(0, meta.slot_mapping, k.to(layer.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, v.to(layer.dtype))

    def rotary_store(self, layer: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata, norm: tuple | None = None) -> torch.Tensor:
        # one launch (q and k normalised where norm is given) rotates q and k and writes k and v to
        # their slots (two index_copy_ fewer a layer)
        flat = layer.view(2, -1, self.num_kv_heads, self.head_dim)
        return rotary_store_(qkv, cos, sin, flat[0], flat[1], meta.slot_mapping, self.num_heads,
                             pdl_on=self.kernels.pdl, norm=norm)

    def attend(self, q: torch.Tensor, layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: (num_tokens, num_heads, D) -> (num_tokens, num_heads, D)
        if self.use_triton:
            return paged_attention(q, meta.plan, self.scale, k_cache=layer[0], v_cache=layer[1],
                                   pdl_on=self.kernels.pdl)

        def gather(blocks):
            # index_select, not layer[:, idx]: on CPU advanced indexing on the block dim is ~8x slower
            # (616 vs 80 us for an 82-block context), and the torch path is the CPU's decode path
            idx = torch.tensor(blocks, device=layer.device)
            kv = layer.index_select(1, idx).reshape(2, -1, self.num_kv_heads, self.head_dim)
            return kv[0], kv[1]

        return paged_attention_ref(q, gather, meta.query_start, meta.context_lens, meta.block_tables,
                                   meta.block_size, self.scale)


class FP4Attention(_Backend):
    """K/V in the FP4 format (codes, E4M3 group scales, fp16 outliers) in one page per block."""

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, device, compute_dtype: torch.dtype,
                 num_outliers: int = DEFAULT_NUM_OUTLIERS, threshold: float = DEFAULT_THRESHOLD,
                 kernels: KernelOptions = DEFAULT) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, device, kernels)
        if head_dim % 32 or head_dim & (head_dim - 1):
            raise ValueError(f"the FP4 KV cache needs a power-of-two head_dim >= 32; this model has {head_dim}: "
                             f"use kv_cache_dtype bf16")
        self.compute_dtype = compute_dtype
        self.num_outliers = num_outliers
        self.threshold = threshold
        if self.use_triton and kernels.fp4_gluon and not kernels.batch_invariant:
            from kernels import fp4_gluon  # CUDA only: Gluon imports where it can run

            self.fp4_gluon = fp4_gluon.engine_can_use(num_heads // num_kv_heads, head_dim, num_outliers,
                                                      compute_dtype, device)

    def allocate(self, num_blocks: int, block_size: int) -> FP4PagedLayer:
        return FP4PagedLayer(num_blocks, block_size, self.num_kv_heads, self.head_dim, self.device,
                             self.num_outliers, self.threshold)

    def bytes_per_token(self, block_size: int) -> int:
        return FP4PagedLayer(1, block_size, self.num_kv_heads, self.head_dim, "meta",
                             self.num_outliers).bytes_per_token

    @staticmethod
    def layer_bytes(layer: FP4PagedLayer) -> int:
        return layer.pages.numel()

    @staticmethod
    def num_blocks(layer: FP4PagedLayer) -> int:
        return layer.pages.shape[0]

    def store(self, layer: FP4PagedLayer, k, v, meta: AttentionMetadata) -> None:
        layer.store(k, v, meta.slot_mapping, self.use_triton)

    def attend(self, q: torch.Tensor, layer: FP4PagedLayer, meta: AttentionMetadata) -> torch.Tensor:
        if self.use_triton:
            # the Gluon kernel where a call allows, if this engine's plans were made for it
            return paged_attention(q, meta.plan, self.scale, fp4_k=layer.kernel_views("k"),
                                   fp4_v=layer.kernel_views("v"), fp4_gluon=self.fp4_gluon,
                                   pdl_on=self.kernels.pdl)
        return paged_attention_ref(q, layer.gather, meta.query_start, meta.context_lens, meta.block_tables,
                                   meta.block_size, self.scale)
