"""Grammar masks on the logits: every token a row's grammar does not allow next becomes -inf, in
one kernel.

The mask is xgrammar's bitmask, (rows, ceil(T / 32)) int32, token t allowed where bit t % 32 of
word t // 32 is set, over the T ids the tokenizer knows. The logits may be wider than T (a model's
embedding is padded past its tokenizer: 152,064 rows for Qwen2-VL's 151,665 ids, 152,064 for a
384-token test tokenizer): those ids have no text, so a constrained row never allows them, while a
row without a constraint (`tail` 1) keeps them. The kernel only writes the -inf: nothing is read
but the mask.

Why a kernel: the torch form is five ops (shift, and, view, compare, masked_fill) and a
(rows, T) temporary; on a GPU each op costs host time in the step's critical path (BENCHMARKS.md,
the masks at batch 64).
"""
from __future__ import annotations

import torch

from kernels._triton import tl, triton


def apply_token_mask_ref(logits: torch.Tensor, bitmask: torch.Tensor, tail: torch.Tensor, num_tokens: int) -> None:
    """logits (n, V) in place: column t < num_tokens becomes -inf where bitmask[r] lacks bit t;
    columns from num_tokens on become -inf in rows whose tail is 0."""
    n, width = logits.shape
    t = min(num_tokens, width)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = ((bitmask[:n].unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :t]
    logits[:, :t].masked_fill_(bits == 0, float("-inf"))
    if width > t:
        logits[:, t:].masked_fill_((tail[:n] == 0).unsqueeze(-1), float("-inf"))


@triton.jit
def _apply_token_mask_kernel(logits_ptr, mask_ptr, tail_ptr, V, T, sl, sm, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    known = cols < T
    words = tl.load(mask_ptr + r * sm + cols // 32, mask=inside & known, other=0)
    bit = (words >> (cols % 32)) & 1
    tail = tl.load(tail_ptr + r)
    allowed = tl.where(known, bit != 0, tail != 0)
    tl.store(logits_ptr + r * sl + cols, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=inside & (allowed == 0))


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, tail: torch.Tensor, num_tokens: int) -> None:
    """apply_token_mask_ref in one kernel. logits (n, V) with unit stride along V; bitmask
    (>= n, ceil(num_tokens / 32)) int32 and tail (>= n,) int32 on the same device."""
    n, width = logits.shape
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    assert tail.dtype == torch.int32 and bitmask.shape[0] >= n and tail.shape[0] >= n
    assert bitmask.shape[1] * 32 >= min(num_tokens, width)
    if n == 0:
        return
    block = 1024
    _apply_token_mask_kernel[(n, triton.cdiv(width, block))](
        logits, bitmask, tail, width, min(num_tokens, width), logits.stride(0), bitmask.stride(0), BLOCK=block)
