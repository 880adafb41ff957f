"""Requests that join a running engine: added between steps, handed back as each finishes.

`docproc run` keeps the engine fed this way (documents enter as they are rendered, the scheduler's
continuous batching takes them in); `LLM.generate` is one stream filled at once and run dry.
"""
from __future__ import annotations

from dataclasses import dataclass
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


class RequestStream:
    def __init__(self, llm) -> None:
        self.llm = llm
        self._running: dict[int, tuple[_Request, int]] = {}  # sequence id -> (its request, its sample)
        self._refused: list[tuple[Any, RequestOutput]] = []  # refused as they were added: handed back next step
        self._next_id = 0
        self.unfinished = 0  # requests added and not yet handed back

    def add(self, prompts: Seq[PromptType], params: Seq[SamplingParams], tags: Seq[Any]) -> None:
        """Queue requests (each with the tag it comes back with). A prompt the engine cannot take
        comes back from the next step as an error output; an exception here leaves nothing of
        this call queued."""
        memo: dict = {}  # one conversion per image object among these prompts (they share pages)
        added: list[int] = []
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
                    continue
                req = _Request(tag, prompt, sp, [None] * len(seqs))
                for j, seq in enumerate(seqs):
                    self._running[seq.seq_id] = (req, j)
                    added.append(seq.seq_id)
                    self.llm.scheduler.add(seq)
        except BaseException:
            self.abort()  # none of this call's requests stays queued
            raise

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
                req.samples[j] = request_output(seq, req.prompt, llm.tokenizer)
                if all(s is not None for s in req.samples):  # its last sample
                    done.append((req.tag, merge_samples(req.samples, req.params.n)))
                    self.unfinished -= 1
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
