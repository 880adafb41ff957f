"""Requests that join a running engine: added between steps, handed back as each finishes.

`docproc run` keeps the engine fed this way (documents enter as they are rendered, the scheduler's
continuous batching takes them in); `LLM.generate` is one stream filled at once and run dry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch

from docproc.engine.requests import PromptType, error_output, make_sequence, request_output
from docproc.errors import DeviceUnavailable
from docproc.models.processor import PromptError
from docproc.outputs import RequestOutput, merge_samples
from docproc.sampling_params import SamplingParams


def is_device_failure(e: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (not an out-of-memory, which a smaller step
    survives)."""
    if isinstance(e, torch.OutOfMemoryError) or not isinstance(e, RuntimeError):
        return False
    return type(e).__name__ == "AcceleratorError" or "CUDA error" in str(e)


@dataclass
class _Request:
    tag: Any
    prompt: PromptType
    params: SamplingParams
    samples: list  # one RequestOutput per sequence (n of them), None until it finishes
    seqs: list = field(default_factory=list)  # its sequences (for cancel and progress)


class RequestStream:
    def __init__(self, llm) -> None:
        self.llm = llm
        self._running: dict[int, tuple[_Request, int]] = {}  # sequence id -> (its request, its sample)
        self._refused: list[tuple[Any, RequestOutput]] = []  # refused as they were added: handed back next step
        self._next_id = 0
        self.unfinished = 0  # requests added and not yet handed back

    def add(self, prompts: Seq[PromptType], params: Seq[SamplingParams], tags: Seq[Any]) -> list:
        """Queue requests (each with the tag it comes back with). A prompt the engine cannot take
        comes back from the next step as an error output; an exception here leaves nothing of
        this call queued. Returns a handle per request (for cancel and progress; None for a
        refused one)."""
        memo: dict = {}  # one conversion per image object among these prompts (they share pages)
        handles: list = []
        unfinished, refused = self.unfinished, len(self._refused)
        try:
            for i, (prompt, sp, tag) in enumerate(zip(prompts, params, tags)):
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
                rid = str(self._next_id)
                self._next_id += 1
                self.unfinished += 1
                try:
                    seqs = [make_sequence(self.llm.processor, prompt, one, rid, self.llm.max_model_len, memo,
                                          self.llm._matcher) for one in sp.sequences()]
                except PromptError as e:
                    self._refused.append((tag, error_output(rid, prompt, [], str(e))))
                    handles.append(None)
                    continue
                req = _Request(tag, prompt, sp, [None] * len(seqs), seqs)
                handles.append(req)
                for j, seq in enumerate(seqs):
                    self._running[seq.seq_id] = (req, j)
                    self.llm.scheduler.add(seq)
        except BaseException:
            # none of this call's requests stays queued (they are all still waiting); earlier ones run on
            for req in handles:
                for seq in req.seqs if req is not None else ():
                    self._running.pop(seq.seq_id, None)
                    if not seq.is_finished:
                        self.llm.scheduler.finish(seq, "abort")
            del self._refused[refused:]
            self.unfinished = unfinished
            raise
        return handles

    def cancel(self, handle: _Request) -> None:
        """Give a request up (a client that went away): its sequences leave the engine now, or at
        the token of a step already in flight (LLM.cancel); it comes back from a step as usual,
        with finish_reason "abort" where it was cut short."""
        llm = self.llm
        for j, seq in enumerate(handle.seqs):
            if seq.seq_id not in self._running or seq.is_finished:
                continue
            if llm.cancel(seq):
                self._running.pop(seq.seq_id)
                self._sample_done(handle, j, seq, self._refused)

    def progress(self, handles: list) -> list[list[list[int] | None]]:
        """For each request (a handle add returned), the tokens each of its sequences has
        generated so far (a token an overlapped step is still computing not among them); None
        for a sequence that has finished, whose last tokens may hold a stop string its output
        text leaves out (its text comes with the request's output)."""
        pending = self.llm.overlap.pending
        inflight = {id(pending.scheduled[i].seq) for i in pending.sampled} if pending is not None else ()
        out = []
        for handle in handles:
            per = []
            for seq in handle.seqs:
                ids = seq.generated_token_ids
                per.append(None if seq.is_finished else ids[:-1] if ids and id(seq) in inflight else ids)
            out.append(per)
        return out

    def _sample_done(self, req: _Request, j: int, seq, done: list) -> None:
        req.samples[j] = request_output(seq, req.prompt, self.llm.tokenizer)
        if all(s is not None for s in req.samples):  # its last sample
            done.append((req.tag, merge_samples(req.samples, req.params.n)))

    def step(self) -> list[tuple[Any, RequestOutput]]:
        """Run one engine step (none when nothing runs); the requests that finished, with their tags."""
        done, self._refused = self._refused, []
        self.unfinished -= len(done)
        llm = self.llm
        if not llm.scheduler.has_unfinished:
            return done
        try:
            for seq in llm.step():
                where = self._running.pop(seq.seq_id, None)
                if where is None:
                    continue
                req, j = where
                before = len(done)
                self._sample_done(req, j, seq, done)
                self.unfinished -= len(done) - before
        except BaseException as e:
            self.abort()  # the engine stays usable for the caller's next requests
            if is_device_failure(e):
                raise DeviceUnavailable(f"the device failed ({type(e).__name__}: {e}); the CUDA context cannot "
                                        f"be used again: check the GPU (nvidia-smi) and run again") from e
            raise
        if not llm.scheduler.has_unfinished:
            llm.runner.prefetcher.drop()  # pixels of requests that failed before their encode
        return done

    def abort(self) -> None:
        """Drop every request still queued or running (their blocks go back to the pool)."""
        self.llm._abort_unfinished()
        self._running.clear()
        self._refused.clear()
        self.unfinished = 0
