"""ModelRunner: turns a scheduled step into tensors, runs the model over the paged cache and
samples. It owns the weights, the KV pool, the encoder cache and the sampler."""
from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from docproc.config import EngineConfig
from docproc.engine.encoder_cache import EncoderCache
from docproc.engine.graph_runner import GraphRunner
from docproc.engine.jit_watch import WATCH
from docproc.engine.kv_cache import KV_DTYPES, KVCache, resolve_kv_dtype
from docproc.engine.prefetch import ImagePrefetcher, default_workers
from docproc.engine.sampler import Sampler, SamplingRow, on_device
from docproc.engine.scheduler import SchedulerOutput
from docproc.engine.sequence import Chunk, Sequence
from docproc.engine.step_inputs import InputStage, write_chunk, write_one_token_rows
from docproc.engine.warmup import warm_fused
from docproc.errors import DeviceUnavailable
from docproc.layers.attention import AttentionMetadata, DenseAttention, FP4Attention
from docproc.models.digests import resolve_folder
from docproc.models.loader import load_model, text_weight_bytes
from docproc.models.processor import Processor
from kernels.options import KernelOptions

log = logging.getLogger("docproc.engine")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
CPU_KV_BYTES_DEFAULT = 512 << 20


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {device!r} was asked for but torch sees no CUDA device: "
                                    f"use --device cpu (or auto), or install a CUDA build of torch")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"device {device!r} was asked for but only {torch.cuda.device_count()} "
                                    f"CUDA device(s) are visible: pick one of cuda:0..cuda:"
                                    f"{torch.cuda.device_count() - 1}")
    return torch.device(device)


def kernel_options(config: EngineConfig) -> KernelOptions:
    """The configuration's kernel choices, as the model and the attention backend take them."""
    return KernelOptions(one_row=config.one_row_kernels, pdl=config.pdl, fp4_gluon=config.fp4_gluon,
                         batch_invariant=config.batch_invariant)


def resolve_step_graphs(config: EngineConfig, device: torch.device) -> str | None:
    """How small steps run: "capture" (CUDA graphs), "static" (the graphs' padded static-buffer
    path run eagerly, with the Triton kernels: tests on CPU under TRITON_INTERPRET) or None."""
    if config.enforce_eager or device.type != "cuda":
        return None
    return "capture"


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are slow on most CPUs
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = DTYPES.get(cfg_dtype)
    return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def inference(fn):
    """torch.inference_mode() around fn, entered only if it is not on already: entering it costs
    ~10 us of host time, and a decode step called three such methods inside each other."""
    wrapped = torch.inference_mode()(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        return wrapped(*args, **kwargs)

    return run


@dataclass
class StepResult:
    tokens: dict[int, int]  # seq_id -> sampled token, for sequences that reached their end
    num_tokens: int
    seconds: float


@dataclass
class PendingStep:
    """A step queued on the device whose sampled tokens the host has not read yet
    (ModelRunner.launch; read with ModelRunner.collect). `tokens` stays on the device, so the
    next step can take its decode rows' input ids from it before the host has seen them."""

    scheduled: list  # Chunk, in row order
    sampled: list[int]  # the chunks that sample a token (their last row's logits), in order
    tokens: torch.Tensor | None  # (len(sampled),) int64 on the device; None until the step samples
    host: torch.Tensor | None  # where the tokens are copied (pinned on CUDA)
    event: "torch.cuda.Event | None"  # recorded after that copy
    t0: float
    captured: bool  # a CUDA graph was captured for it (a one-off cost: not a step time to learn from)
    num_tokens: int  # tokens computed (prefill chunks and decode rows)
    overlapped: bool = False  # launched while the step before it was still in flight
    logits: torch.Tensor | None = None  # (len(sampled), V) until the step samples (sample_pending)

    @property
    def decode_only(self) -> bool:
        """One token per chunk, every chunk sampling: a decode step."""
        return self.num_tokens == len(self.scheduled) == len(self.sampled)


class ModelRunner:
    def __init__(self, config: EngineConfig, allocate: bool = True, tp_rank: int = 0, tp_group=None,
                 tp_sync=None) -> None:
        """Loads the weights; with allocate=False the KV pool waits for allocate_kv() (a
        speculative pair sizes its two pools together). With config.tensor_parallel_size > 1
        this is rank 0 (it starts the other ranks: engine/tensor_parallel.py), or, given
        tp_rank > 0 and the group, one of them (tp_sync: called once its share is loaded, before the
        loader's collectives)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.kernel_options = kernel_options(config)
        from docproc.models.loader import read_config

        hf_config = read_config(config.model)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        tp_size = config.tensor_parallel_size
        self.tp = None  # rank 0's TensorParallelGroup
        # the tokenizer (transformers' import, seconds on some machines) loads on a thread while
        # the weights load, the KV pool is allocated and the kernels warm up
        pool = ThreadPoolExecutor(1, thread_name_prefix="docproc-tokenizer")
        self._processor: Processor | Future = pool.submit(Processor, config.model, hf_config)
        pool.shutdown(wait=False)
        t0 = time.perf_counter()
        if tp_size > 1 and tp_rank == 0:
            from docproc.engine.tensor_parallel import TensorParallelGroup, check_split

            check_split(config, hf_config)  # before any rank starts

            self.tp = TensorParallelGroup(config, self.device, ModelRunner)  # the other ranks load beside this one
            tp_group, tp_sync = self.tp.group, self.tp.wait_loaded
        try:
            self.model = load_model(config.model, self.device, self.dtype, config.quantization, config.load_format,
                                    config.seed, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, tp_sync=tp_sync,
                                    digest_cache=resolve_folder(config.weight_digest_cache))
        except BaseException:
            if self.tp is not None:
                self.tp.abort()  # the ranks may be loading still, or waiting in the loader's collective
            raise
        self.model.text.set_kernel_options(self.kernel_options)
        if tp_size > 1:
            self.model.text.set_tensor_parallel(tp_group)
        if self.tp is not None:
            import hashlib

            from docproc.engine.tensor_parallel import ShardedText

            fps = self.tp.gather_fingerprints(self.model.text_fingerprint)
            self.model.text_fingerprint = hashlib.sha256(f"tp{tp_size}:{'|'.join(fps)}".encode()).hexdigest()[:16]
            self.model.text = ShardedText(self.model.text, self.tp)
        self.load_seconds = time.perf_counter() - t0
        self.weight_bytes = text_weight_bytes(self.model.text)
        self.hf_config = self.model.hf_config
        tc = self.model.text.cfg
        self.text_config = tc
        self.max_input_id: int | None = None  # set by the speculator for a draft with a smaller vocabulary
        self.block_size = config.cache.block_size
        kv_name = resolve_kv_dtype(config.cache.kv_cache_dtype, self.dtype)
        heads = (tc.heads, tc.kv_heads, tc.head_dim, tc.head_dim ** -0.5, self.device)  # this rank's
        if kv_name == "fp4":
            self.backend = FP4Attention(*heads, compute_dtype=self.dtype, kernels=self.kernel_options)
        else:
            self.backend = DenseAttention(*heads, dtype=KV_DTYPES[kv_name], compute_dtype=self.dtype,
                                          kernels=self.kernel_options)
        self.kv_cache = KVCache(self.backend, tc.num_hidden_layers, self.block_size, kv_name)
        if self.tp is not None:  # every rank holds its share of the same blocks
            self.kv_cache.allocate = self._allocate_everywhere
        self.encoder_cache = EncoderCache(config.cache.encoder_cache_entries, config.cache.encoder_cache_bytes)
        self._step_embeds: dict[str, torch.Tensor] = {}  # this step's image embeddings (_image_embeddings)
        self.sampler = Sampler(config.seed, self.device)
        self.logits_hook = None  # tests: called with (list[Sequence], logits) at every sampled row
        self.grammar = None  # engine/structured.py's GrammarCompiler once a request is constrained
        # trunk sharing with a draft (speculative decoding): the target keeps its trunk outputs in
        # trunk_cache; a draft with the same trunk reads them through trunk_source
        self.trunk_cache: EncoderCache | None = None
        self.trunk_source: EncoderCache | None = None
        self.num_shared_trunk_images = 0
        self.warmup_seconds = 0.0
        self.warmup_compiles = 0
        # (tensor parallelism runs eagerly: CUDA graphs with the collectives inside are not built yet)
        self.step_graphs = resolve_step_graphs(config, self.device) if tp_size == 1 else None
        if self.step_graphs == "static":
            self.backend.use_triton = True
        # with graphs, the pool's last block is the scratch block that padded rows write to
        self.num_reserved_blocks = 1 if self.step_graphs else 0
        self.graphs: GraphRunner | None = None
        self.stage = InputStage(self.device)  # an eager step's inputs on their way to the device
        self._token_bufs: list[torch.Tensor] = []  # pinned copies of launched steps' tokens (two in turn)
        self._token_buf_turn = 0
        if allocate:
            self.allocate_kv()
        workers = config.image_prefetch_workers
        self.prefetcher = ImagePrefetcher(self.processor, default_workers(self.device) if workers is None else workers,
                                          pin=self.device.type == "cuda")

    @property
    def processor(self) -> Processor:
        """The checkpoint's tokenizer and image processor (loaded on a thread beside the weights:
        the first use waits for it, and raises its CheckpointError if it could not load)."""
        p = self._processor
        if isinstance(p, Future):
            p = self._processor = p.result()
        return p

    def set_kernel_options(self, opts: KernelOptions) -> None:
        """Other kernel choices for this engine's model and attention backend (comparisons and
        profiles); captured step graphs keep the launches they were captured with, so the caller
        drops them. fp4_gluon and batch_invariant stay as the engine was built (its plans follow them)."""
        for name in ("fp4_gluon", "batch_invariant"):
            if getattr(opts, name) != getattr(self.kernel_options, name):
                raise ValueError(f"{name} is fixed when the engine is built: build another with LLM({name}=...)")
        self.kernel_options = opts
        self.model.text.set_kernel_options(opts)
        self.backend.kernels = opts

    def allocate_kv(self, share: float = 1.0, num_blocks: int | None = None) -> None:
        """Allocate the pool: `num_blocks` usable blocks exactly, or `share` of the memory budget;
        then compile the attention kernels for every launch shape."""
        if num_blocks is not None:
            usable = num_blocks
        else:  # the scratch block comes out of the budget too
            usable = max(1, int(self._num_blocks() * share) - self.num_reserved_blocks)
        self.kv_cache.allocate(usable + self.num_reserved_blocks)
        WATCH.install()
        mark = WATCH.mark()
        self.warmup_seconds = self.backend.warmup(self.kv_cache.layers[0], self.block_size,
                                                  self.text_config.qk_norm) + warm_fused(self)
        self.warmup_compiles = WATCH.mark() - mark  # kernel variants compiled (or loaded from disk)
        if self.step_graphs:
            max_len = (self.config.max_model_len or self.text_config.max_position_embeddings) + 16
            self.graphs = GraphRunner(self, self.config.max_num_seqs, max_len,
                                      capture=self.step_graphs == "capture")

    def _allocate_everywhere(self, num_blocks: int) -> None:
        self.tp.send("allocate", num_blocks)
        KVCache.allocate(self.kv_cache, num_blocks)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one)."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured so far: a step that captured one took far longer than it will
        again, and must not feed the speculation policy's cost lines."""
        return len(self.graphs.graphs) if self.graphs is not None else 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks the block manager may hand out."""
        return self.kv_cache.num_blocks - self.num_reserved_blocks

    # ---- sizing ----------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:  # CPU: enough for max_num_seqs full-length sequences, at most 512 MiB
            max_len = self.config.max_model_len or self.text_config.max_position_embeddings
            budget = min(CPU_KV_BYTES_DEFAULT, self.config.max_num_seqs * max_len * self.kv_cache.bytes_per_token)
        n = self.kv_cache.num_blocks_for_bytes(budget)
        if n < 1:
            raise RuntimeError(
                f"no room for a single KV block ({self.kv_cache.bytes_per_token * self.block_size} bytes): "
                f"raise gpu_memory_utilization or kv_cache_memory_bytes"
            )
        return n

    def _profile_cuda_budget(self) -> int:
        """Run one forward of max_num_batched_tokens tokens to measure peak activation memory, then
        give the KV pool what is left of gpu_memory_utilization of the card."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        blocks = -(-n // self.block_size)
        self.kv_cache.allocate(blocks)
        before = torch.cuda.memory_allocated(self.device)
        seq = Sequence([0] * n)
        seq.block_table = list(range(blocks))
        ids, pos, meta, _, _ = self._prepare([Chunk(seq, 0, n)])
        with torch.inference_mode():
            hidden = self.model.text(ids, pos, self.kv_cache.layers, meta, self.backend)
            self.model.text.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_cache.allocate(0)
        del hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        used = torch.cuda.memory_allocated(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - used - activations
        # the vision cache's bytes come out of it too: encoder_cache_bytes, at most an eighth of
        # the budget (a small budget keeps its KV pool; the cache then holds fewer pages)
        reserve = min(self.config.cache.encoder_cache_bytes, max(0, budget) // 8)
        self.encoder_cache.max_bytes = reserve
        return budget - reserve

    # ---- one step --------------------------------------------------------------------------
    def _image_embeddings(self, seqs: list[Sequence]) -> None:
        """Encode, in one vision call, every image of these sequences that the cache lacks."""
        fp = self.model.vision_fingerprint
        todo: dict[str, tuple[Sequence, object]] = {}
        # the step's embeddings, held for _prepare: a step with more images than the cache keeps
        # would otherwise find its first ones evicted by its last
        step = self._step_embeds = {}
        for seq in seqs:
            for span, img in zip(seq.images, seq.mm_inputs):
                key = (fp, span.content_hash)
                hit = key in self.encoder_cache or span.content_hash in todo
                if not seq.images_counted:  # (each chunk of a long prompt looks again: counted once)
                    self.encoder_cache.count(hit)
                if key in self.encoder_cache:
                    step[span.content_hash] = self.encoder_cache.get(key)
                elif not hit:
                    todo[span.content_hash] = (seq, img)
            seq.images_counted = True
        if not todo:
            return
        trunk_fp = self.model.vision_trunk_fingerprint
        if self.trunk_source is not None:
            # a draft whose trunk equals the target's: apply our merger to the target's trunk output
            for h in list(todo):
                trunk = self.trunk_source.get((trunk_fp, h))
                if trunk is not None:
                    step[h] = self.model.vision.merge(trunk.to(self.device))
                    self.encoder_cache.put((fp, h), step[h])
                    self.num_shared_trunk_images += 1
                    del todo[h]
            if not todo:
                return
        plist, grids = self.prefetcher.take([(h, img.image) for h, (_, img) in todo.items()])
        if self.kernel_options.batch_invariant:
            # each page in a call of its own: a page's embeddings are the same bits whatever pages
            # a step encodes beside it (the tower's products and attention then see one page's rows)
            embeds, trunks = [], []
            for i, p in enumerate(plist):
                e, t = self.model.vision.encode(p.to(self.device, non_blocking=True), grids[i: i + 1])
                embeds += e
                trunks = None if t is None or trunks is None else trunks + t
        else:
            pixels = torch.cat([p.to(self.device, non_blocking=True) for p in plist]) if len(plist) > 1 else \
                plist[0].to(self.device, non_blocking=True)
            embeds, trunks = self.model.vision.encode(pixels, grids)  # the grid stays on the host
        for i, ((h, (seq, _)), e) in enumerate(zip(todo.items(), embeds)):
            step[h] = e
            self.encoder_cache.put((fp, h), e)
            if self.trunk_cache is not None and trunks is not None:
                self.trunk_cache.put((trunk_fp, h), trunks[i])
            seq.num_encoded_images += 1

    def prefetch_images(self, seqs) -> None:
        """Start preprocessing the images of these sequences (in the order given) that the vision
        cache lacks, on the prefetcher's threads. A sequence is looked at until all of its images
        were started or cached."""
        fp = self.model.vision_fingerprint
        prefetcher = self.prefetcher
        for seq in seqs:
            if seq.images_prefetched:
                continue
            done = True
            for span, img in zip(seq.images, seq.mm_inputs):
                h = span.content_hash
                if (fp, h) in self.encoder_cache or prefetcher.pending(h):
                    continue
                prefetcher.prefetch([(h, img.image)])
                done = done and prefetcher.pending(h)
            seq.images_prefetched = done

    def pixels_ready(self, seq) -> bool:
        """Whether a step could encode every image of the sequence now without waiting for its
        preprocessing under way: each is in the vision cache, prepared on the prefetcher, or not
        started there (the prefetcher is full: the step prepares it inline, as it would later)."""
        fp = self.model.vision_fingerprint
        pf = self.prefetcher
        return all((fp, span.content_hash) in self.encoder_cache or not pf.pending(span.content_hash)
                   or pf.ready(span.content_hash) for span in seq.images)

    def _prepare(self, scheduled):
        bs = self.block_size
        n = sum(s.end - s.start for s in scheduled)
        query_start = [0]
        pieces = []  # (first row, first image token, last, span) of each image slice the chunks hold
        for s in scheduled:
            for span in s.seq.images:
                lo, hi = max(s.start, span.offset), min(s.end, span.end)
                if lo < hi:
                    pieces.append((query_start[-1] + lo - s.start, lo - span.offset, hi - span.offset, span))
            query_start.append(query_start[-1] + s.end - s.start)
        num_image_rows = sum(hi - lo for _, lo, hi, _ in pieces)
        flat = self.stage.array(5 * n + num_image_rows)
        ids, pos, slots, image_rows = flat[:n], flat[n: 4 * n].reshape(3, n), flat[4 * n: 5 * n], flat[5 * n:]
        clamp = self.max_input_id  # a draft whose embedding has fewer rows than the target's
        ends = write_one_token_rows(scheduled, ids, pos, slots, bs, clamp) if n == len(scheduled) else None
        for s, row0 in zip(scheduled if ends is None else (), query_start):  # else every row is written
            write_chunk(s, row0, ids, pos, slots, bs, clamp)
        fp = self.model.vision_fingerprint
        image_embeds = []
        r = 0
        for row, lo, hi, span in pieces:
            embed = self._step_embeds.get(span.content_hash)
            image_embeds.append((embed if embed is not None else self.encoder_cache.get((fp, span.content_hash)))[lo:hi])
            image_rows[r: r + hi - lo] = np.arange(row, row + hi - lo)
            r += hi - lo
        d = self.stage.to_device(flat)
        meta = AttentionMetadata(
            slot_mapping=d[4 * n: 5 * n], query_start=query_start,
            context_lens=[s.end for s in scheduled], block_tables=[s.seq.block_table for s in scheduled],
            block_size=bs,
        )
        self.backend.prepare(meta)
        rows = d[5 * n:] if pieces else None
        embeds = torch.cat(image_embeds) if image_embeds else None
        return d[:n], d[n: 4 * n].view(3, n), meta, rows, embeds

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        """The sequence's sampling row, made once (its parameters and seeded generator never
        change; the generator's state advances inside the object): a decode step asks for every
        sequence's row."""
        row = getattr(seq, "_sampling_row", None)
        if row is not None:
            return row
        sp = seq.sampling
        if sp.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(sp.seed)
        row = seq._sampling_row = SamplingRow(sp.temperature, sp.top_k, sp.top_p, seq.generator)
        return row

    @inference
    def forward(self, scheduled, ids_from: torch.Tensor | None = None,
                ids_at: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """Run the model over scheduled chunks (objects with .seq, .start, .end): stores their K/V
        and returns the final hidden states (num_tokens, hidden) and the step's metadata.
        ids_from: a device tensor of one input token per chunk (the host's ids are placeholders);
        only the static graph path runs such a step: None when it cannot. ids_at: (chunk indices,
        a device tensor of one token each): the first input token of those chunks, copied on the
        device over the host's placeholder (an overlapped step's decode rows); any path runs it."""
        if ids_from is not None:
            return None if self.graphs is None else self.graphs.run(scheduled, ids_from)
        self._image_embeddings([s.seq for s in scheduled if any(
            max(s.start, sp.offset) < min(s.end, sp.end) for sp in s.seq.images)])
        if self.graphs is not None:
            done = self.graphs.run(scheduled, ids_at=ids_at)
            if done is not None:
                return done
        ids, pos, meta, rows, embeds = self._prepare(scheduled)
        if ids_at is not None:
            chunks, values = ids_at
            ids.index_copy_(0, self.device_index([meta.query_start[i] for i in chunks]), values)
        hidden = self.model.text(ids, pos, self.kv_cache.layers, meta, self.backend, rows, embeds)
        return hidden, meta

    def device_index(self, rows: list[int]) -> torch.Tensor:
        """rows as an int64 index on the device, copied from pinned memory without waiting for the
        work queued before it (a copy from pageable memory would make the host wait for it)."""
        return on_device(rows, torch.long, self.device)

    @inference
    def logits(self, hidden: torch.Tensor, rows: list[int] | range) -> torch.Tensor:
        n = len(rows)
        if isinstance(rows, range) and rows.step == 1:  # a decode step's rows: no check needed
            return self.model.text.compute_logits(hidden[rows.start: rows.start + n])
        if n and rows[-1] - rows[0] == n - 1 and all(b == a + 1 for a, b in zip(rows, rows[1:])):
            # a run of rows (every decode step; a verify step of one sequence): a view, with no
            # index tensor to copy from pageable host memory, which would make the host wait for
            # the forward before it can queue the LM head and the sampler
            return self.model.text.compute_logits(hidden[rows[0]: rows[0] + n])
        return self.model.text.compute_logits(hidden.index_select(0, self.device_index(list(rows))))

    @inference
    def launch(self, scheduled, ids_at: tuple[list[int], torch.Tensor] | None = None, matchers: list | None = None,
               sample: bool = True) -> PendingStep:
        """Queue a step (prefill chunks and decode rows; each chunk that reaches its sequence's end
        samples) and its sampling, and start copying the sampled tokens to the host, without
        waiting for any of it. ids_at: decode rows whose input id is on the device (forward).
        matchers: each sampled row's grammar matcher (or None), its mask applied before the row
        samples. sample=False queues the forward and the logits only: sample_pending() queues the
        sampling later, once the rows' matchers have accepted the tokens before it."""
        t0 = time.perf_counter()
        captures = self.num_graph_captures
        hidden, meta = self.forward(scheduled, ids_at=ids_at)
        sampled = [i for i, c in enumerate(scheduled) if c.needs_sample]
        n = meta.num_tokens
        if n == len(scheduled) == len(sampled):
            rows = range(n)
        else:
            rows = [meta.query_start[i + 1] - 1 for i in sampled]
        step = PendingStep(list(scheduled), sampled, None, None, None, t0, self.num_graph_captures != captures, n,
                           logits=self.logits(hidden, rows) if sampled else None)
        if sample:
            self.sample_pending(step, matchers)
        return step

    @inference
    def gather_rows(self, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """tokens[rows] on the device, its index copied from pinned memory: the host does not wait
        for the work queued before it (the step that samples `tokens`)."""
        return tokens.index_select(0, self.device_index(rows))

    @inference
    def sample_pending(self, step: PendingStep, matchers: list | None = None) -> None:
        """Queue a launched step's sampling (its rows' masks first, from matchers: one per row, or
        None) and the copy of its tokens to the host."""
        logits, step.logits = step.logits, None
        if logits is None:  # no chunk samples (prefill chunks part-way)
            tokens = torch.empty(0, dtype=torch.long, device=self.device)
        else:
            if matchers is not None and self.grammar is not None:
                self.grammar.mask_rows(logits, matchers)
            tokens = self.sampler(logits, [self.sampling_row(step.scheduled[i].seq) for i in step.sampled])
        n = len(step.sampled)
        event = None
        if self.device.type == "cuda":
            if not self._token_bufs:
                self._token_bufs = [torch.empty(self.config.max_num_seqs, dtype=torch.long, pin_memory=True)
                                    for _ in range(2)]
            # two buffers in turn: a step is read while the next one (launched first) copies into the other
            host = self._token_bufs[self._token_buf_turn][:n]
            self._token_buf_turn ^= 1
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tokens
        step.tokens, step.host, step.event = tokens, host, event

    def collect(self, step: PendingStep) -> list[int]:
        """The launched step's sampled tokens: waits for that step only (work queued after it keeps running)."""
        if step.event is not None:
            step.event.synchronize()
        return step.host.tolist()

    @inference
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        scheduled = out.scheduled
        hidden, meta = self.forward(scheduled)
        if len(out.decoding) == len(scheduled):  # a decode step: every row samples, rows 0..n-1
            sample = [(i, s.seq) for i, s in enumerate(scheduled)]
            logits = self.logits(hidden, range(len(sample))) if sample else None
        else:
            sample = [(i, s.seq) for i, s in enumerate(scheduled) if s.needs_sample]
            logits = self.logits(hidden, [meta.query_start[i + 1] - 1 for i, _ in sample]) if sample else None
        tokens: dict[int, int] = {}
        if sample:  # logits (n, vocab) fp32
            if self.logits_hook is not None:
                self.logits_hook([seq for _, seq in sample], logits)
            if self.grammar is not None:
                self.grammar.mask_rows(logits, [seq.grammar for _, seq in sample])
            sampled = self.sampler(logits, [self.sampling_row(seq) for _, seq in sample]).tolist()
            tokens = {seq.seq_id: t for (_, seq), t in zip(sample, sampled)}
        return StepResult(tokens, meta.num_tokens, time.perf_counter() - t0)
