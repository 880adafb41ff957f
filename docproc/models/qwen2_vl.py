"""Our Qwen2 language model with M-RoPE over the paged KV cache (Qwen2-VL and Qwen2.5-VL share it).

Parameter names follow transformers' text model, so checkpoint keys map one to one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from docproc.layers.attention import AttentionMetadata
from docproc.models.rope import MRotaryEmbedding, apply_rotary
from kernels.fused import add_rms_norm, add_rms_norm_ref, silu_mul
from kernels.gemv import linear, product, use_gemv


@dataclass
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int]
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """weight * norm(x); with a residual, (weight * norm(x + residual), x + residual). On CUDA
        one fused kernel (kernels/fused.py), else its torch reference."""
        fn = add_rms_norm if x.is_cuda else add_rms_norm_ref
        out, r = fn(x, residual, self.weight, self.eps)
        return out if residual is None else (out, r)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by fuse(): q, k, v in one matrix
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v (fewer kernel launches per step). The three parameters become
        views of the fused tensors, so names, state_dict and memory stay as they were."""
        with torch.no_grad():
            w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        for proj, wv, bv in zip((self.q_proj, self.k_proj, self.v_proj), w.split(sizes), b.split(sizes)):
            proj.weight.data, proj.bias.data = wv, bv
        self.qkv_weight, self.qkv_bias = w, b

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        n = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight, self.qkv_bias).view(n, h + 2 * hkv, d)
            if x.is_cuda:  # q and k rotated in place and k, v stored: one kernel for a dense cache
                q = backend.rotary_store(kv_cache, qkv, cos, sin, meta)
                return linear(backend.attend(q, kv_cache, meta).reshape(n, -1), self.o_proj.weight)
            qk = apply_rotary(qkv[:, : h + hkv], cos, sin)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv:]
        else:
            q = self.q_proj(x).view(n, h, d)  # (N, H, D)
            k = self.k_proj(x).view(n, hkv, d)  # (N, Hkv, D)
            v = self.v_proj(x).view(n, hkv, d)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Store before attending: a sequence in this batch may read blocks another one writes now.
        backend.store(kv_cache, k, v, meta)
        o = backend.attend(q, kv_cache, meta)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        """One matmul for gate and up; the two parameters become views of the fused tensor."""
        with torch.no_grad():
            w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        gate, up = w.split([self.gate_proj.out_features, self.up_proj.out_features])
        self.gate_proj.weight.data, self.up_proj.weight.data = gate, up
        self.gate_up_weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate_up = linear(x, self.gate_up_weight)  # (N, 2 * intermediate)
            if use_gemv(gate_up):  # SiLU x up inside the down projection's kernel
                return product(gate_up, self.down_proj.weight, gated=True)
            if x.is_cuda:
                return self.down_proj(silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately, so that each residual add is fused into the
        next norm: returns (this layer's MLP output, the stream before it); the stream after the
        layer is their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen2VLTextModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. forward() works on a flattened batch
    of tokens (num_tokens, ...) with their (3, num_tokens) M-RoPE positions."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (3, N)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend,
        image_rows: torch.Tensor | None = None,  # (M,) rows of the batch that are image tokens
        image_embeds: torch.Tensor | None = None,  # (M, hidden)
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (N, hidden)
        if image_rows is not None and image_rows.numel():
            x = x.index_copy(0, image_rows, image_embeds.to(x.dtype))
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, backend)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def fuse_projections(self) -> None:
        """After the weights are loaded: q/k/v and gate/up each become one matmul."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight).float()
