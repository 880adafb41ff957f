"""The vision towers: pixels of several images in, one tensor of merged embeddings per image out
(and, for trunk sharing with a draft, the trunk's output per image).

Each tower is our own module with transformers' parameter names, so a checkpoint loads as it is:
Qwen2-VL's (`patch_embed.proj`, `blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`,
`merger.{ln_q,mlp.0,mlp.2}`), Qwen2.5-VL's (RMSNorm, a gated MLP, window attention) and Qwen3-VL's
(a learned position grid, DeepStack mergers). Each computes what transformers' module computes,
op for op (float32 on a CPU: Qwen2-VL's the same floats, bit for bit; the tests hold the others to
transformers' logits and greedy tokens). Why not transformers' modules: importing its modeling
code pulls in torch._dynamo, torch.distributed's tensor and FSDP packages, custom-op
registrations and more, 4-5 s of every engine's start on the H200 for a tower the engine runs once
per unique page.

On CUDA in inference the attention rotates q and k with one Triton kernel (kernels/vision_fused.py,
the same float32 math and rounding) and takes each image's (or window's) span from the host (no
read-back of cu_seqlens in every layer); QuickGELU is one kernel in place.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from kernels.vision_fused import quick_gelu, vision_rotary_qk, vision_rotary_qk_ref


class QuickGELUInPlace(nn.Module):
    """x * sigmoid(1.702 x), as transformers' QuickGELUActivation, with one temporary instead of
    three when no gradient is needed (the same floats: the same two products and sigmoid). On the
    CPU the vision tower's MLP activation over a page's ~5,000 patches x 4 x hidden took longer
    than the MLP's two matmuls: 192 ms -> 84 ms for 30,720 x 1,024 on two cores. On CUDA, in
    inference, one Triton kernel in place of the three (kernels/vision_fused.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return x * torch.sigmoid(1.702 * x)
        if x.is_cuda and x.is_contiguous():
            return quick_gelu(x, out=x)
        y = x.mul(1.702)
        y.sigmoid_()
        return y.mul_(x)


def _gelu_tanh() -> nn.Module:
    return nn.GELU(approximate="tanh")


ACTIVATIONS = {"quick_gelu": QuickGELUInPlace, "gelu": nn.GELU, "gelu_pytorch_tanh": _gelu_tanh}


# A span of at least this many patches gets an attention call of its own (16 heads x 8 tiles of
# 128 queries fill the chip). SDPA's cuDNN backend builds an execution plan for every new shape,
# batch size included (H100: a median 41 ms of host time with the GPU idle, BENCHMARKS.md): runs
# of several equal pages made one plan per page count a step happened to encode. Alone, a page
# size is one plan for the run.
SPAN_ALONE = 1024


class EncodeCall:
    """What one encode knows on the host: each attention span's patch count (one per image frame),
    and the tower's choices for this call."""

    def __init__(self, lengths: list[int], fused: bool, sdpa_backends: list | None) -> None:
        self.lengths = lengths
        # runs of equal short spans: (first patch, span length, spans), one attention call each
        # (Qwen2.5-VL's windows: a page's ~80 windows of 64 patches are a handful of runs); a span
        # of SPAN_ALONE patches or more is a run of its own
        self.runs: list[tuple[int, int, int]] = []
        s0 = 0
        for length in lengths:
            if self.runs and self.runs[-1][1] == length and length < SPAN_ALONE:
                start, _, count = self.runs[-1]
                self.runs[-1] = (start, length, count + 1)
            else:
                self.runs.append((s0, length, 1))
            s0 += length
        self.fused = fused  # q and k rotated by the Triton kernel
        self.sdpa_backends = sdpa_backends


class PatchEmbed(nn.Module):
    """Each patch (C x T x P x P values, flattened) to embed_dim: a Conv3d whose kernel is its stride.
    fused (the fast path): one product of the flattened patches with the flattened kernel, the same
    sum in another order. cuDNN plans a convolution per input shape, and every encode has its own
    patch count (H100 step trace of a 7B run: 0.09 s of the GPU's idle time with the host inside
    this convolution). The reference path keeps the convolution (transformers' own floats)."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int,
                 bias: bool = False) -> None:
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.embed_dim = embed_dim
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=self.shape[1:], stride=self.shape[1:], bias=bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        w = self.proj.weight  # (embed_dim, C, T, P, P): a patch's values in the same order
        if fused:
            return F.linear(x.reshape(-1, w[0].numel()).to(w.dtype), w.reshape(self.embed_dim, -1), self.proj.bias)
        x = x.view(-1, *self.shape)  # (num_patches, C, T, P, P)
        return self.proj(x.to(w.dtype)).view(-1, self.embed_dim)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scaling = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, call: EncodeCall) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x)  # (N, 3 * heads * D)
        rotate = vision_rotary_qk if call.fused else vision_rotary_qk_ref
        q, k = rotate(qkv, cos, sin, self.num_heads)  # (N, heads, D) each
        v = qkv.view(n, 3, self.num_heads, -1)[:, 2]
        out = torch.empty(n, self.num_heads, q.shape[-1], dtype=q.dtype, device=q.device)
        # full attention within each span (an image's frame, or a window), one SDPA call for each
        # run of equal spans (the spans as its batch) on strided views
        h, d = self.num_heads, q.shape[-1]
        with contextlib.nullcontext() if call.sdpa_backends is None else sdpa_kernel(call.sdpa_backends):
            for s0, length, count in call.runs:
                sl = slice(s0, s0 + length * count)

                def spans(t):  # (count * length, heads, D) -> (count, heads, length, D)
                    return t[sl].view(count, length, h, d).transpose(1, 2)
                o = F.scaled_dot_product_attention(spans(q), spans(k), spans(v), scale=self.scaling)
                out[sl] = o.transpose(1, 2).reshape(count * length, h, d)
        return self.proj(out.view(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = ACTIVATIONS[act]()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen3VisionMlp(nn.Module):
    """Qwen3-VL's tower MLP (transformers' names: linear_fc1, linear_fc2)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.act = ACTIVATIONS[act]()
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str, mlp=VisionMlp) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp(dim, mlp_hidden, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, call: EncodeCall) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, call)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring trunk outputs (adjacent rows in patch order) to one LM embedding."""

    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def vision_positions(grid: list[list[int]], merge: int) -> torch.Tensor:
    """(num_patches, 2) row and column of every patch, in the processor's patch order: merge x
    merge windows row by row, each window's patches row by row; a frame's positions repeat per frame."""
    out = []
    for t, h, w in grid:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pos = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


class Qwen2VisionTower(nn.Module):
    def __init__(self, vcfg) -> None:
        super().__init__()
        self.merge = vcfg.spatial_merge_size
        self.num_heads = vcfg.num_heads
        act = getattr(vcfg, "hidden_act", "quick_gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
        self.patch_embed = PatchEmbed(vcfg.patch_size, vcfg.temporal_patch_size, getattr(vcfg, "in_channels", 3),
                                      vcfg.embed_dim)
        hidden = int(vcfg.embed_dim * vcfg.mlp_ratio)
        self.blocks = nn.ModuleList(VisionBlock(vcfg.embed_dim, vcfg.num_heads, hidden, act) for _ in range(vcfg.depth))
        self.merger = PatchMerger(vcfg.hidden_size, vcfg.embed_dim, self.merge)
        rope = getattr(vcfg, "rope_parameters", None) or {}
        self.rotary = _Rotary(vcfg.embed_dim // vcfg.num_heads, rope.get("rope_theta", 10000.0))

    def forward(self, pixel_values: torch.Tensor, grid: list[list[int]], fused: bool = False,
                sdpa_backends: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values: (num_patches, C*T*P*P); grid: (t, h, w) per image, on the host.
        Returns the trunk's output (num_patches, embed_dim) and the merged (num_patches / merge^2, hidden)."""
        device = pixel_values.device
        call = EncodeCall([h * w for t, h, w in grid for _ in range(t)], fused, sdpa_backends)
        cos, sin = self.rotary(vision_positions(grid, self.merge).to(device, non_blocking=True))
        x = self.patch_embed(pixel_values, fused)
        for block in self.blocks:
            x = block(x, cos, sin, call)
        return x, self.merger(x)


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger (transformers' names: norm, linear_fc1, linear_fc2): LayerNorm over each
    patch (or, post-shuffle, over the merge x merge patches side by side: the DeepStack mergers),
    then MLP with GELU to the language model's width."""

    def __init__(self, dim: int, context_dim: int, merge: int, post_shuffle: bool) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.hidden if post_shuffle else context_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden) if self.post_shuffle else x).view(-1, self.hidden)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a `side`-long axis and their weights for each target `index` on an axis of
    `size`: F.interpolate's bilinear with align_corners (transformers' Qwen3-VL arithmetic)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's tower: patches of 16 pixels (Conv3d with a bias), a learned square grid of
    position embeddings resampled bilinearly to each image's grid, the same 2-D rotary and
    per-image attention as Qwen2-VL's, LayerNorm + GELU(tanh) MLP blocks, and DeepStack: the
    outputs of the blocks in deepstack_visual_indexes through their own mergers. forward returns
    the trunk's output and, per merged token, the merger's output with each DeepStack feature
    beside it (hidden x (1 + len(deepstack_visual_indexes)) columns: what the language model
    splits, models/qwen2_vl.py)."""

    def __init__(self, vcfg) -> None:
        super().__init__()
        self.merge = vcfg.spatial_merge_size
        self.num_heads = vcfg.num_heads
        act = vcfg.hidden_act
        if act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
        dim = vcfg.hidden_size
        self.patch_embed = PatchEmbed(vcfg.patch_size, vcfg.temporal_patch_size, vcfg.in_channels, dim, bias=True)
        # an uninitialised weight (the loader fills it): a random init on the meta device would
        # import torch._dynamo, seconds of every engine's start
        self.pos_embed = nn.Embedding(vcfg.num_position_embeddings, dim,
                                      _weight=torch.empty(vcfg.num_position_embeddings, dim))
        self.side = int(vcfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(dim, vcfg.num_heads, vcfg.intermediate_size, act, Qwen3VisionMlp)
                                    for _ in range(vcfg.depth))
        self.merger = Qwen3PatchMerger(vcfg.out_hidden_size, dim, self.merge, post_shuffle=False)
        self.deepstack_visual_indexes = list(vcfg.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(vcfg.out_hidden_size, dim, self.merge, post_shuffle=True)
            for _ in self.deepstack_visual_indexes)
        rope = getattr(vcfg, "rope_parameters", None) or {}
        self.rotary = _Rotary(dim // vcfg.num_heads, rope.get("rope_theta", 10000.0))

    def position_embeddings(self, grid: list[list[int]], device) -> torch.Tensor:
        """(num_patches, dim): the learned grid resampled to each image's (h, w), in patch order."""
        pos = vision_positions(grid, self.merge)  # (N, 2) row, column
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid])
        h_taps, h_w = bilinear_taps(pos[:, 0], sizes[:, 0], self.side)
        w_taps, w_w = bilinear_taps(pos[:, 1], sizes[:, 1], self.side)
        idx = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4).to(device)
        weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4).to(device)
        return (self.pos_embed(idx) * weights[:, :, None]).sum(1)

    def forward(self, pixel_values: torch.Tensor, grid: list[list[int]], fused: bool = False,
                sdpa_backends: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        device = pixel_values.device
        call = EncodeCall([h * w for t, h, w in grid for _ in range(t)], fused, sdpa_backends)
        cos, sin = self.rotary(vision_positions(grid, self.merge).to(device, non_blocking=True))
        x = self.patch_embed(pixel_values, fused)
        x = x + self.position_embeddings(grid, device).to(x.dtype)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, call)
            if i in self.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return x, torch.cat([self.merger(x), *deep], dim=-1)


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2_5_VLRMSNorm: the norm in float32, cast back before the weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedVisionMlp(nn.Module):
    """Qwen2.5-VL's tower MLP: down(SiLU(gate(x)) * up(x)), every product with a bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5VisionBlock(VisionBlock):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str) -> None:
        super().__init__(dim, num_heads, mlp_hidden, act, GatedVisionMlp)
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)


class Qwen2_5PatchMerger(PatchMerger):
    """Qwen2-VL's merger with an RMSNorm (transformers' names: ln_q, mlp.0, mlp.2)."""

    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__(dim, context_dim, merge)
        self.ln_q = VisionRMSNorm(context_dim)


def window_order(grid: list[list[int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window attention (transformers' get_vision_window_index): the merge x merge
    groups of each frame reordered window by window (windows of `window` groups a side, row by
    row; a frame's last row and column of windows may be partial), and each window's patch count
    in that order. Returns (group order, window lengths in patches)."""
    order, lengths, base = [], [], 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    part = idx[f, r: r + window, c: c + window].reshape(-1)
                    order.append(part + base)
                    lengths.append(part.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), lengths


class Qwen2_5VisionTower(nn.Module):
    """Qwen2.5-VL's tower (transformers' parameter names): Qwen2-VL's patches and 2-D rotary,
    RMSNorm blocks with a gated SiLU MLP, and window attention: the merge groups reordered window
    by window (window_size pixels a side), attention within each window except in the blocks of
    fullatt_block_indexes (within each image), the merger's output put back in patch order. The
    trunk's output stays in window order (a draft cannot share it)."""

    def __init__(self, vcfg) -> None:
        super().__init__()
        self.merge = vcfg.spatial_merge_size
        self.num_heads = vcfg.num_heads
        dim = vcfg.hidden_size
        self.patch_embed = PatchEmbed(vcfg.patch_size, vcfg.temporal_patch_size, vcfg.in_channels, dim)
        self.blocks = nn.ModuleList(Qwen2_5VisionBlock(dim, vcfg.num_heads, vcfg.intermediate_size, "silu")
                                    for _ in range(vcfg.depth))
        self.merger = Qwen2_5PatchMerger(vcfg.out_hidden_size, dim, self.merge)
        self.full = set(vcfg.fullatt_block_indexes)
        self.window = vcfg.window_size // vcfg.spatial_merge_size // vcfg.patch_size  # merge groups a side
        rope = getattr(vcfg, "rope_parameters", None) or {}
        self.rotary = _Rotary(dim // vcfg.num_heads, rope.get("rope_theta", 10000.0))

    def forward(self, pixel_values: torch.Tensor, grid: list[list[int]], fused: bool = False,
                sdpa_backends: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        device = pixel_values.device
        unit = self.merge * self.merge
        order, windows = window_order(grid, self.merge, self.window)
        order_dev = order.to(device, non_blocking=True)
        whole = EncodeCall([h * w for t, h, w in grid for _ in range(t)], fused, sdpa_backends)
        windowed = EncodeCall(windows, fused, sdpa_backends)

        def permute(x):  # patches in merge groups, the groups in window order
            return x.view(-1, unit, x.shape[-1])[order_dev].view(-1, x.shape[-1])
        cos, sin = self.rotary(vision_positions(grid, self.merge).to(device, non_blocking=True))
        cos, sin = permute(cos), permute(sin)
        x = permute(self.patch_embed(pixel_values, fused))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in self.full else windowed)
        merged = self.merger(x)
        return x, merged[torch.argsort(order_dev)]


class _Rotary:
    """The towers' 2-D rotary angles: a quarter of head_dim's frequencies per axis, rows then
    columns, twice (rotate_half pairs i and i + D/2); float32 (num_patches, head_dim)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        quarter = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device="cpu") / quarter))
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = positions.device
        if dev not in self._on:
            self._on[dev] = self.inv_freq.to(dev)
        freqs = positions[..., None].float() * self._on[dev]  # (N, 2, head_dim / 4)

        def layout(f):
            f = torch.cat([f[:, 0], f[:, 1]], dim=-1)
            return torch.cat([f, f], dim=-1)

        return layout(freqs.cos()), layout(freqs.sin())


class VisionEncoder(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        if hf_config.model_type == "qwen2_vl":
            self.visual = Qwen2VisionTower(hf_config.vision_config)
        elif hf_config.model_type == "qwen3_vl":
            self.visual = Qwen3VisionTower(hf_config.vision_config)
        elif hf_config.model_type == "qwen2_5_vl":
            self.visual = Qwen2_5VisionTower(hf_config.vision_config)
        else:  # the loader has already refused other model types
            raise ValueError(f"no vision tower for model_type {hf_config.model_type!r}")
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size
        # Qwen2-VL's merger reads the trunk output in patch order, so another model's merger can
        # be applied to it; Qwen2.5-VL's trunk output is window-permuted, so it is not shared.
        self.shares_trunk = hf_config.model_type == "qwen2_vl"
        # the fused rotation on CUDA in inference (force_fused: on CPU tensors too, tests under
        # Triton's interpreter); sdpa_backends: the SDPA backends the per-image attention may use
        # (torch.nn.attention.SDPBackend; None: torch's choice; bench_engine times each)
        self.fast_attention = True
        self.force_fused = False
        self.sdpa_backends: list | None = None

    def _run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(trunk output, merged) over all images."""
        dtype = next(self.visual.parameters()).dtype
        fused = self.fast_attention and (pixel_values.is_cuda or self.force_fused) and not torch.is_grad_enabled()
        return self.visual(pixel_values.to(dtype), grid_thw.tolist(), fused, self.sdpa_backends)

    def _sizes(self, grid_thw: torch.Tensor) -> tuple[list[int], list[int]]:
        patches = grid_thw.cpu().prod(-1)
        return patches.tolist(), (patches // self.spatial_merge_size**2).tolist()

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[list[torch.Tensor], list | None]:
        """Like forward, and also the trunk output per image (before the merger) when this
        architecture can share it: (merged per image, trunk per image or None). grid_thw may stay
        on the host (it is read there)."""
        trunk, merged = self._run(pixel_values, grid_thw)
        patches, sizes = self._sizes(grid_thw)
        shared = list(torch.split(trunk, patches)) if self.shares_trunk and trunk is not None else None
        return list(torch.split(merged, sizes)), shared

    @torch.inference_mode()
    def merge(self, trunk: torch.Tensor) -> torch.Tensor:
        """This model's merger over a trunk output: (t*h*w, embed) -> (t*h*w/merge^2, hidden)."""
        return self.visual.merger(trunk.to(next(self.visual.merger.parameters()).dtype))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values: (num_patches, C*T*P*P) for all images; grid_thw: (num_images, 3).
        Returns one (t*h*w/merge^2, hidden) tensor per image."""
        return self.encode(pixel_values, grid_thw)[0]
