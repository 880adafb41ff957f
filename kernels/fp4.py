"""The FP4 KV format: torch reference quantize/dequantize, the exact byte count, and the Triton
store kernel that quantizes new tokens into their paged slots.

Per token and KV head, along head_dim D:
- D values become FP4 E2M1 codes (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, and a sign bit), two per
  byte, packed "half-split": byte j holds dim j in its low nibble and dim j + D/2 in its high
  nibble, so a kernel computes dot(q_lo, k_lo) + dot(q_hi, k_hi) without unpacking across bytes.
- Groups of 16 consecutive dims share one scale, stored as an FP8 E4M3 byte e; the scale is
  decode(e) * head_scale, with head_scale an fp32 per (layer, K/V, KV head).
- Outliers: values with |x| > threshold * rms(x) (default 3.2), the largest first, up to
  `num_outliers` (default 2) per token-head, are taken out before the group scales are computed
  (their code becomes 0) and kept as (channel index uint8, fp16 value); dequantize adds them back.
  Unused slots hold (0, 0.0), which adds nothing.
Bytes per token-head: D/2 + D/16 + 3 * num_outliers (78 at D = 128: 0.305x of bf16's 256).
Per-token groups keep the cache append-only and page-local.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from kernels._triton import tl, triton

GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints: |q| above bound i has index > i
E4M3_MAX = 448.0
DEFAULT_HEAD_SCALE = 2.0 ** -4  # group scales from ~1e-3 to 28 keep full E4M3 precision
DEFAULT_THRESHOLD = 3.2
DEFAULT_NUM_OUTLIERS = 2


def bytes_per_token_head(head_dim: int, num_outliers: int = DEFAULT_NUM_OUTLIERS) -> int:
    """codes + E4M3 group scales + (uint8 index, fp16 value) per outlier slot."""
    assert head_dim % (2 * GROUP) == 0, "head_dim must be a multiple of 32"
    return head_dim // 2 + head_dim // GROUP + 3 * num_outliers


# ---- torch reference --------------------------------------------------------------------------
def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> E4M3 (fn) bits, round half up; saturates at 448."""
    v = v.float().clamp(0.0, E4M3_MAX)
    sub = torch.floor(v * 512.0 + 0.5)  # subnormals: m * 2^-9 (m = 8 carries into 2^-6 exactly)
    e = torch.floor(torch.log2(v.clamp_min(2.0 ** -6))).clamp(-6, 8)
    normal = (e + 7) * 8 + torch.floor((v * torch.exp2(-e) - 1.0) * 8.0 + 0.5)
    bits = torch.where(v < 2.0 ** -6, sub, normal)
    return bits.clamp(0, 126).to(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int32)
    e, m = b >> 3, (b & 7).float()
    return torch.where(e == 0, m * 2.0 ** -9, (8.0 + m) * torch.exp2((e - 10).float()))


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit code (sign << 3 | magnitude index), nearest value, saturating at 6."""
    a = q.abs()
    idx = torch.zeros_like(a, dtype=torch.uint8)
    for b in E2M1_BOUNDS:
        idx += (a > b).to(torch.uint8)
    sign = ((q < 0) & (idx > 0)).to(torch.uint8)
    return idx | (sign << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    c = code.to(torch.int32)
    idx, neg = c & 7, (c >> 3) & 1
    e, m = (idx >> 1).float(), (idx & 1).float()
    mag = torch.where(e == 0, 0.5 * m, (2.0 + m) * torch.exp2(e - 2.0))
    return torch.where(neg == 1, -mag, mag)


_LUTS: dict = {}


def dequantize_lut(t: "FP4Tensor", head_scale: torch.Tensor | float = DEFAULT_HEAD_SCALE) -> torch.Tensor:
    """dequantize_ref by table lookup (the tables are dequantize_ref's own decodes of all 16 codes
    and all 256 scale bytes, so the result is bit-identical): the CPU decode path, which
    dequantizes a sequence's whole context every step."""
    dev = t.codes.device
    if dev not in _LUTS:
        _LUTS[dev] = (e2m1_decode(torch.arange(16, device=dev)).float(), e4m3_decode(torch.arange(256, device=dev)).float())
    e2m1, e4m3 = _LUTS[dev]
    lead = t.codes.shape[:-1]
    d = 2 * t.codes.shape[-1]
    hs = torch.as_tensor(head_scale, dtype=torch.float32, device=dev).expand(lead)
    c = t.codes.long()
    vals = e2m1[torch.cat([c & 15, c >> 4], dim=-1)].view(*lead, d // GROUP, GROUP)
    x = (vals * (e4m3[t.scales.long()] * hs.unsqueeze(-1)).unsqueeze(-1)).view(*lead, d)
    return x.scatter_add(-1, t.outlier_idx.long(), t.outlier_val.float())


@dataclass
class FP4Tensor:
    codes: torch.Tensor  # (..., D/2) uint8, half-split packed
    scales: torch.Tensor  # (..., D/16) uint8, E4M3 bits
    outlier_idx: torch.Tensor  # (..., S) uint8
    outlier_val: torch.Tensor  # (..., S) float16


def quantize_ref(x: torch.Tensor, head_scale: torch.Tensor | float = DEFAULT_HEAD_SCALE,
                 num_outliers: int = DEFAULT_NUM_OUTLIERS, threshold: float = DEFAULT_THRESHOLD) -> FP4Tensor:
    """x: (..., D) -> FP4Tensor. head_scale broadcasts against x's leading dims."""
    d = x.shape[-1]
    xf = x.float().clone()
    lead = xf.shape[:-1]
    hs = torch.as_tensor(head_scale, dtype=torch.float32, device=x.device).expand(lead)
    rms = xf.pow(2).mean(-1).sqrt()
    thr = threshold * rms
    oidx = torch.zeros(*lead, num_outliers, dtype=torch.uint8, device=x.device)
    oval = torch.zeros(*lead, num_outliers, dtype=torch.float16, device=x.device)
    for s in range(num_outliers):
        cand = torch.where(xf.abs() > thr.unsqueeze(-1), xf.abs(), torch.full_like(xf, -1.0))
        best, where = cand.max(-1)
        take = best > 0
        picked = xf.gather(-1, where.unsqueeze(-1)).squeeze(-1)
        oidx[..., s] = torch.where(take, where, torch.zeros_like(where)).to(torch.uint8)
        oval[..., s] = torch.where(take, picked, torch.zeros_like(picked)).to(torch.float16)
        xf.scatter_(-1, where.unsqueeze(-1), torch.where(take, torch.zeros_like(picked), picked).unsqueeze(-1))
    groups = xf.view(*lead, d // GROUP, GROUP)
    scale = groups.abs().amax(-1) / 6.0  # (..., D/16)
    sbits = e4m3_encode(scale / hs.unsqueeze(-1))
    sdeq = e4m3_decode(sbits) * hs.unsqueeze(-1)
    q = torch.where(sdeq.unsqueeze(-1) > 0, groups / sdeq.unsqueeze(-1).clamp_min(1e-30), torch.zeros_like(groups))
    codes = e2m1_encode(q).view(*lead, d)
    packed = codes[..., : d // 2] | (codes[..., d // 2:] << 4)
    return FP4Tensor(packed, sbits, oidx, oval)


def dequantize_ref(t: FP4Tensor, head_scale: torch.Tensor | float = DEFAULT_HEAD_SCALE) -> torch.Tensor:
    """FP4Tensor -> (..., D) float32."""
    lead = t.codes.shape[:-1]
    half = t.codes.shape[-1]
    d = 2 * half
    hs = torch.as_tensor(head_scale, dtype=torch.float32, device=t.codes.device).expand(lead)
    codes = torch.cat([t.codes & 15, t.codes >> 4], dim=-1)
    vals = e2m1_decode(codes).view(*lead, d // GROUP, GROUP)
    x = (vals * (e4m3_decode(t.scales) * hs.unsqueeze(-1)).unsqueeze(-1)).view(*lead, d)
    return x.scatter_add(-1, t.outlier_idx.long(), t.outlier_val.float())


def outlier_stats(x: torch.Tensor, num_outliers: int = DEFAULT_NUM_OUTLIERS,
                  threshold: float = DEFAULT_THRESHOLD) -> dict:
    """How often values exceed the threshold: per value, per token-head vector, and beyond the slots."""
    xf = x.float()
    beyond = xf.abs() > threshold * xf.pow(2).mean(-1, keepdim=True).sqrt()
    per_vec = beyond.sum(-1)
    return {
        "value_rate": beyond.float().mean().item(),
        "vector_rate": (per_vec > 0).float().mean().item(),
        "overflow_vector_rate": (per_vec > num_outliers).float().mean().item(),
    }


# ---- Triton store kernel ------------------------------------------------------------------------
@triton.jit
def _e4m3_encode(v):
    v = tl.minimum(tl.maximum(v, 0.0), 448.0)
    sub = tl.floor(v * 512.0 + 0.5)
    e = tl.floor(tl.log2(tl.maximum(v, 0.015625)))
    e = tl.minimum(tl.maximum(e, -6.0), 8.0)
    normal = (e + 7.0) * 8.0 + tl.floor((v * tl.exp2(-e) - 1.0) * 8.0 + 0.5)
    bits = tl.where(v < 0.015625, sub, normal)
    return tl.minimum(tl.maximum(bits, 0.0), 126.0).to(tl.uint8)


@triton.jit
def _e4m3_decode(bits):
    b = bits.to(tl.int32)
    e = b >> 3
    m = (b & 7).to(tl.float32)
    return tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))


@triton.jit
def _e2m1_encode(q):
    a = tl.abs(q)
    idx = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = ((q < 0) & (idx > 0)).to(tl.int32)
    return idx | (sign << 3)


@triton.jit
def _quantize_one(x_lo, x_hi, hs, d_lo, HALF: tl.constexpr, NUM_OUTLIERS: tl.constexpr, THRESHOLD: tl.constexpr):
    """Quantize one token-head given as two halves: returns packed codes, the two halves' scale
    bits, and the outlier slots (as two small vectors)."""
    rms = tl.sqrt((tl.sum(x_lo * x_lo, 0) + tl.sum(x_hi * x_hi, 0)) / (2 * HALF))
    thr = THRESHOLD * rms
    SLOTS: tl.constexpr = max(NUM_OUTLIERS, 1)  # no slots: one dummy, never stored
    slots = tl.arange(0, SLOTS)
    oidx = tl.zeros([SLOTS], dtype=tl.int32)
    oval = tl.zeros([SLOTS], dtype=tl.float32)
    for s in tl.static_range(NUM_OUTLIERS):
        c_lo = tl.where(tl.abs(x_lo) > thr, tl.abs(x_lo), -1.0)
        c_hi = tl.where(tl.abs(x_hi) > thr, tl.abs(x_hi), -1.0)
        m_lo = tl.max(c_lo, 0)
        m_hi = tl.max(c_hi, 0)
        # first index of the maximum, as torch.max returns it (lo half before hi half)
        i_lo = tl.min(tl.where(c_lo == m_lo, d_lo, 2 * HALF), 0)
        i_hi = tl.min(tl.where(c_hi == m_hi, d_lo, 2 * HALF), 0) + HALF
        use_lo = m_lo >= m_hi
        best = tl.where(use_lo, m_lo, m_hi)
        where = tl.where(use_lo, i_lo, i_hi)
        take = (best > 0).to(tl.int32)  # 0/1 (a scalar: combined arithmetically, not with &)
        v_lo = tl.sum(tl.where(d_lo == where, x_lo, 0.0), 0)
        v_hi = tl.sum(tl.where(d_lo + HALF == where, x_hi, 0.0), 0)
        picked = tl.where(use_lo, v_lo, v_hi)
        sel = (slots == s).to(tl.int32) * take
        oidx = tl.where(sel > 0, where, oidx)
        oval = tl.where(sel > 0, picked, oval)
        x_lo = tl.where((d_lo == where).to(tl.int32) * take > 0, 0.0, x_lo)
        x_hi = tl.where((d_lo + HALF == where).to(tl.int32) * take > 0, 0.0, x_hi)
    g_lo = tl.reshape(x_lo, [HALF // 16, 16])
    g_hi = tl.reshape(x_hi, [HALF // 16, 16])
    sb_lo = _e4m3_encode(tl.max(tl.abs(g_lo), 1) / 6.0 / hs)
    sb_hi = _e4m3_encode(tl.max(tl.abs(g_hi), 1) / 6.0 / hs)
    sd_lo = _e4m3_decode(sb_lo) * hs
    sd_hi = _e4m3_decode(sb_hi) * hs
    q_lo = tl.where(sd_lo[:, None] > 0, g_lo / tl.maximum(sd_lo[:, None], 1e-30), 0.0)
    q_hi = tl.where(sd_hi[:, None] > 0, g_hi / tl.maximum(sd_hi[:, None], 1e-30), 0.0)
    c_lo = tl.reshape(_e2m1_encode(q_lo), [HALF])
    c_hi = tl.reshape(_e2m1_encode(q_hi), [HALF])
    packed = (c_lo | (c_hi << 4)).to(tl.uint8)
    return packed, sb_lo, sb_hi, oidx.to(tl.uint8), oval.to(tl.float16)


@triton.jit
def _fp4_store_kernel(
    # pointers
    x_ptr, slot_ptr, head_scale_ptr, codes_ptr, scales_ptr, oidx_ptr, oval_ptr,
    # sizes
    block_size,
    # strides: x (token, head, dim); cache views (block, slot-in-block, head, last)
    sx_t, sx_h,
    sc_b, sc_s, sc_h, ss_b, ss_s, ss_h, si_b, si_s, si_h, sv_b, sv_s, sv_h,
    # meta
    HALF: tl.constexpr, NUM_OUTLIERS: tl.constexpr, THRESHOLD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, HALF)
    x_lo = tl.load(x_ptr + t * sx_t + h * sx_h + d).to(tl.float32)
    x_hi = tl.load(x_ptr + t * sx_t + h * sx_h + HALF + d).to(tl.float32)
    hs = tl.load(head_scale_ptr + h)
    packed, sb_lo, sb_hi, oidx, oval = _quantize_one(x_lo, x_hi, hs, d, HALF, NUM_OUTLIERS, THRESHOLD)
    tl.store(codes_ptr + blk * sc_b + off * sc_s + h * sc_h + d, packed)
    g = tl.arange(0, HALF // 16)
    tl.store(scales_ptr + blk * ss_b + off * ss_s + h * ss_h + g, sb_lo)
    tl.store(scales_ptr + blk * ss_b + off * ss_s + h * ss_h + HALF // 16 + g, sb_hi)
    if NUM_OUTLIERS > 0:
        o = tl.arange(0, NUM_OUTLIERS)
        tl.store(oidx_ptr + blk * si_b + off * si_s + h * si_h + o, oidx)
        tl.store(oval_ptr + blk * sv_b + off * sv_s + h * sv_h + o, oval)


def fp4_store(x: torch.Tensor, slot_mapping: torch.Tensor, head_scale: torch.Tensor, codes: torch.Tensor,
              scales: torch.Tensor, outlier_idx: torch.Tensor, outlier_val: torch.Tensor,
              threshold: float = DEFAULT_THRESHOLD) -> None:
    """Quantize x (num_tokens, num_kv_heads, D) into paged slots. Cache views are
    (num_blocks, block_size, num_kv_heads, last) with last = D/2, D/16, S, S; head_scale is
    (num_kv_heads,) fp32."""
    n, h, d = x.shape
    assert d % 32 == 0 and (d & (d - 1)) == 0, f"head_dim must be a power of two >= 32, got {d}"
    assert x.stride(2) == 1, "x must be contiguous in head_dim"
    assert slot_mapping.shape == (n,) and slot_mapping.dtype == torch.long, "slot_mapping: (num_tokens,) int64"
    assert codes.dtype == torch.uint8 and codes.shape[2:] == (h, d // 2), f"codes view {tuple(codes.shape)}"
    assert scales.dtype == torch.uint8 and scales.shape[2:] == (h, d // GROUP), f"scales view {tuple(scales.shape)}"
    s = outlier_idx.shape[-1]
    assert outlier_idx.dtype == torch.uint8 and outlier_val.dtype == torch.float16 and outlier_val.shape[-1] == s
    assert s == 0 or (s & (s - 1)) == 0, "the number of outlier slots must be 0 or a power of two"
    assert head_scale.shape == (h,) and head_scale.dtype == torch.float32
    for t in (codes, scales, outlier_idx, outlier_val):
        assert t.stride(-1) == 1 or t.shape[-1] == 0, "cache views must be contiguous in their last dim"
    if n == 0:
        return
    _fp4_store_kernel[(n, h)](
        x, slot_mapping, head_scale, codes, scales, outlier_idx, outlier_val,
        codes.shape[1],
        x.stride(0), x.stride(1),
        *codes.stride()[:3], *scales.stride()[:3], *outlier_idx.stride()[:3], *outlier_val.stride()[:3],
        HALF=d // 2, NUM_OUTLIERS=s, THRESHOLD=threshold,
    )


# ---- the paged FP4 pool of one layer ------------------------------------------------------------
class FP4PagedLayer:
    """One layer's FP4 K/V pool. Each block is one page of bytes holding, for its block_size
    tokens and all KV heads, K and V codes, scales, outlier indices and outlier values (segments
    aligned to 16 bytes); the views below address it as (num_blocks, block_size, Hkv, last)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device,
                 num_outliers: int = DEFAULT_NUM_OUTLIERS, threshold: float = DEFAULT_THRESHOLD,
                 head_scale: float = DEFAULT_HEAD_SCALE) -> None:
        """num_outliers: key slots per token-head. Values have none (their outlier segments are
        zero-wide): slots for them bought no quality on the bundled pair (docs/fp4.md)."""
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.num_outliers, self.threshold = num_outliers, threshold
        slots = {"k": num_outliers, "v": 0}
        segments = [("codes", head_dim // 2, torch.uint8), ("scales", head_dim // GROUP, torch.uint8),
                    ("oidx", None, torch.uint8), ("oval", None, torch.float16)]
        layout, offset = [], 0
        for name, width, dtype in segments:
            for kv in ("k", "v"):
                last = slots[kv] if width is None else width
                nbytes = block_size * num_kv_heads * last * torch.empty((), dtype=dtype).element_size()
                layout.append((kv, name, last, dtype, offset, nbytes))
                offset += -(-nbytes // 16) * 16
        self.page_bytes = offset
        self.pages = torch.zeros(num_blocks, offset, dtype=torch.uint8, device=device)
        views: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        for kv, name, last, dtype, off, nbytes in layout:
            seg = self.pages[:, off: off + nbytes]
            if dtype != torch.uint8:
                seg = seg.view(dtype)
            views[kv][name] = seg.view(num_blocks, block_size, num_kv_heads, last)
        self.k, self.v = views["k"], views["v"]
        self.head_scale = torch.full((2, num_kv_heads), head_scale, dtype=torch.float32, device=device)

    def kernel_views(self, which: str) -> tuple:
        t, i = (self.k, 0) if which == "k" else (self.v, 1)
        return t["codes"], t["scales"], t["oidx"], t["oval"], self.head_scale[i]

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, use_triton: bool) -> None:
        """Quantize (num_tokens, Hkv, D) K and V into their slots."""
        for x, which in ((k, "k"), (v, "v")):
            codes, scales, oidx, oval, hs = self.kernel_views(which)
            if use_triton:
                fp4_store(x.contiguous(), slot_mapping, hs, codes, scales, oidx, oval, self.threshold)
            else:
                q = quantize_ref(x, hs, oidx.shape[-1], self.threshold)
                blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
                for view, val in ((codes, q.codes), (scales, q.scales), (oidx, q.outlier_idx),
                                  (oval, q.outlier_val)):
                    view[blk, off] = val  # the views are strided into the pages: write in place

    def gather(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of these blocks: (len(blocks) * block_size, Hkv, D) float32 each."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.pages.device)
        out = []
        for which, i in (("k", 0), ("v", 1)):
            t = getattr(self, which)
            q = FP4Tensor(*(t[name].index_select(0, idx) for name in ("codes", "scales", "oidx", "oval")))
            x = dequantize_lut(q, self.head_scale[i])  # (n, bs, Hkv, D)
            out.append(x.reshape(-1, self.num_kv_heads, self.head_dim))
        return out[0], out[1]

    @property
    def bytes_per_token(self) -> int:
        """What this layer's pool holds per token, K and V, from the allocation itself."""
        return self.page_bytes // self.block_size


# ---- the decode in PTX (text for inline assembly: Triton's and Gluon's FP4 kernels) ---------------
def fp4_pair_steps(word: str, scales: tuple[str, str, str, str], outs: list[str]) -> list[str]:
    """The decode's PTX for one 32-bit word of codes (`word`): two PRMTs spread bytes 0-1 and 2-3
    into the low byte of each 16-bit lane; then per pair of values (low nibbles of bytes 0-1, 2-3,
    high nibbles of 0-1, 2-3) an AND, one IMAD placing the magnitude at bits 6-8 and the sign at
    15, an AND, and a bf16x2 FMA by that pair's scale register. `outs` names the bf16x2 result per
    pair (or "{lo, hi}" pairs of 16-bit outputs, written through a scratch register y)."""
    lines = [f"prmt.b32 t01, {word}, 0, 0x4140;",  # bytes 0, 1 -> the low byte of each 16-bit lane
             f"prmt.b32 t23, {word}, 0, 0x4342;"]  # bytes 2, 3
    # (lanes, nibble mask, multiplier placing magnitude at bits 6-8 and sign at 15)
    for out, (src, mask, mul), scale in zip(outs, (("t01", "0x000F000F", "0x1040"), ("t23", "0x000F000F", "0x1040"),
                                                   ("t01", "0x00F000F0", "0x104"), ("t23", "0x00F000F0", "0x104")),
                                            scales):
        lines += [f"and.b32 x, {src}, {mask};", f"mul.lo.u32 x, x, {mul};", "and.b32 x, x, 0x81C081C0;"]
        if out.startswith("{"):
            lines += [f"fma.rn.bf16x2 y, x, {scale}, z;", f"mov.b32 {out}, y;"]
        else:
            lines += [f"fma.rn.bf16x2 {out}, x, {scale}, z;"]
    return lines
