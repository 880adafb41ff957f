"""Multimodal RoPE (M-RoPE) positions and rotation, matching transformers' Qwen2-VL.

Text tokens get one position on all three axes; an image's pad tokens get (t, row, col) offsets
from the position where the image starts, and text after an image continues from that start plus
max(h, w) / merge (transformers' get_rope_index).
"""
from __future__ import annotations

import torch

from docproc.multimodal import ImageSpan


def mrope_positions(images: list[ImageSpan], start: int, end: int, device=None) -> torch.Tensor:
    """Positions of tokens start..end-1 of a sequence with these images: (3, end - start) int64."""
    idx = torch.arange(start, end, dtype=torch.long)
    pos = idx.clone()
    delta = 0  # shift of text positions after the images seen so far
    out = pos.unsqueeze(0).repeat(3, 1)
    for im in images:
        if im.offset >= end:
            break
        base = im.offset + delta
        in_img = (idx >= im.offset) & (idx < im.end)
        if in_img.any():
            j = idx[in_img] - im.offset
            _, h, w = im.grid_thw
            hh, ww = h // im.merge_size, w // im.merge_size
            out[0, in_img] = base + j // (hh * ww)
            out[1, in_img] = base + (j // ww) % hh
            out[2, in_img] = base + j % ww
        delta += im.position_span - im.num_tokens
        after = idx >= im.end
        out[:, after] = idx[after] + delta
    return out.to(device) if device is not None else out


class MRotaryEmbedding(torch.nn.Module):
    """cos and sin of the M-RoPE angles. Which of (t, h, w) drives each frequency: Qwen2-VL's
    sections in turn (the first mrope_section[0] frequencies t, the next h, the rest w); Qwen3-VL's
    interleaved (frequency i is h where i % 3 == 1 and i < 3 mrope_section[1], w where i % 3 == 2
    and i < 3 mrope_section[2], else t)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int], interleaved: bool = False) -> None:
        super().__init__()
        if sum(mrope_section) * 2 != head_dim:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        # made on the CPU whatever the default device: arithmetic on the meta device (where the
        # loader builds the model) would import torch._dynamo, seconds of every engine's start
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # which of (t, h, w) drives each frequency
        if interleaved:
            i = torch.arange(head_dim // 2, device="cpu")
            axis = torch.zeros(head_dim // 2, dtype=torch.long, device="cpu")
            axis[(i % 3 == 1) & (i < 3 * mrope_section[1])] = 1
            axis[(i % 3 == 2) & (i < 3 * mrope_section[2])] = 2
        else:
            axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long, device="cpu")
                              for i, n in enumerate(mrope_section)])
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (3, num_tokens) -> cos, sin: (num_tokens, head_dim)
        freqs = positions[..., None].float() * self.inv_freq  # (3, N, D/2)
        freqs = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]  # (N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (N, heads, D); cos/sin: (N, D)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
