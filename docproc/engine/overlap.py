"""Overlapped decode: the next decode step is queued on the device before the host reads the
tokens of the one in flight, so the host's per-token work (reading the tokens, stop checks,
scheduling, filling the next step's inputs) runs while the device computes instead of between
steps. Rows under a grammar take part: the next step's forward is queued at once and its sampling
after the host has read the tokens and its matchers have accepted them, so the grammar masks are
filled while that forward runs.

While a step is in flight each of its sequences holds a placeholder for the token it will emit
(pushed and taken out here only): the next step's input id is read from the device, never from
the placeholder.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from docproc.engine.sequence import Sequence

if TYPE_CHECKING:
    from docproc.engine.model_runner import PendingStep
    from docproc.engine.scheduler import SchedulerOutput

PLACEHOLDER = 0  # a launched step's token in token_ids until the host reads it


def _matchers(scheduled) -> list | None:
    matchers = [sc.seq.grammar for sc in scheduled]
    return matchers if any(m is not None for m in matchers) else None


class OverlapDecoder:
    def __init__(self, engine, enabled: bool) -> None:  # engine: the LLM that owns it
        self.engine = weakref.proxy(engine)  # no reference cycle: a dropped engine frees its memory at once
        self.enabled = enabled
        self.pending: PendingStep | None = None  # the launched decode step whose tokens the host has not read
        self.pending_since = 0.0  # when the host last had nothing in flight to wait for
        self.num_steps = 0  # decode steps launched before the previous step's tokens were read
        self.next_k: int | None = None  # the speculation policy's choice for the next step, made by _continue

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether a step may be launched without waiting for its tokens: a pure decode step of the
        whole running set (no prefill under way, no admission waiting for a free place), with
        static step graphs (the next step's input ids come from the device) and no logits hook, and
        every row greedy or seeded (an unseeded row would draw from the engine's generator in a
        batch that can hold a finished row, so its samples would differ from the plain loop's)."""
        runner, sched = self.engine.runner, self.engine.scheduler
        if not self.enabled or runner.graphs is None or runner.logits_hook is not None:
            return False
        if len(out.decoding) != len(out.scheduled) or len(out.scheduled) != len(sched.running) or out.failed \
                or out.preempted:
            return False
        if sched.waiting and len(sched.running) < sched.max_num_seqs:
            return False
        # (a constrained row's step is launched ahead all the same: its forward does not need the
        # mask, only its sampling does, which waits for the token before it; see step())
        return all(s.seq.sampling.temperature == 0 or s.seq.sampling.seed is not None for s in out.scheduled)

    def start(self, out: SchedulerOutput) -> list[Sequence] | None:
        """Launch out's step and read it through step() (None: it could not be launched so)."""
        self.pending = self.engine.runner.launch(out.scheduled, matchers=_matchers(out.scheduled))
        if self.pending is None:
            return None
        self.pending_since = self.pending.t0
        return self.step()

    def abort(self) -> None:
        self.pending = None
        self.next_k = None

    def _continue(self, prev: PendingStep) -> PendingStep | None:
        """Launch the decode step after `prev` (in flight, tokens unread) for the same sequences,
        its input ids taken from prev's tokens on the device. Each sequence gets a placeholder for
        prev's token, replaced when it is read. None (nothing changed) when the next step could be
        different: a sequence that finishes for sure (max_tokens, max_model_len), a sequence that
        would be admitted or resumed, a pool without the blocks, or a batch without a graph."""
        eng = self.engine
        sched = eng.scheduler
        seqs = [sc.seq for sc in prev.scheduled]
        if len(seqs) != len(sched.running) or (sched.waiting and len(sched.running) < sched.max_num_seqs):
            return None
        for seq in seqs:
            if seq.is_finished or seq.num_generated_tokens + 1 >= seq.max_tokens or len(seq) + 1 >= eng.max_model_len:
                return None
        spec = eng.speculator
        if spec is not None:  # only a step the policy bypasses the draft for overlaps
            spec.policy.batch = len(seqs)
            k = spec.policy.choose_step([seq.seq_id for seq in seqs])
            if k > 0:
                self.next_k = k  # the choice stands (a probe's countdown restarted with it)
                return None
        out = sched.schedule_continuation(seqs)
        if out is None:
            return None
        for seq in seqs:
            seq.token_ids.append(PLACEHOLDER)
        # rows under a grammar: the forward now, the sampling once their matchers have taken prev's tokens
        constrained = any(seq.grammar is not None for seq in seqs)
        nxt = eng.runner.launch(out.scheduled, ids_from=prev.tokens, sample=not constrained)
        if nxt is None:
            for seq in seqs:
                seq.token_ids.pop()
            sched.undo_continuation(seqs)
            return None
        nxt.overlapped = True
        if spec is not None:
            spec.stats.bypassed_steps += len(seqs)
            for seq in seqs:
                seq.spec_stats.bypassed_steps += 1
        self.num_steps += 1
        return nxt

    def step(self) -> list[Sequence]:
        """Read the tokens of the launched step, having first launched the one after it where it can
        (so the device never waits for the host between them), and append them. A row whose
        sequence stopped at the previous step's token is dropped (its token was computed for
        nothing: the one step of waste per stop that overlapping costs)."""
        eng = self.engine
        prev = self.pending
        self.pending = None
        nxt = self._continue(prev)
        tokens = eng.runner.collect(prev)
        now = time.perf_counter()
        seconds = now - max(prev.t0, self.pending_since)
        self.pending_since = now
        finished: list[Sequence] = []
        rows = 0
        for (seq, end), token in zip(prev.ends, tokens):
            if seq.is_finished:
                continue
            rows += 1
            if nxt is not None:  # the sequence holds a placeholder for this token
                seq.token_ids.pop()
            else:
                seq.num_computed_tokens = end
            if eng.append_token(seq, token, now):
                finished.append(seq)
        if nxt is not None and nxt.tokens is None:
            # the masks of the step in flight, filled while its forward runs, then its sampling
            eng.runner.sample_pending(nxt, [None if sc.seq.is_finished else sc.seq.grammar for sc in nxt.scheduled])
        eng.count_step(rows, seconds, True)
        spec = eng.speculator
        if spec is not None and not prev.captured:  # a bypassed step
            if prev.overlapped:  # its host work hidden: how much cheaper plain decoding is
                spec.policy.observe_overlapped_step(len(tokens), seconds)
            else:  # a point of the target's cost line
                spec.policy.observe_any_step(len(tokens), seconds)
                spec.policy.observe_step(len(tokens), seconds)
        if nxt is not None and not all(sc.seq.is_finished for sc in nxt.scheduled):
            self.pending = nxt  # read by the next step() (nothing else can run before it)
        return finished
