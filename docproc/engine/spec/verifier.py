"""The target's side of a speculative step: choose each decoding sequence's window, have the
proposer fill it, score every window (the sequence's last token plus its proposals, kept beside
the sequence in Chunk.window) and the step's prefill chunks in one target forward, and accept
with rejection.py's rule.

A window's K/V is written into slots the sequence reserves past its end; after acceptance the
sequence holds its emitted tokens and the block table is cut back to them (a length change: the
rejected positions' K/V is overwritten by later steps).
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from docproc.engine.sampler import probabilities
from docproc.engine.sequence import Chunk, Sequence
from docproc.engine.spec import rejection
from docproc.engine.spec.policy import StepRecord, ended

if TYPE_CHECKING:
    from docproc.engine.llm import LLM
    from docproc.engine.scheduler import SchedulerOutput


class Verifier:
    def __init__(self, engine: LLM) -> None:
        self.engine = weakref.proxy(engine)  # no reference cycle: a dropped engine frees its memory at once

    def step(self, out: SchedulerOutput, windows: list[tuple[Sequence, int]]) -> list[Sequence]:
        """One step with speculation: `windows` (from windows(), not empty) are the sequences that
        draft and their K. A probe's cost (the policy's `probing`) sets how often probes may come:
        it is not timed when it captured a CUDA graph or ran a draft forward of a new kind (one-off
        costs)."""
        spec = self.engine.speculator
        rec = StepRecord()
        before = (self.engine.runner.num_graph_captures, spec.runner.num_graph_captures, len(spec.timed_kinds))
        t0 = time.perf_counter()
        done = self._step(out, windows, rec)
        if spec.policy.probing and before == (self.engine.runner.num_graph_captures, spec.runner.num_graph_captures,
                                              len(spec.timed_kinds)):
            rec.probe_seconds = time.perf_counter() - t0
        spec.policy.record(rec)
        return done

    def windows(self, decoding: list[Sequence], k_step: int, ahead: int = 0) -> tuple[list[tuple[Sequence, int]], int]:
        """(sequence, k) for each of the decoding sequences that would draft this step with the
        policy's K: fewer than k_step where max_tokens, max_model_len or the pool's room ends
        sooner, and none where the policy prices its draft's catch-up (every token the draft has
        not computed: a new page, or what it skipped while bypassed) above what drafting would
        save, or where a probe drafts for another sequence. Nothing is reserved: step() does
        that. ahead: tokens each sequence will hold by then that it does not yet (1 where the
        question is asked while the step before, whose token is unread, is in flight). An empty
        list: the step is a bypassed one (the engine runs it plainly, overlapped where it can).
        Also how many sequences declined their catch-up (the caller counts them in
        num_catch_up_skips once the step is decided)."""
        eng = self.engine
        spec, bm = eng.speculator, eng.block_manager
        catch_up: dict[int, tuple[int, tuple | None]] = {}
        pages: dict[tuple, int] = {}  # sequences this step whose draft would prefill the same page
        explore = None  # while the catch-up cost is unmeasured: the one page this step may prefill
        probe_only = None  # a probe drafts for one sequence: the one with least to catch up
        if not spec.policy.fixed:
            for seq in decoding:
                catch_up[seq.seq_id] = spec.catch_up(seq)
                page = catch_up[seq.seq_id][1]
                if page is not None:
                    pages[page] = pages.get(page, 0) + 1
            if spec.policy.probing and catch_up:
                probe_only = min(catch_up, key=lambda sid: catch_up[sid][0])
        work, declined = [], 0
        taken = 0  # free blocks the windows before this one will take
        for seq in decoding:
            generated, length = seq.num_generated_tokens + ahead, len(seq) + ahead
            k = min(k_step, seq.max_tokens - generated - 1, eng.max_model_len - length - 1, eng.scheduler.lookahead)
            # the window needs target slots; a prompt's last token (not a decode step) may lack them
            need = max(0, bm.num_blocks_for(length + k) - len(seq.block_table)) if k > 0 else 0
            if k > 0 and need + taken > bm.num_free_blocks:
                k = 0
            if probe_only is not None and seq.seq_id != probe_only:
                k = 0
            if k > 0 and seq.seq_id in catch_up:
                tokens, page = catch_up[seq.seq_id]
                share = spec.page_share(page, pages[page]) if page is not None else 1
                sp = seq.sampling
                exact = sp.ignore_eos and not sp.stop and not getattr(sp, "stop_token_ids", None)
                worth = spec.policy.worth_catching_up(seq.seq_id, k, tokens + ahead, share, generated,
                                                      left=seq.max_tokens - generated, exact=exact)
                if worth is None:  # unmeasured: one page (its queries together) to measure it
                    explore = explore or page or (seq.seq_id,)
                    worth = explore in (page, (seq.seq_id,))
                if not worth:
                    k = 0
                    declined += 1
            if k > 0:
                work.append((seq, k))
                taken += need
        return work, declined

    def _reserve(self, out: SchedulerOutput, windows: list[tuple[Sequence, int]]) -> None:
        """Target slots for each window; every other decoding sequence counts a bypassed step."""
        eng = self.engine
        spec = eng.speculator
        drafting = {id(seq) for seq, _ in windows}
        for seq, k in windows:
            eng.block_manager.append_slots(seq, len(seq) + k)
        for s in out.scheduled:
            if s.num_new_tokens == 1 and s.needs_sample and id(s.seq) not in drafting:
                spec.stats.bypassed_steps += 1
                s.seq.spec_stats.bypassed_steps += 1

    def _step(self, out: SchedulerOutput, windows: list[tuple[Sequence, int]], rec: StepRecord) -> list[Sequence]:
        eng = self.engine
        spec, runner = eng.speculator, eng.runner
        self._reserve(out, windows)
        t_draft = spec.draft_seconds
        proposals = spec.propose(windows, rec)
        t_draft = spec.draft_seconds - t_draft
        chunks, props = [], []
        for s in out.scheduled:
            prop = proposals.get(s.seq.seq_id)
            if prop is not None and prop.tokens:
                chunks.append(Chunk(s.seq, s.start, len(s.seq) + len(prop.tokens), tuple(prop.tokens)))
                props.append(prop)
            else:
                chunks.append(s)
                props.append(None)
        t0 = time.perf_counter()
        captures = runner.num_graph_captures
        hidden, meta = runner.forward(chunks)
        # one logits call for the whole step: every verified window and every sequence that
        # samples its next token the plain way
        spans: list[tuple[int, int] | None] = []
        rows: list[int] = []
        for i, (c, prop) in enumerate(zip(chunks, props)):
            lo, hi = meta.query_start[i], meta.query_start[i + 1]
            if prop is not None:
                spans.append((len(rows), hi - lo))
                rows.extend(range(lo, hi))
            elif c.end == len(c.seq):  # prefill finished, or decoding without a draft this step
                spans.append((len(rows), 1))
                rows.append(hi - 1)
            else:
                spans.append(None)
        logits = runner.logits(hidden, rows) if rows else None  # (len(rows), V) fp32
        srows = [runner.sampling_row(c.seq) for c in chunks]
        emitted = self._accept(chunks, props, spans, srows, logits)
        now = time.perf_counter()
        finished: list[Sequence] = []
        for i, (c, prop) in enumerate(zip(chunks, props)):
            seq = c.seq
            if prop is not None:
                tokens, accepted = emitted[i]
                k = len(prop.tokens)
                committed_before = seq.draft.num_committed if seq.draft else 0
                spec.stats.record(k, accepted)
                rec.verified.append((seq.seq_id, k, accepted))
                seq.spec_stats.record(k, accepted)
                spec.after_verify(seq, committed_before, k, accepted)
                done = False
                for tok in tokens:  # EOS, stop strings and max_tokens apply inside the run
                    if eng.append_token(seq, tok, now):
                        done = True
                        break
                if done:
                    finished.append(seq)
                else:
                    seq.num_computed_tokens = len(seq) - 1
                    eng.block_manager.truncate(seq, len(seq))
            else:
                seq.num_computed_tokens = c.end
                if i in emitted and eng.append_token(seq, emitted[i][0][0], now):
                    finished.append(seq)
        t_target = time.perf_counter() - t0
        rec.tokens, rec.seconds, rec.timed = meta.num_tokens, t_target, runner.num_graph_captures == captures
        rec.decode_only = len(out.decoding) == len(out.scheduled)
        rec.ended = ended(finished)
        eng.count_step(meta.num_tokens, t_target + t_draft, False)  # a speculative step: not plain decode
        return finished

    def _accept(self, chunks, props, spans, srows, logits) -> dict[int, tuple[list[int], int]]:
        """Chunk index -> (emitted tokens, drafts accepted) for every verified window and every
        row that samples the plain way (one token, 0 accepted). The host waits for the device
        once for the plain rows and greedy windows together, once for the sampled windows."""
        runner = self.engine.runner
        result: dict[int, tuple[list[int], int]] = {}
        plain = [i for i, p in enumerate(props) if p is None and spans[i] is not None]
        # the step's constrained rows masked in one fill and one apply: a plain row by its
        # grammar's state, a window at each of its positions (lossless, since the rule accepts a
        # proposal only where the masked target gives it mass)
        # (a window takes the draft's masks where it made them: the same grammar states)
        constrained = [(spans[i][0], chunks[i].seq.grammar, None) if p is None else
                       (spans[i][0], chunks[i].seq.grammar, p.tokens, p.masks)
                       for i, p in enumerate(props)
                       if spans[i] is not None and chunks[i].seq.grammar is not None]
        if constrained:
            runner.grammar.mask(logits, constrained)
        if plain:
            rows = logits[[spans[i][0] for i in plain]]
            picked = runner.sampler(rows, [srows[i] for i in plain]).tolist()
            result.update((i, ([t], 0)) for i, t in zip(plain, picked))
        greedy = [i for i, p in enumerate(props) if p is not None and srows[i].temperature == 0]
        if greedy:
            top = logits.argmax(-1).tolist()
            for i in greedy:
                r0, k = spans[i][0], len(props[i].tokens)
                result[i] = rejection.accept_greedy(top[r0: r0 + k + 1], props[i].tokens)
        sampled = [i for i, p in enumerate(props) if p is not None and srows[i].temperature != 0]
        windows = []
        for i in sampled:
            r0, k = spans[i][0], len(props[i].tokens)
            p = probabilities(logits[r0: r0 + k + 1], [srows[i]] * (k + 1))
            windows.append(rejection.Window(p, props[i].probs, props[i].tokens,
                                            chunks[i].seq.generator or runner.sampler.generator))
        result.update(zip(sampled, rejection.accept_sampled_batch(windows)))
        return result
