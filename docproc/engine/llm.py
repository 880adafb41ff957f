"""LLM: the offline engine API (vLLM-shaped). Requests in, RequestOutputs out, in input order."""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, Sequence as Seq

import torch

import kernels.gemv as kernels_gemv
import kernels.pdl as kernels_pdl
from docproc.config import CacheConfig, EngineConfig
from docproc.engine.block_manager import BlockManager
from docproc.engine.model_runner import ModelRunner
from docproc.engine.scheduler import Scheduler
from docproc.engine.encoder_cache import EncoderCache
from docproc.engine.jit_watch import WATCH
from docproc.engine.sampler import probabilities
from docproc.engine.sequence import Sequence
from docproc.engine.speculative import accept_greedy, accept_sampled
from docproc.engine.progress import Progress
from docproc.engine.speculator import Chunk, Speculator, check_tokenizers, parse_spec_k
from docproc.errors import DeviceUnavailable
from docproc.models.processor import PromptError
from docproc.outputs import CompletionOutput, RequestMetrics, RequestOutput
from docproc.sampling_params import SamplingParams

PREFETCH_LOOKAHEAD = 16  # queued sequences whose pages are preprocessed ahead (engine/prefetch.py)

PromptType = str | dict[str, Any]


def eos_token_ids(folder: str | Path, hf_config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else the model config, else the tokenizer."""
    ids: Any = None
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        tc = getattr(hf_config, "text_config", None)
        ids = getattr(hf_config, "eos_token_id", None) or getattr(tc, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}


def is_device_failure(e: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (not an out-of-memory, which a smaller step
    survives)."""
    if isinstance(e, torch.OutOfMemoryError) or not isinstance(e, RuntimeError):
        return False
    return type(e).__name__ == "AcceleratorError" or "CUDA error" in str(e)


class LLM:
    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        encoder_cache_entries: int = 256,
        speculative_model: str | None = None,
        num_speculative_tokens: int | str = 4,
        draft_vision: str = "auto",
        enforce_eager: bool = False,
        image_prefetch_workers: int | None = None,
        fp4_value_slots: int | None = None,
        overlap_decode: bool = True,
        one_row_kernels: bool = True,
        pdl: bool = True,
        fp4_gluon: bool = True,
    ) -> None:
        cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                            enable_prefix_caching=enable_prefix_caching,
                            gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, num_kv_blocks=num_kv_blocks,
                            encoder_cache_entries=encoder_cache_entries, fp4_value_slots=fp4_value_slots)
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, seed=seed, cache=cache,
                                   enforce_eager=enforce_eager, image_prefetch_workers=image_prefetch_workers,
                                   one_row_kernels=one_row_kernels, pdl=pdl, fp4_gluon=fp4_gluon)
        self.speculator = None
        draft_runner = None
        if speculative_model is not None:
            k_max, adaptive = parse_spec_k(num_speculative_tokens)
            if draft_vision not in ("auto", "own", "none"):
                raise ValueError(f"draft_vision must be auto, own or none, got {draft_vision!r}")
            check_tokenizers(model, speculative_model)  # before any weights load
            draft_cfg = EngineConfig(model=str(speculative_model), device=device, dtype=dtype,
                                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, seed=seed + 1, enforce_eager=enforce_eager,
                                     one_row_kernels=one_row_kernels, pdl=pdl, fp4_gluon=fp4_gluon,
                                     cache=CacheConfig(
                                         kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                                         enable_prefix_caching=enable_prefix_caching,
                                         gpu_memory_utilization=gpu_memory_utilization,
                                         kv_cache_memory_bytes=kv_cache_memory_bytes,
                                         encoder_cache_entries=encoder_cache_entries,
                                         fp4_value_slots=fp4_value_slots))
            draft_runner = ModelRunner(draft_cfg, allocate=False)
        self.runner = ModelRunner(self.config, allocate=draft_runner is None)
        if draft_runner is not None:
            # both pools hold the same number of tokens: the budget is split by bytes per token
            t_bpt, d_bpt = self.runner.kv_cache.bytes_per_token, draft_runner.kv_cache.bytes_per_token
            self.runner.allocate_kv(share=t_bpt / (t_bpt + d_bpt))
            draft_runner.allocate_kv(num_blocks=self.runner.num_usable_blocks)
            if draft_vision != "none":
                t_ip, d_ip = self.runner.processor.image_processor, draft_runner.processor.image_processor
                if (t_ip.size, t_ip.patch_size, t_ip.merge_size) != (d_ip.size, d_ip.patch_size, d_ip.merge_size):
                    raise ValueError(
                        f"draft image processor differs from target ({dict(d_ip.size)} vs {dict(t_ip.size)}): the "
                        f"draft must see the same image tokens; use draft_vision='none' or a matching draft")
            self.speculator = Speculator(draft_runner, k_max, adaptive, draft_vision,
                                         self.runner.hf_config.image_token_id, enable_prefix_caching,
                                         target_vocab=self.runner.text_config.vocab_size)
            t_model, d_model = self.runner.model, draft_runner.model
            if (draft_vision == "auto" and t_model.vision_trunk_fingerprint == d_model.vision_trunk_fingerprint
                    and t_model.vision.shares_trunk and d_model.vision.shares_trunk):
                # the page goes through the trunk once; each model applies its own merger
                self.runner.trunk_cache = EncoderCache(encoder_cache_entries)
                draft_runner.trunk_source = self.runner.trunk_cache
        self.processor = self.runner.processor
        self.tokenizer = self.processor.tokenizer
        limit = self.runner.text_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_model_len = max_model_len or limit
        self.block_manager = BlockManager(self.runner.num_usable_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   lookahead=self.speculator.k_max if self.speculator else 0)
        self.eos_token_ids = eos_token_ids(model, self.runner.hf_config, self.tokenizer)
        self.num_steps = 0
        self.num_step_tokens = 0
        self._compile_mark = WATCH.mark()  # every runner has warmed up by now
        self.step_seconds = 0.0
        self.num_decode_steps = 0  # plain steps that only decoded (the memory-bound part of a run)
        self.num_decode_step_tokens = 0
        self.decode_step_seconds = 0.0
        # overlapped decode (see _overlap_step): the next decode step is queued on the device before
        # the host reads the tokens of the one in flight, so the host's per-token work (reading the
        # tokens, stop checks, scheduling, filling the next step's inputs) runs while the device
        # computes instead of between steps
        self.overlap_decode = overlap_decode
        self._pending = None  # the launched decode step whose tokens the host has not read
        self._pending_since = 0.0  # when the host last had nothing in flight to wait for
        self.num_overlapped_steps = 0  # decode steps launched before the previous step's tokens were read
        self._next_k = None  # the speculation policy's choice for the next step, made by _continue

    # ---- public ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one or one each")

        results: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[int, int] = {}
        images: dict = {}  # one conversion and content hash per image object in this call
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                seq = self._make_sequence(prompt, sp, str(i), images)
            except PromptError as e:
                results[i] = self._error_output(str(i), prompt, [], str(e))
                continue
            index[seq.seq_id] = i
            self.scheduler.add(seq)

        progress = Progress(len(index)) if use_tqdm else None
        try:
            while self.scheduler.has_unfinished:
                for seq in self.step():
                    i = index.pop(seq.seq_id, None)
                    if i is None:
                        continue
                    results[i] = self._output(seq, prompts[i])
                    if progress:
                        progress.advance(seq.num_generated_tokens)
        except BaseException as e:
            self._abort_unfinished()  # the engine stays usable for the caller's next call
            if is_device_failure(e):
                raise DeviceUnavailable(f"the device failed ({type(e).__name__}: {e}); the CUDA context cannot "
                                        f"be used again: check the GPU (nvidia-smi) and run again") from e
            raise
        finally:
            if progress:
                progress.close()
            if not self.scheduler.has_unfinished:
                self.runner.prefetcher.drop()  # pixels of requests that failed before their encode
        return results  # type: ignore[return-value]

    def model_fingerprint(self) -> dict:
        """The target's weights as two short hashes: its language model and its vision tower."""
        m = self.runner.model
        return {"text": m.text_fingerprint, "vision": m.vision_fingerprint}

    def count_image_tokens(self, image) -> int:
        """The tokens an image (a PIL image) takes in a prompt, as the engine will expand it."""
        return self.processor.num_tokens(self.processor.grid_thw(image))

    def _abort_unfinished(self) -> None:
        """Drop every queued and running sequence (a step raised): their blocks go back to the pool
        and out of the prefix cache (BlockManager.discard), a launched overlapped step is
        forgotten."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if self.speculator is not None:
                self.speculator.release(seq, failed=True)
            if seq.block_table:
                self.block_manager.discard(seq)  # before finish: its hashes may name unwritten K/V
            self.scheduler.finish(seq, "abort")
        self._pending = None
        self._next_k = None

    def cache_info(self) -> dict:
        kv = self.runner.kv_cache
        bm = self.block_manager
        enc = self.runner.encoder_cache.stats
        g = self.runner.graphs
        return {
            "kv_cache_dtype": kv.dtype_name,
            "fp4_value_slots": getattr(self.runner.backend, "num_value_outliers", None),
            # what runs decode attention: "gluon" (kernels/fp4_gluon.py: FP4 on CUDA where it can),
            # "triton" (kernels/paged_attention.py) or "torch" (the reference, on CPU)
            "decode_attention": ("gluon" if getattr(self.runner.backend, "fp4_gluon", False) else "triton")
                                if self.runner.backend.use_triton else "torch",
            "block_size": kv.block_size,
            "num_blocks": self.runner.num_usable_blocks,
            "num_reserved_blocks": self.runner.num_reserved_blocks,
            "bytes_per_token": kv.bytes_per_token,
            "bytes_per_token_bf16": 2 * self.runner.text_config.num_hidden_layers * 2
                                    * self.runner.text_config.num_key_value_heads * self.runner.text_config.head_dim,
            "kernel_warmup_seconds": round(self.runner.warmup_seconds, 3),
            "kernel_warmup_compiles": self.runner.warmup_compiles
                                      + (self.speculator.runner.warmup_compiles if self.speculator else 0),
            # Triton kernel variants compiled (or loaded from Triton's disk cache) since the engine
            # started: each was paid inside some step; 0 where warm-up covered every launch (and on CPU)
            "kernel_compiles_after_warmup": len(late := WATCH.since(self._compile_mark)),
            "kernel_compile_seconds_after_warmup": round(sum(r.seconds for r in late), 3),
            "kernels_compiled_after_warmup": sorted({r.kernel for r in late}),
            "allocated_bytes": kv.allocated_bytes,
            "num_free_blocks": bm.num_free_blocks,
            "prefix_cache_query_tokens": bm.stats.num_query_tokens,
            "prefix_cache_hit_tokens": bm.stats.num_hit_tokens,
            "prefix_cache_evicted_blocks": bm.stats.num_evicted_blocks,
            "encoder_cache_lookups": enc.num_lookups,
            "encoder_cache_hits": enc.num_hits,
            "num_encoded_images": enc.num_encoded_images,
            "num_preemptions": self.scheduler.num_preemptions,
            "max_model_len": self.max_model_len,
            "step_graphs": self.runner.step_graphs,  # "capture" (CUDA graphs), "static" (tests) or None
            "num_cuda_graphs": len(g.graphs) if g else 0,
            "cuda_graph_capture_seconds": round(g.capture_seconds, 3) if g else 0.0,
            "num_graph_steps": g.num_replays if g else 0,
            # decode steps launched before the tokens of the step in flight were read (overlap_decode)
            "overlap_decode": self.overlap_decode,
            "num_overlapped_steps": self.num_overlapped_steps,
            "one_row_kernels": kernels_gemv.ENABLED and self.runner.device.type == "cuda",  # kernels/gemv.py
            "pdl": kernels_pdl.enabled_on(self.runner.device),  # programmatic dependent launch, kernels/pdl.py
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
        }

    def spec_info(self) -> dict | None:
        """Speculative decoding figures so far (None without a draft)."""
        if self.speculator is None:
            return None
        sp = self.speculator
        return {**sp.stats.as_dict(), "k_max": sp.k_max, "adaptive": not sp.policy.fixed,
                "cost_ratio": round(sp.policy.cost_ratio, 4), "overlap_ratio": round(sp.policy.overlap_ratio, 4),
                "draft_vision": sp.vision,
                "catch_up_skips": sp.num_catch_up_skips, "policy": sp.policy.state(),
                "draft_chained_rounds": sp.num_chained_rounds,
                "shared_vision_trunk": sp.runner.trunk_source is not None,
                "draft_images_from_shared_trunk": sp.runner.num_shared_trunk_images,
                "draft_images_encoded": sp.runner.encoder_cache.stats.num_encoded_images
                                        - sp.runner.num_shared_trunk_images,
                "draft_model": sp.runner.config.model,
                "draft_fingerprint": {"text": sp.runner.model.text_fingerprint,
                                      "vision": sp.runner.model.vision_fingerprint}}

    # ---- internals -------------------------------------------------------------------------
    def _make_sequence(self, prompt: PromptType, sp: SamplingParams, request_id: str,
                       images_memo: dict | None = None) -> Sequence:
        if isinstance(prompt, str):
            text, token_ids, images, uuids = prompt, None, [], None
        elif isinstance(prompt, dict):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            images = (prompt.get("multi_modal_data") or {}).get("image", [])
            if not isinstance(images, (list, tuple)):
                images = [images]
            uuids = (prompt.get("multi_modal_uuids") or {}).get("image")
        else:
            raise PromptError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        ids, spans, loaded = self.processor.process(text, token_ids, list(images), uuids, images_memo)
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"prompt is {len(ids)} tokens (images expanded) but max_model_len is {self.max_model_len}: "
                f"shorten it, lower the image max_pixels, or raise max_model_len"
            )
        seq = Sequence(ids, spans, max_tokens=min(sp.max_tokens, self.max_model_len - len(ids)),
                       request_id=request_id, arrival_time=time.perf_counter())
        seq.mm_inputs = loaded
        seq.sampling = sp
        return seq

    def step(self) -> list[Sequence]:
        """Run one scheduled step; return the sequences that finished in it."""
        if self._pending is not None:
            return self._overlap_step()
        out = self.scheduler.schedule()
        finished: list[Sequence] = []
        if self.runner.prefetcher.workers and (self.scheduler.waiting or len(out.decoding) < len(out.scheduled)):
            # preprocess the pages this step encodes in parallel, and the next queued ones meanwhile
            self.runner.prefetch_images(itertools.chain(
                (s.seq for s in out.scheduled if s.seq.images and not s.seq.images_prefetched),
                itertools.islice(self.scheduler.waiting, PREFETCH_LOOKAHEAD)))
        for seq, why in out.failed:
            seq.stop_reason = why
            self.scheduler.finish(seq, "error")
            finished.append(seq)
        if self.speculator is not None:
            for seq in out.preempted:
                self.speculator.release(seq)
        if out.is_empty:
            if self.scheduler.has_unfinished and not self.scheduler.running and not out.failed:
                raise RuntimeError("scheduler made no progress with nothing running: the KV pool is too small")
            return finished
        spec = self.speculator
        if spec is not None:
            dec_seqs = out.decoding
            decoding = [seq.seq_id for seq in dec_seqs]
            spec.policy.batch = max(1, len(decoding))
            # one K for the step (its draft forwards are shared); chosen already if an overlapped
            # step asked the policy before it could know this step would not be bypassed
            k_step = self._next_k if self._next_k is not None else spec.policy.choose_step(decoding)
            self._next_k = None
            if k_step > 0:
                if not spec.policy.probing:
                    return finished + self._spec_step(out, decoding, k_step)
                # a probe's cost sets how often probes may come; not timed when it captured a CUDA
                # graph or ran a draft forward of a new kind (one-off costs)
                before = (self.runner.num_graph_captures, spec.runner.num_graph_captures, len(spec._timed_kinds))
                t0 = time.perf_counter()
                done = self._spec_step(out, decoding, k_step)
                if before == (self.runner.num_graph_captures, spec.runner.num_graph_captures,
                              len(spec._timed_kinds)):
                    spec.policy.observe_probe(time.perf_counter() - t0)
                return finished + done
            # bypassed: the plain step itself, with as little speculation bookkeeping on the host as
            # can be (a small model's decode step is ~0.3 ms of host time on a GPU)
            spec.stats.bypassed_steps += len(decoding)
            for seq in dec_seqs:
                seq.spec_stats.bypassed_steps += 1
            captures = self.runner.num_graph_captures
        if self._can_overlap(out):  # a plain decode step (or one the policy bypassed the draft for)
            self._pending = self.runner.launch(out.scheduled)
            if self._pending is not None:
                self._pending_since = self._pending.t0
                return finished + self._overlap_step()
        ends = [(s.seq, s.end) for s in out.scheduled]
        result = self.runner.execute(out)
        if spec is not None and self.runner.num_graph_captures == captures:
            # decode/verify steps only feed the target's line (prefill chunks would skew it), and
            # none that captured a graph
            spec.policy.observe_any_step(result.num_tokens, result.seconds)
            if len(decoding) == len(out.scheduled):
                spec.policy.observe_step(result.num_tokens, result.seconds)
        # (a pure decode step: no prefill chunk in it)
        self._count_step(result.num_tokens, result.seconds, len(out.decoding) == len(out.scheduled))
        now = time.perf_counter()
        for seq, end in ends:
            seq.num_computed_tokens = end
            token = result.tokens.get(seq.seq_id)
            if token is None:
                continue
            if self._append(seq, token, now):
                finished.append(seq)
        return finished

    # ---- overlapped decode --------------------------------------------------------------------
    PLACEHOLDER = 0  # a launched step's token in token_ids until the host reads it (never an input: the
    #                  device feeds the real one)

    def _can_overlap(self, out) -> bool:
        """Whether a step may be launched without waiting for its tokens: a pure decode step of the
        whole running set (no prefill under way, no admission waiting for a free place), with
        static step graphs (the next step's input ids come from the device) and no logits hook, and
        every row greedy or seeded (an unseeded row would draw from the engine's generator in a
        batch that can hold a finished row, so its samples would differ from the plain loop's)."""
        if not self.overlap_decode or self.runner.graphs is None or self.runner.logits_hook is not None:
            return False
        sched = self.scheduler
        if len(out.decoding) != len(out.scheduled) or len(out.scheduled) != len(sched.running) or out.failed \
                or out.preempted:
            return False
        if sched.waiting and len(sched.running) < sched.max_num_seqs:
            return False
        return all(s.seq.sampling.temperature == 0 or s.seq.sampling.seed is not None for s in out.scheduled)

    def _continue(self, prev):
        """Launch the decode step after `prev` (in flight, tokens unread) for the same sequences,
        its input ids taken from prev's tokens on the device. Each sequence gets a placeholder for
        prev's token, replaced when it is read. None (nothing changed) when the next step could be
        different: a sequence that finishes for sure (max_tokens, max_model_len), a sequence that
        would be admitted or resumed, a pool without the blocks, or a batch without a graph."""
        sched = self.scheduler
        seqs = [sc.seq for sc in prev.scheduled]
        if len(seqs) != len(sched.running) or (sched.waiting and len(sched.running) < sched.max_num_seqs):
            return None
        for seq in seqs:
            if seq.is_finished or seq.num_generated_tokens + 1 >= seq.max_tokens or len(seq) + 1 >= self.max_model_len:
                return None
        spec = self.speculator
        if spec is not None:  # only a step the policy bypasses the draft for overlaps
            spec.policy.batch = len(seqs)
            k = spec.policy.choose_step([seq.seq_id for seq in seqs])
            if k > 0:
                self._next_k = k  # the choice stands (a probe's countdown restarted with it)
                return None
        out = sched.schedule_continuation(seqs, self.PLACEHOLDER)
        if out is None:
            return None
        nxt = self.runner.launch(out.scheduled, ids_from=prev.tokens)
        if nxt is None:
            sched.undo_continuation(seqs)
            return None
        nxt.overlapped = True
        if spec is not None:
            spec.stats.bypassed_steps += len(seqs)
            for seq in seqs:
                seq.spec_stats.bypassed_steps += 1
        self.num_overlapped_steps += 1
        return nxt

    def _overlap_step(self) -> list[Sequence]:
        """Read the tokens of the launched step, having first launched the one after it where it can
        (so the device never waits for the host between them), and append them. A row whose
        sequence stopped at the previous step's token is dropped (its token was computed for
        nothing: the one step of waste per stop that overlapping costs)."""
        prev = self._pending
        self._pending = None
        nxt = self._continue(prev)
        tokens = self.runner.collect(prev)
        now = time.perf_counter()
        seconds = now - max(prev.t0, self._pending_since)
        self._pending_since = now
        finished: list[Sequence] = []
        rows = 0
        for (seq, end), token in zip(prev.ends, tokens):
            if seq.is_finished:
                continue
            rows += 1
            if nxt is not None:  # the sequence already holds a placeholder for this token
                seq.token_ids.pop()
            else:
                seq.num_computed_tokens = end
            if self._append(seq, token, now):
                finished.append(seq)
        self._count_step(rows, seconds, True)
        spec = self.speculator
        if spec is not None and not prev.captured:  # a bypassed step
            if prev.overlapped:  # its host work hidden: how much cheaper plain decoding is
                spec.policy.observe_overlapped_step(len(tokens), seconds)
            else:  # a point of the target's cost line
                spec.policy.observe_any_step(len(tokens), seconds)
                spec.policy.observe_step(len(tokens), seconds)
        if nxt is not None and not all(sc.seq.is_finished for sc in nxt.scheduled):
            self._pending = nxt  # read by the next step() (nothing else can run before it)
        return finished

    def _count_step(self, tokens: int, seconds: float, decode: bool) -> None:
        self.num_steps += 1
        self.num_step_tokens += tokens
        self.step_seconds += seconds
        if decode:
            self.num_decode_steps += 1
            self.num_decode_step_tokens += tokens
            self.decode_step_seconds += seconds

    def _append(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a generated token; finish the sequence if it stops there. True if it finished."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.append_token(token)
        reason = self._stop_reason(seq, token)
        if reason is None:
            return False
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.release(seq)
            self.speculator.policy.observe_finished(seq.num_generated_tokens)
        seq.finish_time = now
        return True

    def _spec_step(self, out, decoding: list[int], k_step: int) -> list[Sequence]:
        """One step with speculation (k_step > 0): the draft proposes up to k_step tokens for each
        decoding sequence, the target scores every sequence's window (its last token plus the
        proposals) and the prefill chunks in one forward, and acceptance keeps the target's
        distribution."""
        spec, runner = self.speculator, self.runner
        work = []
        catch_up: dict[int, tuple[int, tuple | None]] = {}
        pages: dict[tuple, int] = {}  # sequences this step whose draft would prefill the same page
        explore = None  # while the catch-up cost is unmeasured: the one page this step may prefill
        probe_only = None  # a probe drafts for one sequence: the one with least to catch up
        if k_step > 0 and not spec.policy.fixed:
            for s in out.scheduled:
                if s.num_new_tokens == 1 and s.needs_sample:
                    catch_up[s.seq.seq_id] = spec.catch_up(s.seq)
                    page = catch_up[s.seq.seq_id][1]
                    if page is not None:
                        pages[page] = pages.get(page, 0) + 1
            if spec.policy.probing and catch_up:
                probe_only = min(catch_up, key=lambda sid: catch_up[sid][0])
        for s in out.scheduled:
            seq = s.seq
            if s.num_new_tokens == 1 and s.needs_sample:  # decoding
                k = min(k_step, seq.max_tokens - seq.num_generated_tokens - 1,
                        self.max_model_len - len(seq) - 1, self.scheduler.lookahead)
                # the window needs target slots; a prompt's last token (not a decode step) may lack them
                if k > 0 and not self.block_manager.can_append(seq, len(seq) + k):
                    k = 0
                if probe_only is not None and seq.seq_id != probe_only:
                    k = 0
                if k > 0 and seq.seq_id in catch_up:
                    tokens, page = catch_up[seq.seq_id]
                    share = spec.page_share(page, pages[page]) if page is not None else 1
                    sp = seq.sampling
                    exact = sp.ignore_eos and not sp.stop and not getattr(sp, "stop_token_ids", None)
                    worth = spec.policy.worth_catching_up(seq.seq_id, k, tokens, share, seq.num_generated_tokens,
                                                          left=seq.max_tokens - seq.num_generated_tokens,
                                                          exact=exact)
                    if worth is None:  # unmeasured: one page (its queries together) to measure it
                        explore = explore or page or (seq.seq_id,)
                        worth = explore in (page, (seq.seq_id,))
                    if not worth:
                        k = 0
                        spec.num_catch_up_skips += 1
                if k > 0:
                    self.block_manager.append_slots(seq, len(seq) + k)
                    work.append((seq, k))
                else:
                    spec.stats.bypassed_steps += 1
                    seq.spec_stats.bypassed_steps += 1
        t_draft = spec.draft_seconds
        proposals = spec.propose(work)
        t_draft = spec.draft_seconds - t_draft
        chunks, meta_rows = [], []
        for s in out.scheduled:
            prop = proposals.get(s.seq.seq_id)
            start = s.seq.num_computed_tokens
            if prop is not None and prop.tokens:
                s.seq.token_ids.extend(prop.tokens)  # scored this step, removed again below
            end = len(s.seq) if prop is not None and prop.tokens else s.end
            chunks.append(Chunk(s.seq, start, end))
            meta_rows.append(prop)
        t0 = time.perf_counter()
        captures = runner.num_graph_captures
        hidden, meta = runner.forward(chunks)
        # one logits call and one device sync for the whole step: every verified window and every
        # sequence that samples its next token the plain way
        spans, rows = [], []
        for i, (c, prop) in enumerate(zip(chunks, meta_rows)):
            lo, hi = meta.query_start[i], meta.query_start[i + 1]
            if prop is not None and prop.tokens:
                spans.append((len(rows), hi - lo))
                rows.extend(range(lo, hi))
            elif c.end == len(c.seq):  # prefill finished, or decoding without a draft this step
                spans.append((len(rows), 1))
                rows.append(hi - 1)
            else:
                spans.append(None)
        logits = runner.logits(hidden, rows) if rows else None  # (len(rows), V) fp32
        srows = [runner.sampling_row(c.seq) for c in chunks]
        plain = [i for i, (c, prop) in enumerate(zip(chunks, meta_rows))
                 if spans[i] is not None and not (prop is not None and prop.tokens)]
        plain_tokens = {}
        if plain:
            picked = runner.sampler(logits[[spans[i][0] for i in plain]], [srows[i] for i in plain]).tolist()
            plain_tokens = dict(zip(plain, picked))
        top = logits.argmax(-1).tolist() if logits is not None and any(
            p is not None and p.tokens and srows[i].temperature == 0 for i, p in enumerate(meta_rows)) else None
        now = time.perf_counter()
        finished: list[Sequence] = []
        for i, (c, prop) in enumerate(zip(chunks, meta_rows)):
            seq = c.seq
            if prop is not None and prop.tokens:
                k = len(prop.tokens)
                del seq.token_ids[-k:]
                committed_before = seq.draft.num_committed if seq.draft else 0
                r0 = spans[i][0]
                row = srows[i]
                if row.temperature == 0:
                    emitted, accepted = accept_greedy(top[r0: r0 + k + 1], prop.tokens)
                else:
                    p = probabilities(logits[r0: r0 + k + 1], [row] * (k + 1))
                    emitted, accepted = accept_sampled(p, prop.probs, prop.tokens,
                                                       seq.generator or runner.sampler.generator)
                spec.stats.record(k, accepted)
                spec.policy.observe(seq.seq_id, k, accepted)
                seq.spec_stats.record(k, accepted)
                spec.after_verify(seq, committed_before, k, accepted)
                done = False
                for tok in emitted:  # EOS, stop strings and max_tokens apply inside the run
                    if self._append(seq, tok, now):
                        done = True
                        break
                if not done:
                    seq.num_computed_tokens = len(seq) - 1
                    self.block_manager.truncate(seq, len(seq))
                else:
                    finished.append(seq)
            elif i in plain_tokens:
                seq.num_computed_tokens = c.end
                if self._append(seq, plain_tokens[i], now):
                    finished.append(seq)
            else:
                seq.num_computed_tokens = c.end
        t_target = time.perf_counter() - t0
        # decode/verify steps only (prefill chunks would skew the line), and none that captured a graph
        if runner.num_graph_captures == captures:
            spec.policy.observe_any_step(meta.num_tokens, t_target)
            if len(decoding) == len(out.scheduled):
                spec.policy.observe_step(meta.num_tokens, t_target)
        self._count_step(meta.num_tokens, t_target + t_draft, False)  # a speculative step: not plain decode
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp: SamplingParams = seq.sampling
        if not sp.ignore_eos and token in self.eos_token_ids:
            seq.stop_reason = token
            return "stop"
        if sp.stop:
            text = self.tokenizer.decode(seq.generated_token_ids, skip_special_tokens=True)
            for s in sp.stop:
                if s in text:
                    seq.stop_reason = s
                    return "stop"
        if seq.num_generated_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.generated_token_ids, skip_special_tokens=True)
        if isinstance(seq.stop_reason, str) and seq.finish_reason == "stop":
            text = text[: text.find(seq.stop_reason)]
        return text

    def _output(self, seq: Sequence, prompt: PromptType) -> RequestOutput:
        prompt_text = prompt if isinstance(prompt, str) else (prompt.get("prompt") or "")
        if seq.finish_reason == "error":
            return self._error_output(seq.request_id, prompt, seq.token_ids[: seq.num_prompt_tokens],
                                      str(seq.stop_reason))
        end = seq.finish_time or time.perf_counter()
        metrics = RequestMetrics(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_generated_tokens=seq.num_generated_tokens,
            num_images=len(seq.images),
            num_encoded_images=seq.num_encoded_images,
            num_preemptions=seq.num_preemptions,
            draft_proposed=seq.spec_stats.proposed,
            draft_accepted=seq.spec_stats.accepted,
            draft_verifications=seq.spec_stats.verifications,
            draft_bypassed_steps=seq.spec_stats.bypassed_steps,
            draft_accepted_length_histogram=dict(sorted(seq.spec_stats.accepted_hist.items())),
            draft_k_histogram=dict(sorted(seq.spec_stats.k_hist.items())),
            time_to_first_token=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            total_time=end - seq.arrival_time,
            finish_reason=seq.finish_reason,
        )
        completion = CompletionOutput(0, self._text(seq), seq.generated_token_ids, seq.finish_reason,
                                      seq.stop_reason)
        seq.mm_inputs = []
        return RequestOutput(seq.request_id, prompt_text, seq.token_ids[: seq.num_prompt_tokens], [completion],
                             metrics)

    @staticmethod
    def _error_output(request_id: str, prompt: PromptType, prompt_ids: list[int], error: str) -> RequestOutput:
        prompt_text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") or "" if isinstance(prompt, dict) else "")
        return RequestOutput(request_id, prompt_text, prompt_ids, [CompletionOutput(0, "", [], "error")],
                             RequestMetrics(num_prompt_tokens=len(prompt_ids), finish_reason="error"),
                             error=error)
