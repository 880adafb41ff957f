"""FP8 weights for the language model: the two checkpoint layouts docproc reads, quantization of
a bf16/fp16/fp32 checkpoint at load, and the weight object the model's products take.

Format (float8_e4m3fn codes, float32 scales; a weight's value is code x scale):
- per output channel: one scale per row of W (N, K). compressed-tensors checkpoints
  (`quant_method = "compressed-tensors"`, weights `strategy = "channel"` or `"tensor"`) and
  quantization at load (`LLM(quantization="fp8")`: scale = max |row| x (1/448)).
- per block: one scale per (128 x 128) tile of W (`quant_method = "fp8"`,
  `weight_block_size = [128, 128]`, `weight_scale_inv`). Held as one scale per row and
  128-column group (the block's scale repeated over its rows): the same values, and q, k, v
  (or gate, up) can be stacked into one matrix whatever their row counts.

Activations are not stored: on CUDA a product of several rows quantizes its input per token at
run time (dynamic, as both layouts declare); on CPU the weight is dequantized to the compute
dtype and the product is the float one (weight-only reference semantics).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from kernels.fp8 import (FP8, FP8_MAX, ROWS_MAX, TC_GROUP_ROWS_MAX, TC_ROWS_MAX, cublas_block_scales, dequantize_ref, gemm_fp8_rows,
                         gemm_fp8_tc, gemv_fp8, quantize_rows, scaled_mm, scaled_mm_blocks, tensor_core_fp8)
from kernels.fused import silu_mul, silu_mul_ref
from kernels.matmul import matmul
from kernels.options import DEFAULT, KernelOptions

QUANTIZATION_METHODS = ("fp8",)
LOAD_FORMATS = ("auto", "dummy")
# the language model's products that FP8 covers (the LM head and the vision tower stay in the
# compute dtype; a checkpoint's quantized vision weights are dequantized at load)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class UnsupportedQuantization(ValueError):
    pass


@dataclass
class Fp8Weight:
    """W (N, K) as float8 codes `data` (N, K) and float32 `scale` (N, G): row n, columns
    [g * group, (g + 1) * group) share scale[n, g] (G = 1: per output channel)."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int
    # whether products of several rows may quantize their input to FP8 per token (the layout's
    # dynamic activations); False: weight-only everywhere (the dequantized product)
    act_quant: bool = True
    # on CUDA, for 128 x 128 block-wise weights: the scales as cuBLAS's block scaling reads them
    # (kernels/fp8.py cublas_block_scales), made once; None where that product does not apply
    blocks: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        n, k = self.data.shape
        assert self.data.dtype == FP8 and self.scale.dtype == torch.float32
        assert self.scale.shape == (n, -(-k // self.group)), (self.scale.shape, n, k, self.group)
        if self.data.is_cuda and self.group == 128 and not self.per_channel and tensor_core_fp8(self.data.device)[1]:
            self.blocks = cublas_block_scales(self.scale, n, k)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    @property
    def per_channel(self) -> bool:
        return self.scale.shape[1] == 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) in dtype: code x scale in float32, rounded once to dtype."""
        return dequantize_ref(self.data, self.scale, self.group, dtype)


def quantize(w: torch.Tensor, row_amax: torch.Tensor | None = None) -> Fp8Weight:
    """Per-output-channel FP8 of a float weight (N, K): scale = max |row| x (1/448) (rows of
    zeros get scale 1), codes = round-to-nearest(W x (1 / scale)). row_amax (N, 1) float32: the rows' max
    |value| over all their columns where w holds some of them (a tensor-parallel rank's share of
    a row-parallel product), so that the share's codes are those of the whole weight."""
    data, scale = quantize_rows(w, row_amax)
    return Fp8Weight(data, scale, w.shape[1])


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """Block-wise FP8 of a float weight (N, K): one scale per (bn x bk) tile, max |tile| / 448 (the
    layout of block-wise checkpoints; load_format="dummy" draws a block-wise model so)."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    tiles = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # (gn, gk)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(gn * bn, gk * bk)[:n, :k]
    return from_blocks(codes.contiguous(), scale, block)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               gated: bool = False, opts: KernelOptions = DEFAULT) -> torch.Tensor:
    """x W^T (+ bias): on CUDA one row through the FP8 one-row kernel, up to ROWS_MAX rows (a
    verification window, a decode batch) through the few-row kernel (the codes read once,
    weight-only), more rows on the FP8 tensor cores with the input quantized at run time (per
    token for per-row weights, per token and group for group-wise ones): up to TC_ROWS_MAX rows (a
    decode batch) in Triton's product, which reads each weight tile once, past that in cuBLAS's
    (row-wise scales, or 128 x 128 block scaling where it applies; else Triton's again, for
    group-wise weights up to TC_GROUP_ROWS_MAX rows); else the dequantized product; on CPU the dequantized product (weight-only reference
    semantics). opts.one_row off: the one-row and few-row kernels and the fused SiLU are not taken.
    opts.batch_invariant on CUDA: the dequantized product for any row count in kernels/matmul.py,
    the weight dequantized in its tiles (the CPU's semantics, one summation order for every row)."""
    if opts.batch_invariant and x.is_cuda:
        if gated:
            x = silu_mul(x) if x.dim() == 2 and x.stride(-1) == 1 else silu_mul_ref(x)
        return matmul(x, w.data, bias, w.scale, w.group)
    one_row = opts.one_row and x.is_cuda
    if one_row and x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1:
        return gemv_fp8(x, w.data, w.scale, w.group, bias, gated=gated, pdl_on=opts.pdl)
    if gated:  # (one kernel on CUDA)
        x = silu_mul(x) if one_row and x.dim() == 2 and x.stride(-1) == 1 else silu_mul_ref(x)
    if (one_row and x.dim() == 2 and 1 <= x.shape[0] <= ROWS_MAX and x.stride(-1) == 1
            and x.dtype in (torch.bfloat16, torch.float16)
            and (w.per_channel or (w.group >= 16 and w.group & (w.group - 1) == 0))):
        # a verification window or a small batch: the codes read once for all rows (weight-only;
        # 16-bit inputs only: the tensor cores would round a float32 input to TF32)
        return gemm_fp8_rows(x, w.data, w.scale, w.group, bias)
    if (x.is_cuda and w.act_quant and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and (w.per_channel or (32 <= w.group <= 256 and w.group & (w.group - 1) == 0))
            and tensor_core_fp8(x.device)[0]):  # (wider groups: tiles of K = group overflow shared memory)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        bf16 = x.dtype == torch.bfloat16
        y = None
        if rows <= TC_ROWS_MAX:  # a decode batch: each weight tile read once for every row (Triton)
            y = gemm_fp8_tc(x2, w.data, w.scale, w.group, bias)
        elif w.per_channel and bf16 and x.shape[-1] % 16 == 0 and w.shape[0] % 16 == 0:
            y = scaled_mm(x2, w.data, w.scale, bias)  # (cuBLAS; a prefill's thousands of rows)
        elif not w.per_channel and bf16 and w.blocks is not None:
            y = scaled_mm_blocks(x2, w.data, w.blocks, bias)
        elif w.per_channel or rows <= TC_GROUP_ROWS_MAX:
            y = gemm_fp8_tc(x2, w.data, w.scale, w.group, bias)
        if y is not None:
            return y.view(*lead, -1)
    return torch.nn.functional.linear(x, w.dequantize(x.dtype), bias)


def channel_scales(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A compressed-tensors weight_scale ((N, 1), (N,) or a scalar) for an (N, K) weight, as the
    (N, 1) float32 scales of Fp8Weight."""
    n, k = shape
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(n)
    if s.numel() != n:
        raise UnsupportedQuantization(f"weight_scale of shape {tuple(scale.shape)} for a ({n}, {k}) weight")
    return s.reshape(n, 1).contiguous()


def block_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block-wise weight_scale_inv (ceil(N / bn), ceil(K / bk)) for an (N, K) weight, as the
    (N, ceil(K / bk)) float32 scales of Fp8Weight (each block's scale repeated over its rows)."""
    n, k = shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise UnsupportedQuantization(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a ({n}, {k}) "
                                      f"weight in {bn} x {bk} blocks (expected {want})")
    return scale_inv.float().repeat_interleave(bn, dim=0)[:n].contiguous()


def from_channel(data: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    """A compressed-tensors weight: codes (N, K) and weight_scale (N, 1), (N,) or a scalar."""
    return Fp8Weight(data.view(FP8), channel_scales(scale, tuple(data.shape)), data.shape[1])


def from_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """A block-wise weight: codes (N, K) and weight_scale_inv (ceil(N / bn), ceil(K / bk)), the
    factor each block's codes are multiplied by."""
    return Fp8Weight(data.view(FP8), block_scales(scale_inv, tuple(data.shape), block), block[1])


def share_scales(scale: torch.Tensor, group: int, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> tuple[torch.Tensor, int]:
    """The scales (and group) of a share of a weight whose scales are `scale` (N, G) in groups of
    `group` columns: its rows [rows) or its columns [cols) (a tensor-parallel rank's share).
    A column share that starts inside a group keeps exact values in smaller groups: each group's
    scale repeated over groups of gcd(group, start) columns (a power of two where group is one),
    e.g. 72B's down projection at two ranks starts at column 14,784, inside a 128-column block."""
    if rows is not None:
        scale = scale[rows[0]: rows[1]]
    if cols is not None:
        lo, hi = cols
        if scale.shape[1] == 1:  # per output channel: one scale for the whole row
            return scale.contiguous(), hi - lo
        g = math.gcd(group, lo) if lo else group
        if g != group:
            scale = scale.repeat_interleave(group // g, dim=1)
        scale, group = scale[:, lo // g: -(-hi // g)], g
    return scale.contiguous(), group


def stack(weights: list[Fp8Weight]) -> Fp8Weight:
    """Weights of the same K stacked along N (q|k|v, gate|up): one product for all."""
    group = weights[0].group
    assert all(w.group == group and w.shape[1] == weights[0].shape[1] for w in weights)
    return Fp8Weight(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]), group,
                     all(w.act_quant for w in weights))


# ---- checkpoint layouts ---------------------------------------------------------------------------
@dataclass
class Fp8Scheme:
    """How a checkpoint's (or the load's) FP8 weights are laid out."""

    method: str  # "compressed-tensors", "fp8" (block-wise) or "online" (quantized at load)
    block: tuple[int, int] | None = None  # the block-wise layout's (rows, columns)
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) kept in the checkpoint's dtype
    dynamic_activations: bool = True  # False: a weight-only checkpoint (no input_activations)

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"

    def is_quantized(self, module: str) -> bool:
        """Whether a checkpoint module (its full name, e.g. model.layers.0.mlp.up_proj) holds FP8
        codes. An online scheme quantizes the language model's products only."""
        if self.method == "online":
            return module.rsplit(".", 1)[-1] in LINEAR_NAMES and "visual" not in module
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern) or module.startswith(pattern + "."):
                return False
        return True


def checkpoint_scheme(raw_config: dict) -> Fp8Scheme | None:
    """The checkpoint's FP8 layout from config.json's quantization_config (None: not quantized);
    UnsupportedQuantization naming what is not supported."""
    q = raw_config.get("quantization_config") or (raw_config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise UnsupportedQuantization("quant_method 'fp8' without weight_block_size (per-tensor FP8): docproc "
                                          "reads the block-wise layout ([128, 128]) and compressed-tensors")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedQuantization(f"activation_scheme {q.get('activation_scheme')!r}: only dynamic")
        if q.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedQuantization(f"fp8 format {q.get('fmt')!r}: only e4m3")
        return Fp8Scheme("fp8", (int(block[0]), int(block[1])), tuple(q.get("modules_to_not_convert") or ()))
    raise UnsupportedQuantization(f"quant_method {method!r}: docproc reads FP8 weights in the compressed-tensors "
                                  f"and the block-wise 'fp8' layouts")


def _compressed_tensors(q: dict) -> Fp8Scheme:
    fmt = q.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r}: only float-quantized (FP8)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedQuantization(f"compressed-tensors with {len(groups)} config groups: only one")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    if not (w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") in ("channel", "tensor")
            and w.get("symmetric", True) and not w.get("dynamic", False)):
        raise UnsupportedQuantization(f"compressed-tensors weights {w}: only 8-bit float, per channel or per "
                                      f"tensor, symmetric, static")
    a = group.get("input_activations")
    if a is not None and not (a.get("dynamic") and a.get("type") == "float" and a.get("num_bits") == 8):
        raise UnsupportedQuantization(f"compressed-tensors input activations {a}: only dynamic 8-bit float "
                                      f"(static activation scales are not supported)")
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise UnsupportedQuantization(f"compressed-tensors targets {targets}: only Linear")
    if q.get("kv_cache_scheme"):
        raise UnsupportedQuantization("compressed-tensors kv_cache_scheme (FP8 KV scales): docproc's KV cache is "
                                      "bf16 or its own FP4 (--kv-cache); use a checkpoint without KV quantization")
    return Fp8Scheme("compressed-tensors", None, tuple(q.get("ignore") or ()), dynamic_activations=a is not None)


def resolve_scheme(raw_config: dict, quantization: str | None) -> Fp8Scheme | None:
    """The scheme a load uses: the checkpoint's, or quantization at load for a float checkpoint
    asked for with quantization="fp8"."""
    scheme = checkpoint_scheme(raw_config)
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise UnsupportedQuantization(f"quantization {quantization!r}: pick one of {', '.join(QUANTIZATION_METHODS)}")
    if scheme is None and quantization == "fp8":
        return Fp8Scheme("online")
    return scheme
