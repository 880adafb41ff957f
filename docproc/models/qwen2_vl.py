"""Our Qwen2 language model with M-RoPE over the paged KV cache (Qwen2-VL and Qwen2.5-VL share it).

Parameter names follow transformers' text model, so checkpoint keys map one to one. After
loading, each layer's products are fused (q|k|v, gate|up) and every product's weight is either a
tensor in the model dtype or an FP8 weight (models/quant.py); `project` runs either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from docproc.layers.attention import AttentionMetadata
from docproc.models.rope import MRotaryEmbedding, apply_rotary
from kernels.fused import add_rms_norm, add_rms_norm_ref, silu_mul
from docproc.models.quant import Fp8Weight, fp8_linear, stack
from kernels.gemv import linear, product, use_gemv
from kernels.options import DEFAULT, KernelOptions


def project(x: torch.Tensor, w, bias: torch.Tensor | None = None, opts: KernelOptions = DEFAULT) -> torch.Tensor:
    """x W^T (+ bias) for a float weight or an FP8 one."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias, opts=opts)
    return linear(x, w, bias, opts)


def _stack(weights: list) -> torch.Tensor | Fp8Weight:
    """Weights of one input size stacked along the output (q|k|v, gate|up): FP8 if all are."""
    if all(isinstance(w, Fp8Weight) for w in weights):
        return stack(weights)
    dtype = next((w.dtype for w in weights if not isinstance(w, Fp8Weight)), None)
    return torch.cat([w.dequantize(dtype) if isinstance(w, Fp8Weight) else w for w in weights])


def _drop_loaded(projs) -> None:
    """Forget the loader's per-module weights once they are stacked (the stack is a copy)."""
    for p in projs:
        if getattr(p, "loaded_weight", None) is not None:
            del p.loaded_weight


def weight_of(proj: nn.Linear):
    """A product's weight: the one the loader set in place of the module's parameter when it
    loads FP8 weights (proj.loaded_weight: FP8, or a float tensor for a module the checkpoint
    kept unquantized), else the module's own (as a plain tensor on the same storage, so that
    holding it does not register a second parameter)."""
    w = getattr(proj, "loaded_weight", None)
    return proj.weight.detach() if w is None else w


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
    tp_size: int = 1  # tensor parallelism: ranks the language model is split over
    tp_rank: int = 0
    # Qwen3 (Qwen3-VL's language model): a head size of its own, no q/k/v bias, q and k normalised
    # per head before the rotation, M-RoPE interleaved over T/H/W, and DeepStack: the first
    # `deepstack_layers` decoder layers' outputs get one more set of visual features added at
    # the image token positions
    head_size: int | None = None
    attention_bias: bool = True
    qk_norm: bool = False
    mrope_interleaved: bool = False
    deepstack_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_attention_heads

    # ---- this rank's share (all of it at tp_size 1) ------------------------------------------
    @property
    def heads(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def kv_heads(self) -> int:
        """KV heads split over the ranks, or one each (replicated) where there are fewer than ranks."""
        return max(1, self.num_key_value_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        """This rank's first KV head: the one its query heads read where KV heads are replicated."""
        if self.num_key_value_heads >= self.tp_size:
            return self.tp_rank * self.kv_heads
        return self.tp_rank * self.heads // (self.num_attention_heads // self.num_key_value_heads)

    @property
    def intermediate(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def vocab(self) -> int:
        """Rows of the vocabulary per rank: the last rank's share is padded with rows no id reads
        (and whose logits are cut off) where the ranks do not divide the vocabulary."""
        return -(-self.vocab_size // self.tp_size)

    def check_split(self) -> None:
        """ValueError when this geometry cannot be split over tp_size ranks."""
        n = self.tp_size
        bad = [what for what, ok in (
            (f"{self.num_attention_heads} attention heads", self.num_attention_heads % n == 0),
            (f"{self.num_key_value_heads} KV heads", self.num_key_value_heads % n == 0 or n % self.num_key_value_heads == 0),
            (f"an intermediate size of {self.intermediate_size}", self.intermediate_size % n == 0)) if not ok]
        if bad:
            raise ValueError(f"tensor_parallel_size={n} does not divide this model's {', '.join(bad)}")


class RMSNorm(nn.Module):
    kernels = DEFAULT  # the engine's kernel choices (Qwen2VLTextModel.set_kernel_options)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """weight * norm(x); with a residual, (weight * norm(x + residual), x + residual). On CUDA
        one fused kernel (kernels/fused.py), else its torch reference."""
        if x.is_cuda:
            out, r = add_rms_norm(x, residual, self.weight, self.eps, pdl_on=self.kernels.pdl)
        else:
            out, r = add_rms_norm_ref(x, residual, self.weight, self.eps)
        return out if residual is None else (out, r)


def _per_head(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """A per-head RMSNorm over (N, heads, D): each head's D values normalised on their own."""
    n, heads, d = x.shape
    return norm(x.reshape(n * heads, d)).view(n, heads, d)


class Attention(nn.Module):
    kernels = DEFAULT  # as RMSNorm's

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads = cfg.heads  # this rank's (all of them without tensor parallelism)
        self.num_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k (transformers' names)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv_weight: torch.Tensor | Fp8Weight | None = None  # set by fuse(): q, k, v in one matrix
        self.qkv_bias: torch.Tensor | None = None
        self.o_weight: torch.Tensor | Fp8Weight | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v (fewer kernel launches per step). Float parameters become
        views of the fused tensors, so names, state_dict and memory stay as they were; FP8
        weights are stacked (codes and scales)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        sizes = [p.out_features for p in projs]
        with torch.no_grad():
            b = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
            w = _stack([weight_of(p) for p in projs])
        if not isinstance(w, Fp8Weight) and all(p.weight is not None for p in projs):
            for proj, wv in zip(projs, w.split(sizes)):
                proj.weight.data = wv
        if b is not None:
            for proj, bv in zip(projs, b.split(sizes)):
                proj.bias.data = bv
        _drop_loaded(projs)
        self.qkv_weight, self.qkv_bias = w, b
        self.o_weight = weight_of(self.o_proj)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        n = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = project(x, self.qkv_weight, self.qkv_bias, self.kernels).view(n, h + 2 * hkv, d)
            if x.is_cuda:  # (q and k normalised,) rotated in place and k, v stored: one kernel for a dense cache
                norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
                q = backend.rotary_store(kv_cache, qkv, cos, sin, meta, norm)
                return project(backend.attend(q, kv_cache, meta).reshape(n, -1), self.o_weight, opts=self.kernels)
            if self.qk_norm:
                qkv = torch.cat([_per_head(self.q_norm, qkv[:, :h]), _per_head(self.k_norm, qkv[:, h: h + hkv]),
                                 qkv[:, h + hkv:]], dim=1)
            qk = apply_rotary(qkv[:, : h + hkv], cos, sin)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv:]
        else:
            q = self.q_proj(x).view(n, h, d)  # (N, H, D)
            k = self.k_proj(x).view(n, hkv, d)  # (N, Hkv, D)
            v = self.v_proj(x).view(n, hkv, d)
            if self.qk_norm:
                q, k = _per_head(self.q_norm, q), _per_head(self.k_norm, k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Store before attending: a sequence in this batch may read blocks another one writes now.
        backend.store(kv_cache, k, v, meta)
        o = backend.attend(q, kv_cache, meta)
        if self.o_weight is not None:
            return project(o.reshape(n, -1), self.o_weight, opts=self.kernels)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    kernels = DEFAULT  # as RMSNorm's

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | Fp8Weight | None = None  # set by fuse()
        self.down_weight: torch.Tensor | Fp8Weight | None = None

    def fuse(self) -> None:
        """One matmul for gate and up; float parameters become views of the fused tensor."""
        with torch.no_grad():
            w = _stack([weight_of(self.gate_proj), weight_of(self.up_proj)])
        if not isinstance(w, Fp8Weight) and self.gate_proj.weight is not None and self.up_proj.weight is not None:
            gate, up = w.split([self.gate_proj.out_features, self.up_proj.out_features])
            self.gate_proj.weight.data, self.up_proj.weight.data = gate, up
        _drop_loaded((self.gate_proj, self.up_proj))
        self.gate_up_weight = w
        self.down_weight = weight_of(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            opts = self.kernels
            gate_up = project(x, self.gate_up_weight, opts=opts)  # (N, 2 * intermediate)
            down = self.down_weight
            if use_gemv(gate_up, opts):  # SiLU x up inside the down projection's kernel
                if isinstance(down, Fp8Weight):
                    return fp8_linear(gate_up, down, gated=True, opts=opts)
                return product(gate_up, down, gated=True, opts=opts)
            if x.is_cuda:
                return project(silu_mul(gate_up), down, opts=opts)
            gate, up = gate_up.chunk(2, dim=-1)
            return project(F.silu(gate) * up, down, opts=opts)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.tp = None  # the tensor-parallel process group (set by the engine): o and down sum over it
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
        if self.tp is not None:  # row-parallel o_proj: each rank holds a part of the sum
            torch.distributed.all_reduce(h, group=self.tp)
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        if self.tp is not None:  # row-parallel down_proj
            torch.distributed.all_reduce(h, group=self.tp)
        return h, residual


class Qwen2VLTextModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. forward() works on a flattened batch
    of tokens (num_tokens, ...) with their (3, num_tokens) M-RoPE positions."""
    kernels = DEFAULT  # as RMSNorm's

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = None  # the tensor-parallel process group (set_tensor_parallel)
        # this rank's rows of the vocabulary; an uninitialised weight (the loader fills it): a random
        # init on the meta device would import torch._dynamo, seconds of every engine's start
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden_size, _weight=torch.empty(cfg.vocab, cfg.hidden_size))
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab, bias=False)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,)
        positions: torch.Tensor,  # (3, N)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend,
        image_rows: torch.Tensor | None = None,  # (M,) rows of the batch that are image tokens
        image_embeds: torch.Tensor | None = None,  # (M, hidden x (1 + deepstack_layers))
    ) -> torch.Tensor:
        if self.tp is None:
            x = self.embed_tokens(input_ids)  # (N, hidden)
        else:  # vocabulary-parallel: each rank embeds the ids in its rows, the sum has them all
            start = self.cfg.tp_rank * self.cfg.vocab
            local = input_ids - start
            outside = (local < 0) | (local >= self.cfg.vocab)
            x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
            torch.distributed.all_reduce(x, group=self.tp)
        deep: list[torch.Tensor] = []
        if image_rows is not None and image_rows.numel():
            # an image token's embedding, then one DeepStack feature per early layer (Qwen3-VL), side by side
            parts = image_embeds.to(x.dtype).split(self.cfg.hidden_size, dim=-1)
            x = x.index_copy(0, image_rows, parts[0])
            deep = list(parts[1: 1 + self.cfg.deepstack_layers])
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, backend)
            if i < len(deep):  # added to the stream after the layer, as transformers adds it (same rounding)
                x, residual = (x + residual).index_add(0, image_rows, deep[i]), None
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def fuse_projections(self) -> None:
        """After the weights are loaded: q/k/v and gate/up each become one matmul."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def set_kernel_options(self, opts: KernelOptions) -> None:
        """The engine's kernel choices (kernels/options.py), for every module that launches a kernel."""
        self.kernels = opts
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.kernels = opts

    def set_tensor_parallel(self, group) -> None:
        self.tp = group
        for layer in self.layers:
            layer.tp = group

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head.weight, opts=self.kernels).float()
        if self.tp is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.cfg.tp_size)]  # vocabulary-parallel head
        torch.distributed.all_gather(parts, logits, group=self.tp)
        return torch.cat(parts, dim=-1)[:, : self.cfg.vocab_size]
