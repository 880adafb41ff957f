"""The draft side of a speculative step: keep the draft's cache in step with each sequence, and
propose up to K tokens per decoding sequence (K forward passes of the draft, batched over
sequences). The target scores and accepts them in verifier.py."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from docproc.engine.block_manager import BlockManager
from docproc.engine.model_runner import ModelRunner, inference
from docproc.engine.sampler import probabilities
from docproc.engine.sequence import Chunk, Sequence
from docproc.engine.spec.draft import DraftView, draft_prompt
from docproc.engine.spec.policy import AdaptiveK, StepRecord
from docproc.outputs import SpecStats


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # (k, V) draft distributions the tokens were drawn from; None if greedy
    # a constrained sequence's grammar mask of each round (host rows; None where it had none):
    # the verification's masks at those positions, in the same grammar states
    masks: list | None = None


class Proposer:
    def __init__(self, runner: ModelRunner, k_max: int, adaptive: bool, vision: str, image_token_id: int,
                 enable_prefix_caching: bool, target_vocab: int | None = None) -> None:
        self.runner = runner
        # Same tokenizer, but the embedding tables may be padded differently (Qwen2-VL-7B has 152064
        # rows, 2B 151936): the draft proposes only ids the target has, its distributions are
        # padded/cut to the target's width, and ids it has no row for are clamped on its input
        # (a trained target never emits them; a random one may)
        self.draft_vocab = runner.text_config.vocab_size
        self.target_vocab = target_vocab or self.draft_vocab
        if self.target_vocab > self.draft_vocab:
            runner.max_input_id = self.draft_vocab - 1
        self.k_max = k_max
        self.vision = vision
        self.image_token_id = image_token_id
        self.block_manager = BlockManager(runner.num_usable_blocks, runner.block_size, enable_prefix_caching)
        self.policy = AdaptiveK(k_max, fixed=not adaptive)
        self.stats = SpecStats()
        # greedy proposal rounds chained on the device (see propose); off: one sync per round
        self.chain_greedy = True
        self.num_chained_rounds = 0  # proposal rounds whose input token stayed on the device
        self.draft_seconds = 0.0
        self.timed_kinds: set[str] = set()  # forward kinds run once already (later ones are timed)
        self.num_catch_up_skips = 0  # sequence-steps not drafted because the catch-up would not pay
        self.grammar = None  # the target's GrammarCompiler once a request is constrained (structured.py)
        # pages whose tokens the draft has computed (its prefix cache holds them unless evicted):
        # a new query of such a page catches up only its own text
        self.seen_images: set[str] = set()
        # queries so far per page the draft has not computed: a page asked about before will
        # likely be asked about again, so its prefill is shared by those queries too
        self.page_queries: dict[tuple[str, ...], set[int]] = {}

    def catch_up(self, seq: Sequence) -> tuple[int, tuple[str, ...] | None]:
        """(tokens the draft must compute before it can propose for seq, the key of the page
        whose prefill that is, or None when the page is already in the draft's cache)."""
        v = seq.draft
        if v is not None and v.block_table:
            return len(v) - v.num_computed_tokens, None
        images = [] if self.vision == "none" else seq.images
        prompt = seq.num_prompt_tokens - (sum(im.num_tokens for im in seq.images) if self.vision == "none" else 0)
        total = prompt + seq.num_generated_tokens
        if not images:
            return total, None
        key = tuple(im.content_hash for im in images)
        if all(h in self.seen_images for h in key):
            cached = images[-1].end // self.runner.block_size * self.runner.block_size
            return total - cached, None
        self.page_queries.setdefault(key, set()).add(seq.seq_id)
        while len(self.page_queries) > 4096:  # bounded: forget the oldest pages
            del self.page_queries[next(iter(self.page_queries))]
        return total, key

    def page_share(self, key: tuple[str, ...], concurrent: int) -> int:
        """How many queries a page's prefill for the draft is shared by: those decoding with it
        now, or all queries of it seen so far if more (queries of a page often come one by one)."""
        return max(concurrent, len(self.page_queries.get(key, ())))

    def view(self, seq: Sequence) -> DraftView:
        if seq.draft is None:
            prompt, images, mm = draft_prompt(seq, self.vision, self.image_token_id)
            seq.draft = DraftView(seq, prompt, images, mm)
        return seq.draft

    def release(self, seq: Sequence, failed: bool = False) -> None:
        """Free the draft's blocks (finished or preempted sequence; failed: its step raised, so
        its blocks leave the prefix cache as well, BlockManager.discard)."""
        if seq.draft is not None and seq.draft.block_table:
            (self.block_manager.discard if failed else self.block_manager.deallocate)(seq.draft)
        seq.draft = None
        self.policy.forget(seq.seq_id)

    def _reserve(self, v: DraftView, k: int) -> bool:
        bm = self.block_manager
        v.proposals = []
        if not v.block_table:
            if not bm.can_allocate(v):
                return False
            bm.allocate(v)  # prefix hits in the draft's own cache
        if not bm.can_append(v, v.num_committed + k):
            return False
        bm.append_slots(v, v.num_committed + k)
        self.seen_images.update(im.content_hash for im in v.images)
        self.page_queries.pop(tuple(im.content_hash for im in v.images), None)
        # this step's first draft forward computes every committed token: register their full
        # blocks now, so that later sequences with the same prefix (the other queries of a page)
        # hit them, as the target's scheduler does (never proposals: they may be rolled back)
        bm.commit(v, v.num_committed)
        return True

    @inference
    def propose(self, work: list[tuple[Sequence, int]], rec: StepRecord) -> dict[int, Proposal]:
        """Up to k proposals for each (sequence, k); sequences whose draft cache has no room get none.
        The forwards' times go into the step's record.

        Greedy rounds are chained on the device where the draft's steps run on its static graph
        path and every sequence drafts the same k: round r + 1 reads round r's argmax straight
        from the device (GraphRunner.run's ids_from) and the host, instead of waiting for those
        tokens, prepares the next round while the device runs this one; all tokens are read in one
        transfer after the last round. Unchained, each round waited for its tokens (a device sync
        per proposal)."""
        t0 = time.perf_counter()
        active = [(seq, self.view(seq), k) for seq, k in work if k > 0]
        active = [(seq, v, k) for seq, v, k in active if self._reserve(v, k)]
        out = {seq.seq_id: Proposal([], None) for seq, _, _ in active}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _, _ in active}
        runner = self.runner
        greedy = all(runner.sampling_row(v).temperature == 0 for _, v, _ in active)
        # a constrained sequence proposes under its grammar: its matcher advances through this
        # step's proposals (rolled back at the end), so each round's mask needs the last token
        # on the host: such steps are not chained
        matchers = {seq.seq_id: seq.grammar for seq, _, _ in active if seq.grammar is not None}
        advanced = dict.fromkeys(matchers, 0)
        chain = (self.chain_greedy and greedy and runner.graphs is not None and not matchers
                 and len({k for _, _, k in active}) == 1)
        pending: list[tuple[list, torch.Tensor]] = []  # chained rounds: (live, tokens on the device)
        chain_t0, chain_captures, chain_count = 0.0, 0, 0  # the chain's start and rounds since
        rounds = max((k for _, _, k in active), default=0)
        for r in range(rounds):
            live = [(seq, v) for seq, v, k in active if k > r]
            chunks = [Chunk(v, v.num_computed_tokens, len(v)) for _, v in live]
            t_fwd = time.perf_counter()
            captures = runner.num_graph_captures
            done = None
            if pending:
                done = runner.forward(chunks, ids_from=pending[-1][1])
                if done is None:  # not a graph step after all: read the tokens, then as unchained
                    self._read_chained(pending, out)
                    pending = []
            hidden, meta = done if done is not None else runner.forward(chunks)
            logits = runner.logits(hidden, [meta.query_start[i + 1] - 1 for i in range(len(live))])
            if self.draft_vocab > self.target_vocab:
                logits = logits[:, : self.target_vocab]
            # a catch-up chunk of more than 2 tokens (priced as a prefill) is not chained: its
            # time is its own, read after it
            if chain and r + 1 < rounds and max(c.num_new_tokens for c in chunks) <= 2:
                if not pending:
                    chain_t0, chain_captures, chain_count = t_fwd, captures, 0
                chain_count += 1
                pending.append((live, logits.argmax(-1)))
                for _, v in live:
                    v.num_computed_tokens = len(v)
                    v.proposals.append(0)  # a placeholder until _read_chained: the device has the token
                continue
            if matchers:
                kept = self.grammar.mask_rows(logits, [self._next_mask(matchers.get(seq.seq_id)) for seq, _ in live],
                                              keep=True)
                for i, (seq, _) in enumerate(live):
                    if seq.seq_id in matchers:
                        prop = out[seq.seq_id]
                        prop.masks = (prop.masks or []) + [kept.get(i)]
            rows = [runner.sampling_row(v) for _, v in live]
            if all(row.temperature == 0 for row in rows):
                tok_dev = logits.argmax(-1)
                if pending:  # the chain's rounds and this one in one transfer
                    *chained, tokens = torch.stack([t for _, t in pending] + [tok_dev]).tolist()
                    self._read_chained(pending, out, chained)
                else:
                    tokens = tok_dev.tolist()
                p = None
            else:
                p = probabilities(logits, rows)
                e = runner.sampler.exponential(rows, logits.shape[-1], logits.device)
                tokens = (p / e).argmax(-1).tolist()
                if self.target_vocab > p.shape[-1]:  # no mass on the ids the draft lacks
                    p = torch.nn.functional.pad(p, (0, self.target_vocab - p.shape[-1]))
            # (both branches waited for the device in .tolist(): the time below is the forward's)
            # timed unless it captured a CUDA graph or is the draft's first forward of its kind on
            # this engine (that one may compile kernels: seconds that would price every later
            # catch-up out); a chain's rounds share its time equally
            kind = "decode" if max(c.num_new_tokens for c in chunks) <= 2 else "prefill"
            n_chained = chain_count if chain else 0
            if n_chained:
                t_fwd, captures = chain_t0, chain_captures
            if runner.num_graph_captures == captures and kind in self.timed_kinds:
                if kind == "decode":
                    per = (time.perf_counter() - t_fwd) / (n_chained + 1)
                    rec.draft_decodes += [(len(chunks), per)] * (n_chained + 1)
                else:
                    rec.draft_catch_ups.append((sum(c.num_new_tokens for c in chunks), time.perf_counter() - t_fwd))
            self.timed_kinds.add(kind)
            for i, ((seq, v), tok) in enumerate(zip(live, tokens)):
                v.num_computed_tokens = len(v)
                v.proposals.append(tok)
                out[seq.seq_id].tokens.append(tok)
                if p is not None:
                    probs[seq.seq_id].append(p[i])
                m = matchers.get(seq.seq_id)
                if m is not None and not m.is_terminated() and m.accept_token(tok):
                    advanced[seq.seq_id] += 1
        for sid, n in advanced.items():
            if n:
                matchers[sid].rollback(n)
        for sid, ps in probs.items():
            if ps:
                out[sid].probs = torch.stack(ps)
        self.draft_seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def _next_mask(matcher):
        """The matcher to mask a round's row with: None past the grammar's end (what the draft
        proposes after a stop token is never used)."""
        return None if matcher is None or matcher.is_terminated() else matcher

    def _read_chained(self, pending: list[tuple[list, torch.Tensor]], out: dict[int, Proposal],
                      rows: list[list[int]] | None = None) -> None:
        """Chained rounds' tokens (read from the device in one transfer unless given) into the
        step's proposals and in place of the views' placeholders (round r's token is proposal r)."""
        if rows is None:
            rows = torch.stack([t for _, t in pending]).tolist()
        self.num_chained_rounds += len(pending)
        for (live, _), toks in zip(pending, rows):
            for (seq, v), tok in zip(live, toks):
                v.proposals[len(out[seq.seq_id].tokens)] = tok
                out[seq.seq_id].tokens.append(tok)

    def after_verify(self, seq: Sequence, committed_before: int, k: int, accepted: int) -> None:
        """Roll the draft back to what is still valid: its K/V covers the committed tokens and the
        first k - 1 proposals, of which the first `accepted` matched."""
        v = seq.draft
        if v is None:
            return
        v.proposals = []
        v.num_computed_tokens = min(v.num_computed_tokens, committed_before + min(k - 1, accepted))
        self.block_manager.truncate(v, v.num_computed_tokens)
