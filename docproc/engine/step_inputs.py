"""A step's per-token inputs, written one way for both paths: token ids, M-RoPE positions (three
axes) and the KV slot each token's keys and values go to.

The eager path (ModelRunner) writes chunks back to back into arrays of the step's length; the
graph path (GraphRunner) writes them into its padded static buffers, chunk i at row i * q. Both
call `write_chunk` per chunk, or `write_one_token_rows` for a step of one token per chunk (every
decode step and the draft's rounds), which does the same work in one vectorized pass: at batch 1
that host loop is most of what a 7B decode step spends outside the GPU.

Arrays are numpy int64: ids (N,), pos (3, N), slots (N,); an eager step's come from InputStage.
"""
from __future__ import annotations

import numpy as np
import torch

from docproc.models.rope import mrope_positions


class InputStage:
    """An eager step's int64 inputs (ids, positions, slots, image rows) in one array, sent to the
    device in one copy. On CUDA the array is a pinned buffer (a copy from pageable memory may wait
    for the step in flight), written again once the previous step's copy has left it (that copy
    is queued before the previous step's forward, so no forward is waited for); on CPU a new array."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.copied: "torch.cuda.Event | None" = None  # recorded after the last copy from the buffer

    def array(self, size: int) -> np.ndarray:
        if self.device.type != "cuda":
            return np.empty(size, dtype=np.int64)
        if self.buffer is None or self.buffer.numel() < size:
            with torch.inference_mode(False):  # (an ordinary tensor, whichever step makes it)
                self.buffer = torch.empty(max(size, 1 << 16), dtype=torch.long, pin_memory=True)
            self.copied = None
        elif self.copied is not None:
            self.copied.synchronize()
        return self.buffer.numpy()[:size]

    def to_device(self, flat: np.ndarray) -> torch.Tensor:
        """The array (from array()) on the device."""
        if self.device.type != "cuda":
            return torch.from_numpy(flat)
        out = self.buffer[: flat.size].to(self.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return out


def text_position_delta(images, start: int, end: int) -> int | None:
    """M-RoPE: tokens start..end-1 that touch no image all sit at index + delta on the three axes
    (delta = what the images before them added); None if the run touches an image."""
    delta = 0
    for im in images:
        if im.offset >= end:
            break
        if im.end > start:
            return None
        delta += im.position_span - im.num_tokens
    return delta


def _token(chunk, t: int) -> int:
    ids = chunk.seq.token_ids
    return ids[t] if t < len(ids) else chunk.window[t - len(ids)]


def write_chunk(chunk, base: int, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, block_size: int,
                clamp: int | None, images: bool = True) -> bool:
    """Rows base..base + n of the arrays get chunk's n tokens. With images=False a chunk that
    touches an image is refused (False, nothing written): its positions are not a run."""
    seq, start, end = chunk.seq, chunk.start, chunk.end
    num = end - start
    delta = text_position_delta(seq.images, start, end)
    bt = seq.block_table
    if num == 1 and delta is not None:  # a decode row: scalar writes
        tok = _token(chunk, start)
        ids[base] = tok if clamp is None or tok <= clamp else clamp
        pos[:, base] = start + delta
        slots[base] = bt[start // block_size] * block_size + start % block_size
        return True
    if delta is None:
        if not images:
            return False
        pos[:, base: base + num] = mrope_positions(seq.images, start, end).numpy()
    else:
        pos[:, base: base + num] = np.arange(start + delta, end + delta)
    tok = chunk.input_ids()
    ids[base: base + num] = tok if clamp is None else [min(x, clamp) for x in tok]
    slots[base: base + num] = [bt[x // block_size] * block_size + x % block_size for x in range(start, end)]
    return True


def write_one_token_rows(chunks, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, block_size: int,
                         clamp: int | None, on_table=None) -> list[int] | None:
    """Rows 0..m-1 get the one token of each of the m chunks (each chunk.end == chunk.start + 1).
    Returns the chunks' context lengths (their ends), or None, with the arrays partly written, if
    a token is an image's. on_table(i, block_table) is called per chunk (the graph path keeps its
    block-table rows with it)."""
    m = len(chunks)
    toks, posv, slotv, ends = [], [], [], []
    for i, c in enumerate(chunks):
        seq, start = c.seq, c.start
        delta = text_position_delta(seq.images, start, c.end)
        if delta is None:
            return None
        tid = seq.token_ids
        toks.append(tid[start] if start < len(tid) else c.window[start - len(tid)])
        posv.append(start + delta)
        bt = seq.block_table
        slotv.append(bt[start // block_size] * block_size + start % block_size)
        ends.append(c.end)
        if on_table is not None:
            on_table(i, bt)
    ids[:m] = toks
    if clamp is not None:
        np.minimum(ids[:m], clamp, out=ids[:m])
    pos[:, :m] = posv
    slots[:m] = slotv
    return ends
