"""The vision tower: transformers' own module for the matching architecture (it runs once per
unique image), wrapped so the engine sees one call: pixels of several images in, one tensor of
merged embeddings per image out."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from kernels.vision_fused import quick_gelu, vision_rotary_qk


def build_vision_tower(hf_config) -> nn.Module:
    if hf_config.model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls
    elif hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as cls,
        )
    else:  # the loader has already refused other model types
        raise ValueError(f"no vision tower for model_type {hf_config.model_type!r}")
    vcfg = hf_config.vision_config
    vcfg._attn_implementation = "sdpa"
    return cls._from_config(vcfg)


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


class _EncodeCall:
    """What the encoder knows on the host about the call in progress: each image's patch count
    (the attention's per-image spans), so no layer reads them back from the device."""

    lengths: list[int] | None = None
    force: bool = False  # tests: take the fast path on CPU tensors too (Triton's interpreter)
    # the SDPA backends the per-image attention may use (torch.nn.attention.SDPBackend), None:
    # torch's choice (cuDNN's flash kernel on the H200); bench_engine times each for head dim 80
    sdpa_backends: list | None = None


def _fast_vision_attention(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                           max_seqlen: int | None = None, **kwargs) -> torch.Tensor:
    """transformers' Qwen2-VL VisionAttention.forward on CUDA in inference, with q and k rotated by
    one Triton kernel (the same float32 math and rounding as apply_rotary_pos_emb_vision) and the
    per-image spans taken from the host (transformers reads cu_seqlens back from the device in
    every layer, a sync that keeps the host from queueing work ahead). Everything else as
    transformers does it: one SDPA call per image on the same strided q/k/v views, the outputs
    concatenated, the projection. Elsewhere (CPU, training, no spans) transformers' own forward."""
    call: _EncodeCall = self._docproc_call
    if not ((hidden_states.is_cuda or call.force) and call.lengths is not None and position_embeddings is not None
            and not torch.is_grad_enabled()):
        return self.hf_forward(hidden_states, cu_seqlens, position_embeddings=position_embeddings,
                               max_seqlen=max_seqlen, **kwargs)
    n = hidden_states.shape[0]
    qkv = self.qkv(hidden_states)
    cos, sin = position_embeddings
    q, k = vision_rotary_qk(qkv, cos, sin, self.num_heads)
    v = qkv.view(n, 3, self.num_heads, -1)[:, 2]
    out = torch.empty(n, self.num_heads, q.shape[-1], dtype=q.dtype, device=q.device)
    with contextlib.nullcontext() if call.sdpa_backends is None else sdpa_kernel(call.sdpa_backends):
        s0 = 0
        for length in call.lengths:
            sl = slice(s0, s0 + length)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1).unsqueeze(0),
                                               k[sl].transpose(0, 1).unsqueeze(0),
                                               v[sl].transpose(0, 1).unsqueeze(0), scale=self.scaling)
            out[sl] = o[0].transpose(0, 1)
            s0 += length
    return self.proj(out.view(n, -1))


def _fast_attention(module: nn.Module, call: _EncodeCall) -> None:
    """Route each Qwen2-VL vision attention of the tower through _fast_vision_attention (the module
    and its weights unchanged; its own forward kept for the other cases)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    fast = _fast_attention_class()
    for m in module.modules():
        if type(m) is VisionAttention:
            m._docproc_call = call
            m.__class__ = fast


@functools.cache
def _fast_attention_class() -> type:
    """VisionAttention with _fast_vision_attention as its forward: a subclass swapped in, made once
    (a bound method stored on each module would make every attention module a reference cycle,
    and the tower's weights would outlive the engine until the garbage collector runs)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    return type("FastVisionAttention", (VisionAttention,),
                {"forward": _fast_vision_attention, "hf_forward": VisionAttention.forward})


def _has_vision_utils() -> bool:
    """Whether this transformers computes the tower's position ids and cumulative lengths with the
    `transformers.vision_utils` helpers, which take precomputed ones from the call's kwargs (5.17
    and 5.24 do; where they are missing the tower runs transformers' own way throughout)."""
    try:
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids  # noqa: F401
    except ImportError:
        return False
    return True


def _host_vision_inputs(visual: nn.Module, grid_thw: torch.Tensor, device) -> tuple[dict, list[int]]:
    """transformers' own position ids and cumulative lengths for the tower, computed from a host
    copy of grid_thw and sent to the device without a sync (transformers would compute them on the
    device from a grid it reads back), and each image's patch count."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    grid = grid_thw.cpu()
    pos = get_vision_position_ids(grid, visual.spatial_merge_size)
    cu = get_vision_cu_seqlens(grid)
    lengths = (cu[1:] - cu[:-1]).tolist()
    return {"position_ids": pos.to(device, non_blocking=True), "cu_seqlens": cu.to(device, non_blocking=True)}, lengths


def _inplace_activations(module: nn.Module) -> None:
    from transformers.activations import QuickGELUActivation

    for name, child in module.named_children():
        if isinstance(child, QuickGELUActivation):
            setattr(module, name, QuickGELUInPlace())
        else:
            _inplace_activations(child)


class VisionEncoder(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        self.visual = build_vision_tower(hf_config)
        _inplace_activations(self.visual)
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size
        # Qwen2-VL's merger reads the trunk output in patch order, so another model's merger can
        # be applied to it; Qwen2.5-VL's trunk output is window-permuted, so it is not shared.
        self.shares_trunk = hf_config.model_type == "qwen2_vl"
        # Qwen2-VL on CUDA: the fused rotation and host-side spans (_fast_vision_attention)
        self._call = _EncodeCall()
        self.fast_attention = hf_config.model_type == "qwen2_vl" and _has_vision_utils()
        if self.fast_attention:
            _fast_attention(self.visual, self._call)

    def _run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        dtype = next(self.visual.parameters()).dtype
        if not (self.fast_attention and (pixel_values.is_cuda or self._call.force)):
            return self.visual(pixel_values.to(dtype), grid_thw=grid_thw.to(pixel_values.device))
        kwargs, self._call.lengths = _host_vision_inputs(self.visual, grid_thw, pixel_values.device)
        try:
            return self.visual(pixel_values.to(dtype), grid_thw=grid_thw.to(pixel_values.device), **kwargs)
        finally:
            self._call.lengths = None

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[list[torch.Tensor], list | None]:
        """Like forward, and also the trunk output per image (before the merger) when this
        architecture can share it: (merged per image, trunk per image or None). grid_thw may stay
        on the host (it is read there)."""
        out = self._run(pixel_values, grid_thw)
        merged = getattr(out, "pooler_output", out)
        grid = grid_thw.cpu()
        sizes = (grid.prod(-1) // self.spatial_merge_size**2).tolist()
        trunk = None
        if self.shares_trunk and hasattr(out, "last_hidden_state"):
            trunk = list(torch.split(out.last_hidden_state, grid.prod(-1).tolist()))
        return list(torch.split(merged, sizes)), trunk

    @torch.inference_mode()
    def merge(self, trunk: torch.Tensor) -> torch.Tensor:
        """This model's merger over a trunk output: (t*h*w, embed) -> (t*h*w/merge^2, hidden)."""
        return self.visual.merger(trunk.to(next(self.visual.merger.parameters()).dtype))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values: (num_patches, C*T*P*P) for all images; grid_thw: (num_images, 3).
        Returns one (t*h*w/merge^2, hidden) tensor per image."""
        out = self._run(pixel_values, grid_thw)
        merged = getattr(out, "pooler_output", out)
        sizes = (grid_thw.cpu().prod(-1) // self.spatial_merge_size**2).tolist()
        return list(torch.split(merged, sizes))
