"""LLM: the offline engine API (vLLM-shaped). Requests in, RequestOutputs out, in input order."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence as Seq

from docproc.config import CacheConfig, EngineConfig
from docproc.engine.block_manager import BlockManager
from docproc.engine.model_runner import ModelRunner
from docproc.engine.scheduler import Scheduler
from docproc.engine.sequence import Sequence
from docproc.models.processor import PromptError
from docproc.outputs import CompletionOutput, RequestMetrics, RequestOutput
from docproc.sampling_params import SamplingParams

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
    ) -> None:
        cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                            enable_prefix_caching=enable_prefix_caching,
                            gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, num_kv_blocks=num_kv_blocks,
                            encoder_cache_entries=encoder_cache_entries)
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, seed=seed, cache=cache)
        self.runner = ModelRunner(self.config)
        self.processor = self.runner.processor
        self.tokenizer = self.processor.tokenizer
        limit = self.runner.text_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_model_len = max_model_len or limit
        self.block_manager = BlockManager(self.runner.kv_cache.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.eos_token_ids = eos_token_ids(model, self.runner.hf_config, self.tokenizer)
        self.num_steps = 0
        self.num_step_tokens = 0
        self.step_seconds = 0.0

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
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                seq = self._make_sequence(prompt, sp, str(i))
            except PromptError as e:
                results[i] = self._error_output(str(i), prompt, [], str(e))
                continue
            index[seq.seq_id] = i
            self.scheduler.add(seq)

        progress = _Progress(len(index)) if use_tqdm else None
        try:
            while self.scheduler.has_unfinished:
                for seq in self.step():
                    i = index.pop(seq.seq_id, None)
                    if i is None:
                        continue
                    results[i] = self._output(seq, prompts[i])
                    if progress:
                        progress.advance(seq.num_generated_tokens)
        finally:
            if progress:
                progress.close()
        return results  # type: ignore[return-value]

    def cache_info(self) -> dict:
        kv = self.runner.kv_cache
        bm = self.block_manager
        enc = self.runner.encoder_cache.stats
        return {
            "kv_cache_dtype": kv.dtype_name,
            "block_size": kv.block_size,
            "num_blocks": kv.num_blocks,
            "bytes_per_token": kv.bytes_per_token,
            "bytes_per_token_bf16": 2 * self.runner.text_config.num_hidden_layers * 2
                                    * self.runner.text_config.num_key_value_heads * self.runner.text_config.head_dim,
            "kernel_warmup_seconds": round(self.runner.warmup_seconds, 3),
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
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
        }

    # ---- internals -------------------------------------------------------------------------
    def _make_sequence(self, prompt: PromptType, sp: SamplingParams, request_id: str) -> Sequence:
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
        ids, spans, loaded = self.processor.process(text, token_ids, list(images), uuids)
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
        out = self.scheduler.schedule()
        finished: list[Sequence] = []
        for seq, why in out.failed:
            seq.stop_reason = why
            self.scheduler.finish(seq, "error")
            finished.append(seq)
        if out.is_empty:
            if self.scheduler.has_unfinished and not self.scheduler.running and not out.failed:
                raise RuntimeError("scheduler made no progress with nothing running: the KV pool is too small")
            return finished
        ends = [(s.seq, s.end) for s in out.scheduled]
        result = self.runner.execute(out)
        self.num_steps += 1
        self.num_step_tokens += result.num_tokens
        self.step_seconds += result.seconds
        now = time.perf_counter()
        for seq, end in ends:
            seq.num_computed_tokens = end
            token = result.tokens.get(seq.seq_id)
            if token is None:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.append_token(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                seq.finish_time = now
                finished.append(seq)
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


class _Progress:
    """A Rich progress bar over requests, drawn only when generate(use_tqdm=True)."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), transient=True)
        self._task = self._progress.add_task("generate", total=total, tps="-")
        self._start = time.perf_counter()
        self._tokens = 0
        self._progress.start()

    def advance(self, num_tokens: int) -> None:
        self._tokens += num_tokens
        tps = self._tokens / max(time.perf_counter() - self._start, 1e-9)
        self._progress.update(self._task, advance=1, tps=f"{tps:.1f}")

    def close(self) -> None:
        self._progress.stop()
