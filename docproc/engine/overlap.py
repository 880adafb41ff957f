"""Overlapped steps: the next step is scheduled and queued on the device before the host reads the
tokens of the one in flight, so the host's per-step work (reading the tokens, stop checks,
grammar matchers, scheduling, filling the next step's inputs) runs while the device computes
instead of between steps. Every plain step takes part: decode rows, prefill chunks and the
admission of waiting sequences alike (a document's pages enter the engine without stopping the
device). Rows under a grammar take part too: the next step's forward is queued at once and its
sampling after the host has read the tokens and the matchers have accepted them, so the grammar
masks are filled while that forward runs.

Placeholders are counted, not guessed: before the next step is scheduled, each sequence that
samples a token in the step in flight gets a placeholder token (Sequence.num_placeholders) and
counts that step's tokens as computed, so the one Scheduler.schedule() sees it as a decode row.
That row's input id is copied on the device from the step in flight's sampled tokens, never read
from the placeholder, and the prefix cache never commits a block that holds one. A sequence that
stops at the token in flight for sure (max_tokens, max_model_len, cancelled) gets no placeholder
and no row, and leaves the running set at once (its place and blocks go to the next step); one that stops at it by chance (EOS, a stop string, a grammar's end) computed its row
of the next step for nothing: the one row of waste per such stop that overlapping costs.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from docproc.engine.sequence import Sequence
from docproc.engine.spec.policy import StepRecord, ended

if TYPE_CHECKING:
    from docproc.engine.model_runner import PendingStep
    from docproc.engine.scheduler import SchedulerOutput

PLACEHOLDER = 0  # a launched step's token in token_ids until the host reads it


class OverlapDecoder:
    def __init__(self, engine, enabled: bool) -> None:  # engine: the LLM that owns it
        self.engine = weakref.proxy(engine)  # no reference cycle: a dropped engine frees its memory at once
        self.enabled = enabled
        self.pending: PendingStep | None = None  # the launched step whose tokens the host has not read
        self.pending_since = 0.0  # when the host last had nothing in flight to wait for
        self.num_steps = 0  # steps launched before the previous step's tokens were read
        self.next_k: int | None = None  # the speculation policy's choice for the next step, made by _continue
        self._early: list[Sequence] = []  # finished while scheduling a step (requests that can never run)
        self._retired: list[Sequence] = []  # out of the running set, stopping at the token being read

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether a scheduled step may be launched without waiting for its tokens: static step
        graphs (the engine's CUDA path), no logits hook, and every unfinished sequence greedy or
        seeded (an unseeded row draws from the engine's generator, whose draws a stopped row's
        wasted row would shift). With a draft, only a decode step of the whole running set
        that the policy bypassed the draft for, with no admission waiting for a free place."""
        eng = self.engine
        runner, sched = eng.runner, eng.scheduler
        if not self.enabled or runner.graphs is None or runner.logits_hook is not None or sched.num_random:
            return False
        if out.failed or out.preempted:
            return False
        if eng.speculator is not None:
            return len(out.decoding) == len(out.scheduled) == len(sched.running) and not (
                sched.waiting and len(sched.running) < sched.max_num_seqs)
        return True

    def start(self, out: SchedulerOutput) -> list[Sequence]:
        """Launch out's step and read it through step()."""
        sched = out.scheduled
        self.pending = self.engine.runner.launch(sched, matchers=self._matchers(sched))
        self.pending_since = self.pending.t0
        return self.step()

    def abort(self) -> None:
        """Forget the step in flight (a step raised); the sequences retired for it finish as aborted
        (the running and waiting ones are the engine's to abort)."""
        for seq in self._retired:
            if not seq.is_finished:
                self.engine.scheduler.finish(seq, "abort")
        self.pending = None
        self.next_k = None
        self._early = []
        self._retired = []

    @staticmethod
    def _matchers(scheduled) -> list | None:
        """The grammar matcher of each sampled row (None for a free row), or None without any."""
        matchers = [c.seq.grammar for c in scheduled if c.needs_sample]
        return matchers if any(m is not None for m in matchers) else None

    def _continue(self, prev: PendingStep) -> PendingStep | None:
        """Schedule and launch the step after `prev` (in flight, tokens unread): prev's chunks count
        as computed, each sequence that samples in prev and goes on holds a placeholder for its
        token, and the decode rows' input ids are prev's tokens on the device. None when no step
        can follow yet (nothing to schedule; with a draft, a step the policy drafts for), with
        the placeholders taken back."""
        eng = self.engine
        sched = eng.scheduler
        spec = eng.speculator
        for c in prev.scheduled:  # (prev's chunks compute before anything queued after them)
            if not c.seq.is_finished:
                c.seq.num_computed_tokens = c.end
        if sched.num_random:  # an unseeded request arrived: the plain loop from here (see can_overlap)
            return None
        source: dict[int, int] = {}  # id(seq) -> its token's index in prev.tokens
        ending = []  # the sequences that stop at prev's token for sure
        for k, i in enumerate(prev.sampled):
            seq = prev.scheduled[i].seq
            if seq.is_finished:
                continue
            if seq.cancelled or seq.num_generated_tokens + 1 >= seq.max_tokens or len(seq) + 1 >= eng.max_model_len:
                ending.append(seq)
            else:
                source[id(seq)] = k
        declined = 0  # sequences whose catch-up would not pay, where the policy drafts
        if spec is not None:
            # only a bypassed decode step of every running sequence, with no admission waiting
            if not source or len(source) != len(sched.running) or (sched.waiting and len(source) < sched.max_num_seqs):
                return None
            going = [prev.scheduled[i].seq for i in prev.sampled if id(prev.scheduled[i].seq) in source]
            spec.policy.batch = len(going)
            k = spec.policy.choose_step([seq.seq_id for seq in going])
            # a step the policy drafts for but where no sequence's catch-up pays is bypassed: it
            # overlaps like any plain step (asked again of the step itself, it would run plainly)
            if k > 0:
                windows, declined = eng.verifier.windows(going, k, ahead=1)
                if windows:
                    self.next_k = k  # the choice stands (a probe's countdown restarted with it)
                    return None
        for seq in ending:  # their places and blocks go to the step after prev
            if seq in sched.running:
                sched.retire(seq)
                self._retired.append(seq)
        placed = [prev.scheduled[i].seq for i in prev.sampled if id(prev.scheduled[i].seq) in source]
        for seq in placed:
            seq.token_ids.append(PLACEHOLDER)
            seq.num_placeholders += 1
        eng.prefetch_waiting()
        out = sched.schedule()
        for seq, why in out.failed:
            seq.stop_reason = why
            sched.finish(seq, "error")
            self._early.append(seq)
        if spec is not None:
            for seq in out.preempted:
                spec.release(seq)
        if out.is_empty:
            for seq in placed:
                seq.token_ids.pop()
                seq.num_placeholders -= 1
            return None
        eng.prefetch(out)
        rows = [(ci, source[id(c.seq)]) for ci, c in enumerate(out.scheduled)
                if c.seq.num_placeholders and c.start == len(c.seq) - 1]
        ids_at = None
        if rows:
            chunks, srcs = zip(*rows)
            same = list(srcs) == list(range(len(prev.sampled)))
            ids_at = (list(chunks), prev.tokens if same else eng.runner.gather_rows(prev.tokens, list(srcs)))
        # rows under a grammar: the forward now, the sampling once their matchers have taken prev's tokens
        constrained = any(c.seq.grammar is not None for c in out.scheduled if c.needs_sample)
        nxt = eng.runner.launch(out.scheduled, ids_at=ids_at, sample=not constrained)
        nxt.overlapped = True
        if spec is not None:
            spec.stats.bypassed_steps += len(out.decoding)
            spec.num_catch_up_skips += declined  # (counted once the step is launched)
            for seq in out.decoding:
                seq.spec_stats.bypassed_steps += 1
        self.num_steps += 1
        return nxt

    def step(self) -> list[Sequence]:
        """Read the tokens of the launched step, having first launched the one after it where it can
        (so the device never waits for the host between them), and append them. A row whose
        sequence stopped before it is dropped."""
        eng = self.engine
        prev = self.pending
        self.pending = None
        nxt = self._continue(prev)
        tokens = eng.runner.collect(prev)
        now = time.perf_counter()
        seconds = now - max(prev.t0, self.pending_since)
        self.pending_since = now
        finished, self._early = self._early, []
        wasted = 0
        for i, token in zip(prev.sampled, tokens):
            seq = prev.scheduled[i].seq
            if seq.is_finished:
                wasted += 1
                continue
            if seq.num_placeholders:  # this token's placeholder
                seq.token_ids.pop()
                seq.num_placeholders -= 1
            if eng.append_token(seq, token, now):
                finished.append(seq)
        self._retired = []  # (each finished at its token)
        if nxt is not None and nxt.tokens is None:
            # the masks of the step in flight, filled while its forward runs, then its sampling
            eng.runner.sample_pending(nxt, [None if nxt.scheduled[i].seq.is_finished else nxt.scheduled[i].seq.grammar
                                            for i in nxt.sampled])
        eng.count_step(prev.num_tokens - wasted, seconds, prev.decode_only)
        if eng.speculator is not None:  # a bypassed step (an overlapped one hid its host work)
            eng.speculator.policy.record(StepRecord(prev.num_tokens, seconds, timed=not prev.captured,
                                                    decode_only=prev.decode_only, overlapped=prev.overlapped,
                                                    ended=ended(finished)))
        if nxt is not None and not all(c.seq.is_finished for c in nxt.scheduled):
            self.pending = nxt  # read by the next step() (nothing else can run before it)
        return finished

