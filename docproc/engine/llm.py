"""LLM: the offline engine API (vLLM-shaped). Requests in, RequestOutputs out, in input order.

The facade: it builds the runner (and a draft's, engine/spec), owns the scheduler and the block
manager, and runs steps until every request finished. A step is one of: a plain step (prefill
chunks and decode rows, ModelRunner.execute), an overlapped step (the same, launched before the
previous step's tokens are read: engine/overlap.py) or a speculative step (engine/spec/verifier.py).
"""
from __future__ import annotations

import base64
import binascii
import itertools
import os
import threading
import warnings
import weakref
import time
from typing import Any, Callable, Sequence as Seq

import torch

from docproc.config import CacheConfig, EngineConfig, SpecConfig
from docproc.engine import info
from docproc.engine.block_manager import BlockManager
from docproc.engine.jit_watch import WATCH
from docproc.engine.model_runner import ModelRunner
from docproc.engine.overlap import OverlapDecoder
from docproc.engine.progress import Progress
from docproc.engine.requests import PromptType, eos_token_ids, stop_reason
from docproc.engine.scheduler import Scheduler
from docproc.engine.sequence import Sequence
from docproc.engine.spec import setup as spec_setup
from docproc.engine.spec.policy import StepRecord, ended
from docproc.engine.spec.verifier import Verifier
from docproc.engine.stream import RequestStream
from docproc.multimodal import IMAGE_PAD
from docproc.outputs import RequestOutput
from docproc.sampling_params import SamplingParams, flag, real_number, shown, text, whole_number

PREFETCH_LOOKAHEAD = 64  # queued sequences whose pages are preprocessed ahead (engine/prefetch.py)


# LLM's scalar arguments and their checks (the configs check the ranges these leave open)
WHOLE_ARGUMENTS = {"block_size": 1, "max_num_batched_tokens": 1, "max_num_seqs": 1, "seed": 0,
                   "encoder_cache_entries": 1, "tensor_parallel_size": 1, "speculative_draft_tensor_parallel_size": 1}
OPTIONAL_WHOLE_ARGUMENTS = {"max_model_len": 2, "kv_cache_memory_bytes": 1, "num_kv_blocks": 1,
                            "image_prefetch_workers": 0}
FLAG_ARGUMENTS = ("enable_prefix_caching", "enforce_eager", "overlap_decode", "one_row_kernels", "pdl", "fp4_gluon",
                  "batch_invariant", "trust_remote_code")
TEXT_ARGUMENTS = ("device", "kv_cache_dtype", "draft_vision", "load_format")


def check_arguments(args: dict[str, Any]) -> None:
    """ValueError naming the first of LLM's arguments whose type is wrong."""
    text("LLM", "model", args["model"], path=True)
    text("LLM", "speculative_model", args["speculative_model"], optional=True, path=True)
    for name, minimum in WHOLE_ARGUMENTS.items():
        whole_number("LLM", name, args[name], minimum)
    for name, minimum in OPTIONAL_WHOLE_ARGUMENTS.items():
        whole_number("LLM", name, args[name], minimum, optional=True)
    for name in FLAG_ARGUMENTS:
        flag("LLM", name, args[name])
    for name in TEXT_ARGUMENTS:
        text("LLM", name, args[name])
    text("LLM", "quantization", args["quantization"], optional=True)
    text("LLM", "weight_digest_cache", args["weight_digest_cache"], optional=True, path=True)
    if not isinstance(args["dtype"], torch.dtype):
        text("LLM", "dtype", args["dtype"])
    real_number("LLM", "gpu_memory_utilization", args["gpu_memory_utilization"], "a number in (0, 1]")
    if not isinstance(args["num_speculative_tokens"], str):
        whole_number("LLM", "num_speculative_tokens", args["num_speculative_tokens"], 1)


# ---- chat messages -------------------------------------------------------------------------------
CHAT_PART_TYPES = ("text", "image_url", "image", "image_pil")


def image_from_url(url: Any, where: str):
    """An image_url part's image: the bytes of a base64 `data:` URL, or a local path (`file://` or
    none). Nothing is fetched from the network."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: image_url must be {{'url': '...'}} with a data: URL or a local path, "
                         f"got {shown(url)}")
    if url.startswith("data:"):
        header, comma, data = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data: URL's base64 does not decode") from None
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("http", "https"):
        raise ValueError(f"{where}: {url[:80]} is on the network and docproc fetches nothing: download the image "
                         f"and give its path, a PIL image or a data: URL")
    if scheme == "file":
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(url).path)
    if scheme:
        raise ValueError(f"{where}: {scheme}:// URLs are not supported: give a local path, a PIL image or a data: URL")
    return url


def chat_messages(conversation: Any, where: str) -> tuple[list[dict], list]:
    """OpenAI-style messages -> (the messages a chat template reads, every image part written
    {"type": "image"}; the images in order: PIL images, paths or bytes). ValueError naming the
    message or part that is malformed."""
    from PIL import Image

    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where} must be a non-empty list of messages ({{'role': ..., 'content': ...}} dicts), "
                         f"got {shown(conversation)}")
    messages, images = [], []
    for k, m in enumerate(conversation):
        at = f"{where}[{k}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at} must be a dict with 'role' and 'content', got {shown(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{at}['role'] must be a non-empty string (system, user, assistant), got {shown(role)}")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, (list, tuple)):
            raise ValueError(f"{at}['content'] must be a string or a list of parts, got {shown(content)}")
        parts = []
        for q, part in enumerate(content):
            pat = f"{at}['content'][{q}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in CHAT_PART_TYPES:
                raise ValueError(f"{pat} must be a dict whose 'type' is one of {', '.join(CHAT_PART_TYPES)}, "
                                 f"got {shown(kind if isinstance(part, dict) else part)}")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{pat}['text'] must be a string, got {shown(part.get('text'))}")
                parts.append({"type": "text", "text": part["text"]})
                continue
            if kind == "image_url":
                url = part.get("image_url")
                image = image_from_url(url.get("url") if isinstance(url, dict) else url, pat)
            else:
                image = part.get(kind)
                if isinstance(image, str) and (image.startswith("data:") or "://" in image):
                    image = image_from_url(image, pat)
                elif not isinstance(image, (Image.Image, str, os.PathLike, bytes)):
                    raise ValueError(f"{pat}['{kind}'] must be a PIL image, a path or a data: URL, got {shown(image)}")
            images.append(image)
            parts.append({"type": "image"})
        messages.append({"role": role, "content": parts})
    return messages, images


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
        overlap_decode: bool = True,
        one_row_kernels: bool = True,
        pdl: bool = True,
        fp4_gluon: bool = True,
        batch_invariant: bool = False,
        quantization: str | None = None,
        load_format: str = "auto",
        tensor_parallel_size: int = 1,
        speculative_draft_tensor_parallel_size: int = 1,
        weight_digest_cache: str | None = "auto",
        trust_remote_code: bool = False,
    ) -> None:
        check_arguments(locals())
        if trust_remote_code:
            warnings.warn("LLM(trust_remote_code=True) changes nothing: docproc runs its own model classes, never "
                          "code from a model folder", stacklevel=2)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if speculative_draft_tensor_parallel_size != 1:
            raise ValueError(f"speculative_draft_tensor_parallel_size={speculative_draft_tensor_parallel_size}: the "
                             f"draft runs whole on rank 0 (1 is the only choice)")
        cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                            enable_prefix_caching=enable_prefix_caching,
                            gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, num_kv_blocks=num_kv_blocks,
                            encoder_cache_entries=encoder_cache_entries)
        self.config = EngineConfig(model=str(model), device=device, dtype=dtype,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, seed=seed, cache=cache,
                                   enforce_eager=enforce_eager, image_prefetch_workers=image_prefetch_workers,
                                   one_row_kernels=one_row_kernels, pdl=pdl, fp4_gluon=fp4_gluon,
                                   batch_invariant=batch_invariant,
                                   quantization=quantization, load_format=load_format,
                                   tensor_parallel_size=tensor_parallel_size,
                                   weight_digest_cache=None if weight_digest_cache is None
                                   else os.fspath(weight_digest_cache))  # (checked: check_arguments)
        self.spec_config = None if speculative_model is None else SpecConfig(
            str(speculative_model), num_speculative_tokens, draft_vision)
        draft = None if self.spec_config is None else spec_setup.draft_runner(self.config, self.spec_config)
        self.runner = ModelRunner(self.config, allocate=draft is None)
        # the other tensor-parallel ranks stop with this engine (or with this process)
        weakref.finalize(self, self.runner.close)
        self.speculator = None if draft is None else spec_setup.attach(self.runner, draft, self.spec_config)
        self.verifier = Verifier(self)
        self.processor = self.runner.processor
        self.tokenizer = self.processor.tokenizer
        self._grammar_lock = threading.Lock()  # the grammar compiler is made once, from whichever thread
        limit = self.runner.text_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_model_len = max_model_len or limit
        self.block_manager = BlockManager(self.runner.num_usable_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   lookahead=self.speculator.k_max if self.speculator else 0)
        if self.runner.prefetcher.workers:  # pages are prepared on threads: admit them once they are
            self.scheduler.ready = self.runner.pixels_ready
        self.eos_token_ids = eos_token_ids(model, self.runner.hf_config, self.tokenizer)
        self.overlap = OverlapDecoder(self, overlap_decode)
        self.compile_mark = WATCH.mark()  # every runner has warmed up by now
        self.num_steps = 0
        self.num_step_tokens = 0
        self.step_seconds = 0.0
        self.num_step_running = 0  # the running sequences summed over steps (after each step)
        self.num_decode_steps = 0  # plain steps that only decoded (the memory-bound part of a run)
        self.num_decode_step_tokens = 0
        self.decode_step_seconds = 0.0

    # ---- public ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks now (else they stop with it)."""
        self.runner.close()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        on_request_done: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. on_request_done, when given, is called
        once per request as it finishes (in finishing order, with the RequestOutput that is also
        returned): what a caller's progress display counts; an exception it raises ends the call."""
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

        stream = RequestStream(self)
        stream.add(prompts, params, range(len(prompts)))
        results: list[RequestOutput | None] = [None] * len(prompts)
        progress = Progress(len(results)) if use_tqdm else None
        callbacks = [f for f in (progress.advance if progress else None, on_request_done) if f is not None]
        try:
            while stream.unfinished:
                for i, out in stream.step():
                    results[i] = out
                    for f in callbacks:
                        f(out)
        except BaseException:
            stream.abort()
            raise
        finally:
            if progress:
                progress.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """generate() on OpenAI-style conversations: `messages` is one conversation (a list of
        {"role", "content"} dicts) or a list of them; content is a string or a list of parts:
        {"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": ...}} (a base64
        data: URL or a local path; nothing is fetched from the network), {"type": "image",
        "image": PIL image or path}. The model's chat template (or `chat_template`) makes each
        prompt; every image becomes one placeholder that the engine expands. One RequestOutput
        per conversation; ValueError for a message that cannot become a prompt."""
        conversations = messages if (isinstance(messages, (list, tuple)) and messages
                                     and all(isinstance(c, (list, tuple)) for c in messages)) else [messages]
        requests = [self.chat_prompt(conversation, "messages" if len(conversations) == 1 and conversations[0] is messages
                                     else f"messages[{c}]", chat_template, add_generation_prompt, chat_template_kwargs)
                    for c, conversation in enumerate(conversations)]
        return self.generate(requests, sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[dict], where: str = "messages", chat_template: str | None = None,
                    add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> PromptType:
        """One conversation as chat() prompts it: the model's chat template (or `chat_template`)
        over its messages, with its images. ValueError naming what cannot become a prompt."""
        template = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"{self.config.model} has no chat template (chat_template.jinja, or chat_template in "
                             f"tokenizer_config.json): pass chat_template=, or build the prompt and call generate")
        from jinja2 import TemplateError

        msgs, images = chat_messages(conversation, where)
        try:
            prompt = self.tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt,
                                                        **(chat_template_kwargs or {}))
        except TemplateError as e:
            raise ValueError(f"{where}: the chat template refused the messages: {e}") from None
        if prompt.count(IMAGE_PAD) != len(images):
            raise ValueError(f"{where}: the prompt the chat template made has {prompt.count(IMAGE_PAD)} "
                             f"{IMAGE_PAD} for {len(images)} image(s): the template must write "
                             f"<|vision_start|>{IMAGE_PAD}<|vision_end|> for each {{'type': 'image'}} part, and "
                             f"the text may not hold {IMAGE_PAD}")
        return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt

    def get_tokenizer(self):
        """The target model's tokenizer (a transformers tokenizer)."""
        return self.tokenizer

    def _matcher(self, params, max_tokens: int):
        """A grammar matcher for a structured-output request."""
        return self._grammar().matcher(params, max_tokens)

    def compile_constraint(self, params) -> None:
        """Compile a structured-output constraint (StructuredOutputsParams) ahead of its request,
        from any thread: the request then costs the engine no compile. StructuredOutputError
        (a ValueError) if it does not compile."""
        self._grammar().compile(params)

    def _grammar(self):
        """The grammar compiler (made on first use)."""
        with self._grammar_lock:
            if self.runner.grammar is None:
                from docproc.engine.structured import GrammarCompiler

                self.runner.grammar = GrammarCompiler(self.tokenizer, self.runner.text_config.vocab_size,
                                                      self.eos_token_ids)
                if self.speculator is not None:  # the draft proposes under the same grammars
                    self.speculator.grammar = self.runner.grammar
            return self.runner.grammar

    def model_fingerprint(self) -> dict:
        """The target's weights as two short hashes: its language model and its vision tower."""
        m = self.runner.model
        return {"text": m.text_fingerprint, "vision": m.vision_fingerprint}

    def count_image_tokens(self, image) -> int:
        """The tokens an image (a PIL image) takes in a prompt, as the engine will expand it."""
        return self.processor.num_tokens(self.processor.grid_thw(image))

    def cache_info(self) -> dict:
        return info.cache_info(self)

    def spec_info(self) -> dict | None:
        """Speculative decoding figures so far (None without a draft)."""
        return info.spec_info(self)

    @property
    def num_overlapped_steps(self) -> int:
        return self.overlap.num_steps

    # ---- steps -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one scheduled step; return the sequences that finished in it."""
        if self.overlap.pending is not None:
            return self.overlap.step()
        self.prefetch_waiting()
        out = self.scheduler.schedule()
        finished: list[Sequence] = []
        self.prefetch(out)
        for seq, why in out.failed:
            seq.stop_reason = why
            self.scheduler.finish(seq, "error")
            finished.append(seq)
        spec = self.speculator
        if spec is not None:
            for seq in out.preempted:
                spec.release(seq)
        if out.is_empty:
            if self.scheduler.has_unfinished and not self.scheduler.running and not out.failed:
                raise RuntimeError("scheduler made no progress with nothing running: the KV pool is too small")
            return finished
        if spec is not None:
            spec.policy.batch = max(1, len(out.decoding))
            # one K for the step (its draft forwards are shared); chosen already if an overlapped
            # step asked the policy before it could know this step would not be bypassed
            k_step = self.overlap.next_k
            self.overlap.next_k = None
            if k_step is None:
                k_step = spec.policy.choose_step([seq.seq_id for seq in out.decoding])
            windows, declined = self.verifier.windows(out.decoding, k_step) if k_step > 0 else ([], 0)
            spec.num_catch_up_skips += declined
            if windows:
                return finished + self.verifier.step(out, windows)
            # bypassed (by the policy, or no sequence's catch-up pays): the plain step itself, with
            # as little speculation bookkeeping on the host as can be (a small model's decode step
            # is ~0.3 ms of host time on a GPU), overlapped where it can be
            spec.stats.bypassed_steps += len(out.decoding)
            for seq in out.decoding:
                seq.spec_stats.bypassed_steps += 1
        if self.overlap.can_overlap(out):  # a plain step (or a decode step the policy bypassed the draft for)
            return finished + self.overlap.start(out)
        return finished + self._plain_step(out)

    def prefetch_waiting(self) -> None:
        """Start preprocessing the pages of the next queued requests (before a step is scheduled:
        the scheduler admits one, while others run, once its pixels are ready)."""
        if self.runner.prefetcher.workers and self.scheduler.waiting:
            self.runner.prefetch_images(itertools.islice(self.scheduler.waiting, PREFETCH_LOOKAHEAD))

    def prefetch(self, out) -> None:
        """Start preprocessing the pages a scheduled step encodes that are not started yet (in
        parallel; the queue was looked at by prefetch_waiting before the step was scheduled)."""
        if self.runner.prefetcher.workers and len(out.decoding) < len(out.scheduled):
            self.runner.prefetch_images(s.seq for s in out.scheduled if s.seq.images and not s.seq.images_prefetched)

    def _plain_step(self, out) -> list[Sequence]:
        captures = self.runner.num_graph_captures
        ends = [(s.seq, s.end) for s in out.scheduled]
        result = self.runner.execute(out)
        decode_only = len(out.decoding) == len(out.scheduled)  # no prefill chunk in the step
        self.count_step(result.num_tokens, result.seconds, decode_only)
        now = time.perf_counter()
        finished = []
        for seq, end in ends:
            seq.num_computed_tokens = end
            token = result.tokens.get(seq.seq_id)
            if token is not None and self.append_token(seq, token, now):
                finished.append(seq)
        if self.speculator is not None:
            self.speculator.policy.record(StepRecord(result.num_tokens, result.seconds,
                                                     timed=self.runner.num_graph_captures == captures,
                                                     decode_only=decode_only, ended=ended(finished)))
        return finished

    def append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a generated token; finish the sequence if it stops there. True if it finished."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.append_token(token)
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            seq.stop_reason = f"token {token} is outside the structured-output constraint"
            self.scheduler.finish(seq, "error")
            if self.speculator is not None:
                self.speculator.release(seq)
            seq.finish_time = now
            return True
        reason = stop_reason(seq, token, self.eos_token_ids, self.tokenizer, self.max_model_len)
        if reason is None:
            return False
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.finish_time = now
        return True

    def cancel(self, seq: Sequence) -> bool:
        """Stop a sequence its caller no longer wants, between steps. One that holds no place in a
        step in flight leaves now (its blocks go back to the pool; the K/V it computed stays in
        the prefix cache) and True is returned; one sampling a token in an overlapped step still in
        flight is marked and stops at that token (LLM.step returns it, finish_reason "abort")."""
        if seq.is_finished:
            return True
        seq.cancelled = True
        pending = self.overlap.pending
        if pending is not None and any(pending.scheduled[i].seq is seq for i in pending.sampled):
            return False  # (a prefill chunk in flight samples nothing: it stops now, its blocks written first)
        self.scheduler.finish(seq, "abort")
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.finish_time = time.perf_counter()
        self._forget_pixels(seq)
        return True

    def _forget_pixels(self, seq: Sequence) -> None:
        """A cancelled sequence's pages being prepared ahead, unless another unfinished sequence
        needs them: a server whose clients go away would otherwise fill the prefetcher's places
        with pixels nobody takes (until the engine is idle), and prepare every later page inline."""
        runners = [self.runner] + ([self.speculator.runner] if self.speculator is not None else [])
        hashes = {span.content_hash for span in seq.images}
        hashes = {h for h in hashes if any(r.prefetcher.pending(h) for r in runners)}
        if not hashes:
            return
        for other in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            hashes.difference_update(span.content_hash for span in other.images)
        for r in runners:
            r.prefetcher.forget(hashes)

    def count_step(self, tokens: int, seconds: float, decode: bool) -> None:
        self.num_steps += 1
        self.num_step_running += len(self.scheduler.running)
        self.num_step_tokens += tokens
        self.step_seconds += seconds
        if decode:
            self.num_decode_steps += 1
            self.num_decode_step_tokens += tokens
            self.decode_step_seconds += seconds

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
        self.overlap.abort()
