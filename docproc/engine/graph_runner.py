"""CUDA graphs for small steps: decode, speculative verification, the draft's proposals.

A decode step of a 7B model is ~1,300 kernel launches whose host-side cost (27 ms per step
measured on an H200, against ~5.5 ms of kernel time) dwarfs the work. A captured graph replays
them with one launch. Graphs need fixed shapes and fixed addresses, so:

- a graph is captured per key (B, q, S, W): at most B sequences with at most q new tokens each, S
  attention key splits (flash-decoding; from the step's longest context, as the eager path picks
  them, so a run whose contexts stay in one range uses one or two split counts), W the dense
  kernel's keys per step where it decodes in its wide or narrow shape, else None
  (kernels/attention_plan.py, launch_shape: the eager plan's rule, over the padded batch). Every
  sequence gets q query rows; a shorter window is padded, and so are missing sequences. Padded
  rows have token 0, position 0 and write their K/V to a scratch slot (the pool's last block,
  which the block manager never hands out); their attention tiles have zero query tokens, so
  they read nothing. Outputs of real rows are gathered to the front inside the graph.
- every input lives in two static buffers (int64: ids, positions, slots, gather rows; int32: the
  attention tile plan and block tables), filled on the host in pinned memory and copied with one
  non-blocking copy each per step; the graph reads them at fixed addresses.

Steps with image tokens, longer windows or bigger batches run eagerly. Graphs are captured
lazily, the first time a key is needed (an eager run on the static buffers first, so Triton and
cuBLAS are initialised outside capture), into one memory pool per runner; the returned hidden
states are valid until the runner's next forward.
"""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from docproc.engine.step_inputs import write_chunk, write_one_token_rows
from docproc.layers.attention import AttentionMetadata
from kernels.attention_plan import TilePlan, launch_shape, tile_shape

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
Q_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_GRAPH_TOKENS = 2048
# free device memory below which a capture first returns the device cache's unused blocks: a
# graph's pool holds one step's activations (at most MAX_GRAPH_TOKENS tokens: ~0.3 GB at 72B)
CAPTURE_HEADROOM_BYTES = 1 << 30


def _seg(t: int) -> int:
    """Int32 elements from one tile-array segment of the static buffer to the next: t rounded up
    to 16 bytes, so that every segment starts 16-byte aligned like the separate tensors of an eager
    step. Triton specializes a pointer argument on that alignment: a misaligned segment would be a
    kernel variant the engine's warm-up did not compile, compiled inside the step that captures."""
    return -(-t // 4) * 4


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class GraphRunner:
    def __init__(self, runner, max_batch: int, max_len: int, capture: bool = True) -> None:
        """runner: the ModelRunner whose text model and KV pool the graphs use; max_len: the longest
        sequence (tokens, speculative window included). capture=False runs the same padded static
        path eagerly (tests on CPU, where Triton runs in its interpreter)."""
        self.runner = weakref.proxy(runner)  # the runner owns us: no cycle to keep its pool alive
        self.capture = capture
        self.device = runner.device
        backend = runner.backend
        self.group = backend.num_heads // backend.num_kv_heads
        self.num_kv_heads = backend.num_kv_heads
        self.num_sms = backend.num_sms
        self.wide_decode = backend.wide_decode
        self.fp4_gluon = getattr(backend, "fp4_gluon", False)
        kernels = getattr(backend, "kernels", None)
        self.invariant = bool(kernels and kernels.batch_invariant)  # batch-invariant plans (kernels/attention_plan.py)
        self.block_size = runner.block_size
        self.batches = tuple(b for b in BATCH_BUCKETS if b <= max(max_batch, 1))
        if self.batches[-1] < max_batch:
            self.batches += (max_batch,)
        self.max_batch = self.batches[-1]
        self.width = -(-max_len // self.block_size) + 1  # block-table columns
        max_tokens = MAX_GRAPH_TOKENS
        max_tiles = max_tokens  # at most one tile per query token
        self.host64 = torch.zeros(6 * max_tokens, dtype=torch.long, pin_memory=capture)
        self.host32 = torch.zeros(4 * _seg(max_tiles) + self.max_batch * self.width, dtype=torch.int32,
                                  pin_memory=capture)
        self.dev64 = torch.zeros_like(self.host64, device=self.device)
        self.dev32 = torch.zeros_like(self.host32, device=self.device)
        self.copied = torch.cuda.Event() if capture else None
        self.pool = None
        self.stream = None  # the capture stream (made with the pool)
        self.graphs: dict[tuple[int, int, int, int | None], tuple] = {}
        self._layouts: dict[tuple[int, int, int, int | None], tuple] = {}
        self.num_replays = 0
        self.capture_seconds = 0.0
        # the block table each host-buffer row holds: (the sequence's table list, its length). A
        # table list only grows in place (BlockManager.append_slots; every other change makes a new
        # list), so the same list at the same length has the same content and the row is not
        # rewritten (at ~80 blocks a row costs ~1.7 us of numpy per sequence per step). Kept for
        # one layout: another key's rows overlap these.
        self._rows: dict[int, tuple[list, int]] = {}
        self._rows_key = None

    @property
    def scratch_slot(self) -> int:
        return (self.runner.kv_cache.num_blocks - 1) * self.block_size

    # ---- eligibility -----------------------------------------------------------------------
    def key_for(self, chunks) -> tuple[int, int, int, int | None] | None:
        if not chunks:
            return None
        q = max(c.end - c.start for c in chunks)
        b = bucket(len(chunks), self.batches)
        qb = bucket(q, Q_BUCKETS)
        if b is None or qb is None or b * qb > MAX_GRAPH_TOKENS:
            return None
        for c in chunks:
            if len(c.seq.block_table) > self.width:
                return None
        tokens, _ = tile_shape(qb, self.group, self.invariant)
        tiles, ctx = b * -(-qb // tokens), max(c.end for c in chunks)
        splits, shape = launch_shape(tiles, qb, ctx, self.num_sms, self.num_kv_heads, self.wide_decode, self.fp4_gluon,
                                     self.invariant)
        return b, qb, splits, shape

    # ---- per step ----------------------------------------------------------------------------
    def _layout(self, key):
        """Views of the static buffers for a key: the same addresses every time (made once)."""
        if key not in self._layouts:
            self._layouts[key] = self._make_layout(key)
        return self._layouts[key]

    def _make_layout(self, key):
        b, q = key[:2]
        n = b * q
        tokens, block_m = tile_shape(q, self.group, self.invariant)
        per_seq = -(-q // tokens)
        t = b * per_seq
        a = _seg(t)
        d64, d32 = self.dev64, self.dev32
        views = {
            "ids": d64[:n], "pos": d64[n: 4 * n].view(3, n), "slots": d64[4 * n: 5 * n], "rows": d64[5 * n: 6 * n],
            "tile_seq": d32[:t], "tile_tok": d32[a: a + t], "tile_nq": d32[2 * a: 2 * a + t],
            "tile_pos": d32[3 * a: 3 * a + t], "table": d32[4 * a: 4 * a + b * self.width].view(b, self.width),
        }
        # the tiles' sequence and first query row depend on the key only: written from these each step
        idx = np.arange(t, dtype=np.int32)
        consts = (np.repeat(np.arange(b, dtype=np.int32), per_seq), idx // per_seq * q + idx % per_seq * tokens)
        return views, n, t, tokens, block_m, per_seq, consts

    def _table_row(self, i: int, bt: list[int]) -> None:
        """Row i of the host block-table buffer holds bt, written only if it does not already
        (see self._rows)."""
        row = self._rows.get(i)
        if row is None or row[0] is not bt or row[1] != len(bt):
            self._table[i, : len(bt)] = bt
            self._rows[i] = (bt, len(bt))

    def _fill(self, chunks, key) -> tuple[int, int, int, list[int], list[int]] | None:
        """Write the step's inputs into the pinned host buffers; None if a chunk touches an image.
        Returns (int64 count, int32 count, real rows, query_start, context_lens)."""
        b, q = key[:2]
        _, n, t, tokens, _, per_seq, (tile_seqs, tile_toks) = self._layout(key)
        bs = self.block_size
        h64 = self.host64.numpy()
        h32 = self.host32.numpy()
        ids, pos, slots, rows = h64[:n], h64[n: 4 * n].reshape(3, n), h64[4 * n: 5 * n], h64[5 * n: 6 * n]
        a = _seg(t)
        tseq, ttok, tnq, tpos = h32[:t], h32[a: a + t], h32[2 * a: 2 * a + t], h32[3 * a: 3 * a + t]
        self._table = h32[4 * a: 4 * a + b * self.width].reshape(b, self.width)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left these buffers
        ids[:] = 0
        pos[:] = 0
        slots[:] = self.scratch_slot
        tseq[:] = tile_seqs
        tnq[:] = 0
        tpos[:] = 0
        ttok[:] = tile_toks
        clamp = self.runner.max_input_id
        if key != self._rows_key:
            self._rows.clear()
            self._rows_key = key
        if q == 1:  # one token per sequence (decode; the draft's rounds): rows = sequences, vectorized
            m = len(chunks)
            ends = write_one_token_rows(chunks, ids, pos, slots, bs, clamp, self._table_row)
            if ends is None:
                return None
            rows[:m] = np.arange(m)
            rows[m:] = 0
            tnq[:m] = 1
            tpos[:m] = ends
            tpos[:m] -= 1
            return 6 * n, 4 * a + b * self.width, m, list(range(m + 1)), ends
        query_start, context_lens = [0], []
        r = 0
        for i, c in enumerate(chunks):
            start, end = c.start, c.end
            num = end - start
            base = i * q
            if not write_chunk(c, base, ids, pos, slots, bs, clamp, images=False):
                return None
            self._table_row(i, c.seq.block_table)
            rows[r: r + num] = np.arange(base, base + num) if num > 1 else base
            r += num
            if per_seq == 1:
                tnq[i] = num
                tpos[i] = start
            else:
                for j in range(per_seq):
                    tnq[i * per_seq + j] = max(0, min(tokens, num - j * tokens))
                    tpos[i * per_seq + j] = end - num + j * tokens if j * tokens < num else 0
            query_start.append(r)
            context_lens.append(end)
        rows[r:] = 0
        return 6 * n, 4 * a + b * self.width, r, query_start, context_lens

    def _forward_static(self, key) -> torch.Tensor:
        views, n, t, tokens, block_m, _, _ = self._layout(key)
        splits = key[2]
        plan = TilePlan(views["tile_seq"], views["tile_tok"], views["tile_nq"], views["tile_pos"], views["table"],
                        tokens, block_m, splits, 0, key[3], self.invariant)
        meta = AttentionMetadata(views["slots"], [0, n], [n], [], self.block_size, plan)
        text = self.runner.model.text
        hidden = text(views["ids"], views["pos"], self.runner.kv_cache.layers, meta, self.runner.backend)
        return hidden.index_select(0, views["rows"])  # real rows first

    def _capture(self, key) -> None:
        t0 = time.perf_counter()
        self._forward_static(key)  # eager first: Triton/cuBLAS set up outside the capture
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        # Not torch.cuda.graph(): before every capture it synchronizes the device and empties both
        # the device's and the pinned host memory's caches. The pinned buffers the sampler, the
        # image prefetch threads and the loader reuse would each be allocated again (cudaHostAlloc),
        # and cudaFreeHost waits for the device: 0.1 s of idle GPU a run on the H100's step trace.
        # Here the capture stream only waits for this stream's work, and the device cache is
        # returned only when the card is short of memory for the graph pool to grow into.
        if torch.cuda.mem_get_info(self.device)[0] < CAPTURE_HEADROOM_BYTES:
            torch.cuda.empty_cache()
        try:
            graph, out = self._record(key)
        except torch.OutOfMemoryError:  # the pool could not grow: with the device cache returned, once more
            torch.cuda.empty_cache()
            graph, out = self._record(key)
        self.graphs[key] = (graph, out)
        self.capture_seconds += time.perf_counter() - t0

    def _record(self, key) -> tuple:
        """Capture the step's forward into a new graph: (graph, its output)."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        # thread_local: the image-prefetch threads pin host memory (cudaHostAlloc, event queries)
        # while a step captures; in the default global mode any such call from another thread
        # invalidates the capture (cudaErrorStreamCaptureInvalidated). Only this thread's calls
        # are checked; nothing else enqueues work on the capturing stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                out = self._forward_static(key)
            except BaseException as e:
                try:  # (a forward that raised, e.g. out of memory, leaves a capture that ends cleanly)
                    graph.capture_end()
                except Exception as end:  # noqa: BLE001 -- the forward's error is the one raised
                    if hasattr(e, "add_note"):  # (Python 3.11+)
                        e.add_note(f"ending the capture also failed: {end}")
                raise
            graph.capture_end()
        current.wait_stream(self.stream)
        return graph, out

    def run(self, chunks, ids_from: torch.Tensor | None = None,
            ids_at: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """Hidden states of the chunks' tokens (num_tokens, hidden) and the step's metadata, or
        None if this step does not fit a graph. ids_from: a device tensor holding each chunk's one
        input token (the draft's chained proposals: the previous round's argmax, never read on the
        host); the host's token ids for those rows are then placeholders, overwritten on the device
        after the input copy, in stream order. Such a step must be one token per chunk. ids_at:
        (chunk indices, a device tensor of one token each): those chunks' first input token, so
        overwritten (an overlapped step's decode rows)."""
        key = self.key_for(chunks)
        if key is None:
            return None
        if ids_from is not None and (key[1] != 1 or ids_from.numel() != len(chunks)):
            return None
        filled = self._fill(chunks, key)
        if filled is None:
            return None
        n64, n32, num_tokens, query_start, context_lens = filled
        self.dev64[:n64].copy_(self.host64[:n64], non_blocking=True)
        self.dev32[:n32].copy_(self.host32[:n32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if ids_from is not None:  # one row per sequence (q = 1): rows 0..len(chunks)-1
            self._layout(key)[0]["ids"][: len(chunks)].copy_(ids_from)
        elif ids_at is not None:  # chunk i's first row is i * q
            at, values = ids_at
            ids = self._layout(key)[0]["ids"]
            if key[1] == 1 and at == list(range(len(at))):
                ids[: len(at)].copy_(values)
            else:
                ids.index_copy_(0, self.runner.device_index([i * key[1] for i in at]), values)
        if not self.capture:
            out = self._forward_static(key)
        else:
            if key not in self.graphs:
                self._capture(key)
            graph, out = self.graphs[key]
            graph.replay()
        self.num_replays += 1
        views = self._layout(key)[0]
        meta = AttentionMetadata(views["slots"], query_start, context_lens, [c.seq.block_table for c in chunks],
                                 self.block_size)
        return out[:num_tokens], meta
