"""The adaptive choice of K (how many tokens the draft proposes per step).

With per-token acceptance rate a, k drafts yield E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per
verification; a step costs 1 + k (c + r) target-step units, c = draft step / target step, r = the
target's extra cost per verified position. AdaptiveK picks one k in 0..k_max per engine step, for
the whole batch (the draft's k forwards are paid by every sequence of the step); k = 0 means
decode without the draft, re-probing with k = 1 now and then. This module is pure arithmetic over
measured times (no torch).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """E(a, k): expected tokens per verification with k drafts at acceptance rate a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_step_k(accs: list[float], per_k: float, k_max: int, plain: float = 1.0) -> int:
    """The k in 0..k_max for one step of sequences with acceptance rates `accs` that maximises
    sum_i E(a_i, k) / (1 + k per_k) (per_k = c + r in decode-step units; k = 0 yields one token
    per sequence at a cost of `plain` steps: below 1 where plain steps overlap, see
    AdaptiveK.overlap_ratio); the smallest such k on ties."""
    best, best_value = 0, len(accs) / plain
    for k in range(1, k_max + 1):
        value = sum(expected_tokens(a, k) for a in accs) / (1.0 + k * per_k)
        if value > best_value * (1 + 1e-9):
            best, best_value = k, value
    return best


def best_k(a: float, c: float, k_max: int, r: float = 0.0) -> int:
    """best_step_k for one sequence: c is a draft step's cost and r the extra cost of each verified
    position, both relative to a decode step of the target (r ~ 0 where decode is memory-bound, as
    on a GPU; r ~ 1 where the target's step time grows with its tokens, as on a CPU)."""
    return best_step_k([a], c + r, k_max)


class _Line:
    """Least-squares line y = alpha + beta * x over the last `n` points (a flat line at the mean
    while every x is the same). Running sums: O(1) per point on the engine's step path (the
    proportional estimate scans the at most `n` points)."""

    def __init__(self, n: int = 64) -> None:
        self.n = n
        self.points: deque[tuple[float, float]] = deque()
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.fit: tuple[float, float] | None = None
        self.version = 0  # points added so far (a cache of what the line gives is keyed on it)

    def _update(self, x: float, y: float, sign: float) -> None:
        self._sx += sign * x
        self._sy += sign * y
        self._sxx += sign * x * x
        self._sxy += sign * x * y

    def add(self, x: float, y: float) -> None:
        if x <= 0 or y <= 0:
            return
        self.points.append((x, y))
        self.version += 1
        self._update(x, y, 1.0)
        if len(self.points) > self.n:
            self._update(*self.points.popleft(), -1.0)
        m = len(self.points)
        if m < 4:
            return
        mx, my = self._sx / m, self._sy / m
        vx = self._sxx - m * mx * mx
        # (a spread of x below rounding noise counts as none: the flat line at the mean)
        beta = max(0.0, (self._sxy - m * mx * my) / vx) if vx > 1e-9 * max(1.0, self._sxx) else 0.0
        self.fit = (max(0.0, my - beta * mx), beta)

    def at(self, x: float) -> float | None:
        if self.fit is None:
            return None
        alpha, beta = self.fit
        return alpha + beta * x

    def proportional(self, x: float) -> float | None:
        """y proportional to x at the smallest ratio y / x seen so far (None without any points):
        one-off costs (a kernel compiled, a page faulted in) only ever inflate a time."""
        if not self.points:
            return None
        return x * min(y / px for px, y in self.points)

    def at_or_proportional(self, x: float) -> float | None:
        """at(x), or before four points the proportional estimate."""
        return self.at(x) if self.fit is not None else self.proportional(x)


@dataclass
class StepRecord:
    """What one engine step tells the policy (AdaptiveK.record), built by the step that ran:
    a plain step (LLM), an overlapped one (engine/overlap.py) or a speculative one (verifier.py)."""

    tokens: int = 0  # the target forward's query tokens
    seconds: float = 0.0  # its time (a speculative step's target forward alone, the draft's apart)
    timed: bool = True  # no CUDA graph was captured inside it: its seconds are the step's own
    decode_only: bool = False  # every row decoded or verified (no prefill chunk)
    overlapped: bool = False  # queued before the tokens of the step before it were read
    draft_decodes: list[tuple[int, float]] = field(default_factory=list)  # (sequences, seconds) a forward
    draft_catch_ups: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) a forward
    verified: list[tuple[int, int, int]] = field(default_factory=list)  # (sequence id, k, accepted)
    probe_seconds: float | None = None  # a probe step's whole time, draft and target
    # (sequence id, tokens generated) of each sequence that ended in the step; None for one that
    # failed (its length says nothing of what requests generate)
    ended: list[tuple[int, int | None]] = field(default_factory=list)


def ended(finished) -> list[tuple[int, int | None]]:
    """StepRecord.ended for a step's finished sequences."""
    return [(s.seq_id, None if s.finish_reason == "error" else s.num_generated_tokens) for s in finished]


class AdaptiveK:
    """Chooses one K per engine step for all decoding sequences.

    A step's cost does not split per sequence: when any sequence drafts K tokens the draft runs
    K forwards and every sequence waits for them (on a GPU a forward costs about the same for 1 or
    16 sequences). So the policy scores each K for the whole batch: sum over sequences of
    E(a_i, K), over the step's cost 1 + K (c + r) in plain-decode-step units, against 1 per
    sequence for K = 0 (no draft). a_i: each sequence's acceptance (exponential moving average over
    its verifications; sequences without one use the running average over all verifications).
    c: the draft's decode forward over the target's decode step at this batch size, and r: the
    target's extra time per verified position, both from least-squares lines over measured steps
    (c uses `cost_ratio`'s set value until the draft has been timed). When K = 0 wins the engine
    decodes without the draft and re-probes with K = 1 after `probe_every` steps, doubling that
    interval (up to 16x) while probes keep confirming the bypass, and never sooner than the
    measured cost of a probe allows (`observe_probe`: probing costs at most 1% of the bypassed
    decode time). A probe drafts for one sequence only, the one whose draft has least to catch up. When the measured costs say no K could pay
    even if every draft were accepted (c + r >= 1: a draft as slow as the target, as two tiny
    models are on a GPU, where a step's fixed costs dominate), probing starts at the longest
    interval and keeps doubling it without bound: each probe costs the draft a catch-up prefill of
    everything it skipped, and can only re-measure costs that already rule it out.

    That catch-up is priced too (`worth_catching_up`): before a sequence drafts, the draft must
    compute every token it has not seen (a new page's ~1,300 prompt tokens, or what it skipped
    while bypassed); a sequence drafts only if its expected saving over its remaining tokens pays
    for that forward (shared by the sequences with the same page)."""

    def __init__(self, k_max: int, fixed: bool, prior: float = 0.7, decay: float = 0.8, probe_every: int = 16):
        self.k_max = k_max
        self.fixed = fixed
        self.prior = prior
        self.decay = decay
        self.probe_every = probe_every
        self.batch = 1  # sequences decoding this step (set by the engine before it chooses)
        self._c_prior = 0.2  # the cost ratio until the draft's forwards are measured
        self._acc: dict[int, float] = {}
        self._acc_st: dict[int, tuple[float, float]] = {}  # (accepted, tried) moving averages (observe)
        self._global = prior  # acceptance over all verifications: the prior of new sequences
        self._global_st = (prior, 1.0)
        self._observations = 0  # verifications seen since the start or reset_acceptance()
        self._target = _Line()  # target forward seconds vs tokens in it (decode/verify steps)
        self._any_step = _Line()  # the same over every target step, prefill chunks included
        self._draft = _Line()  # draft decode forward seconds vs sequences in it
        self._since_probe = 0
        self._probe_interval = probe_every
        self._draft_prefill = _Line()  # draft catch-up forward seconds vs tokens in it
        self._generated = 32.0  # tokens a request generates (moving average; a prior until one finishes)
        self.probing = False  # this step's K is a probe (its cost is bounded by the probe interval)
        # the highest acceptance any sequence may be scored with (None: to recompute), for
        # choose_step's fast path: on a GPU with small models a decode step is ~0.3 ms of host
        # time, and scoring every K for every sequence each step cost ~5% of it
        self._a_hi: float | None = None
        self._per_k_key: tuple | None = None  # what _per_k was computed from
        self._per_k = 0.0
        self._measured = False
        self._bypassing = False  # the last choice was K = 0 (not a probe)
        self._skipped = 0  # target steps not fed to its line while bypassing (one in 8 is)
        # probes are priced too: a probe step's measured time over a plain step's (the draft's
        # catch-up of what it skipped, its forward, the wider verify) is spread over at least
        # enough bypassed steps that probing costs at most `probe_budget` of the decode time
        self.probe_budget = 0.01
        self._probe_extra: deque[float] = deque(maxlen=5)  # the last probes' extra seconds
        self._probe_floor = 0.0  # bypassed steps between probes that keep them within budget
        # bypassed steps that overlap (the engine queues the next one before reading the tokens
        # of the one in flight: engine/overlap.py) cost less than the target's line says, which
        # is fitted to steps with the host's work in them (verifications always are): their time
        # over the line's, the median of the last 16 (1.0 until one is seen)
        self._overlap: deque[float] = deque(maxlen=16)

    # ---- measurements ----------------------------------------------------------------------------
    def record(self, rec: StepRecord) -> None:
        """One step's measurements, in the order they happened: the draft's forwards, the
        verifications, the target's forward (a plain or verifying step feeds the target's lines,
        prefill chunks only the any-step line; an overlapped step the overlap ratio; none that
        captured a graph), a probe's cost, and the sequences that ended (forgotten, and their
        lengths kept)."""
        for seqs, seconds in rec.draft_decodes:
            self.observe_draft_forward(seqs, seconds)
        for tokens, seconds in rec.draft_catch_ups:
            self.observe_draft_prefill(tokens, seconds)
        for seq_id, k, accepted in rec.verified:
            self.observe(seq_id, k, accepted)
        if rec.timed and rec.tokens:
            if rec.overlapped:
                if rec.decode_only:
                    self.observe_overlapped_step(rec.tokens, rec.seconds)
            else:
                self.observe_any_step(rec.tokens, rec.seconds)
                if rec.decode_only:
                    self.observe_step(rec.tokens, rec.seconds)
        if rec.probe_seconds is not None:
            self.observe_probe(rec.probe_seconds)
        for seq_id, generated in rec.ended:
            self.forget(seq_id)
            if generated is not None:
                self.observe_finished(generated)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A target forward's size and time. While the draft is bypassed only one step in 8 is
        kept: the steps are all alike then, and each kept point costs the host ~2 us of a step
        that can be ~0.3 ms in all."""
        if self._bypassing:
            self._skipped = (self._skipped + 1) & 7
            if self._skipped:
                return
        self._target.add(tokens, seconds)

    def observe_overlapped_step(self, tokens: int, seconds: float) -> None:
        """A bypassed decode step that overlapped the one before it: not a point of the target's
        line (its host work is hidden), but how much cheaper than the line plain decoding is."""
        step = self._target.at(tokens)
        if step:
            self._overlap.append(min(1.0, seconds / step))

    @property
    def overlap_ratio(self) -> float:
        """An overlapped plain step's time over the target line's at its size (<= 1)."""
        if not self._overlap:
            return 1.0
        return max(0.05, sorted(self._overlap)[len(self._overlap) // 2])

    def observe_draft_forward(self, seqs: int, seconds: float) -> None:
        """A draft forward that decoded (at most two tokens per sequence) for `seqs` sequences."""
        self._draft.add(seqs, seconds)

    def observe_any_step(self, tokens: int, seconds: float) -> None:
        """Any target forward (prefill chunks too): the fallback for pricing a catch-up while no
        pure decode step has been timed (a pipeline run mixes prefill into its steps for long);
        unused, so not kept, once decode steps are."""
        if self._target.fit is None:
            self._any_step.add(tokens, seconds)

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        """A draft forward that caught up (more than two tokens for some sequence)."""
        self._draft_prefill.add(tokens, seconds)

    def observe_probe(self, seconds: float) -> None:
        """A probe step's wall time (draft and target): sets the least probe interval that keeps
        probing within `probe_budget` of the bypassed steps' time (from the median of the last
        five probes: a one-off, such as a kernel compiled on the first, weighs little)."""
        step = self._target.at(self.batch)
        if not step:
            return
        self._probe_extra.append(max(0.0, seconds - step))
        extra = sorted(self._probe_extra)[len(self._probe_extra) // 2]
        self._probe_floor = extra / (self.probe_budget * step)

    def observe_finished(self, num_generated: int) -> None:
        self._generated = 0.9 * self._generated + 0.1 * num_generated

    def worth_catching_up(self, seq_id: int, k: int, tokens: int, share: int, generated: int,
                          left: int | None = None, exact: bool = False) -> bool | None:
        """Whether a sequence should draft k tokens this step when the draft must first compute
        `tokens` tokens it has not seen, a cost shared by `share` sequences (the same page): its
        expected saving over the rest of its output, (remaining tokens) x (its share of a decode
        step) x (1 - 1 / gain), gain = E(a, k) / (1 + k (c + r)), must repay that forward. None
        while the costs are unmeasured (the engine then lets one page per step go, to measure).
        Remaining tokens: `left` (what max_tokens still allows) when the sequence cannot stop
        earlier (`exact`: EOS ignored, no stop strings), else the running average of finished
        requests' lengths less what it has generated, at most `left`. Also None while no
        verification has been seen and only the best case (every draft accepted) repays: one page
        then explores (below)."""
        if self.fixed or self.probing or tokens <= 2:
            return True
        if self._target.fit is not None:
            step = self._target.at(self.batch)
            r = self._target.fit[1] * self.batch / step if step else 0.0
        else:
            # every step so far, prefill chunks included, priced per token: a pipeline's first
            # steps are all about the same size, so a fitted line would be flat at their mean
            # (seconds) and call a 7-token decode step as costly as an 8,192-token prefill. On a
            # GPU this underestimates a decode step (fixed costs dominate it): conservative
            step = self._any_step.proportional(self.batch)
            r = 1.0
        cost = self._draft_prefill.at_or_proportional(tokens)
        if not step or cost is None:
            return None
        draft = self._draft.at(self.batch)
        c = draft / step if draft is not None else self._c_prior
        if exact and left is not None:
            remaining = max(1.0, float(left))
        else:
            remaining = max(1.0, self._generated - generated)
            if left is not None:
                remaining = min(remaining, max(1.0, float(left)))

        def repays(a: float) -> bool:
            gain = self.overlap_ratio * expected_tokens(a, k) / (1.0 + k * (c + r))
            return gain > 1.0 and remaining * step / self.batch * (1.0 - 1.0 / gain) * max(1, share) >= cost

        if repays(self._acc.get(seq_id, self._global)):
            return True
        if self._observations or seq_id in self._acc:
            return False
        # No verification seen yet (a fresh engine, or reset_acceptance): the acceptance scored is
        # only the prior, so a "no" is a guess. If every draft being accepted would repay the
        # catch-up, answer None: the engine lets one page go (as while costs are unmeasured), and
        # its verifications replace the prior. Without this a prior that barely fails keeps the
        # draft out for good, since probes are spaced by their price (a 7B/2B run at a = 0.9
        # bypassed every step so: BENCHMARKS.md, part c with the acceptance reset).
        return None if repays(1.0) else False

    def observe(self, seq_id: int, k: int, accepted: int) -> None:
        """A verification of k drafts that accepted the first `accepted`. The acceptance a that
        E(a, K) = 1 + a + ... + a^K is written in is the chance that a position is accepted once
        those before it were: positions tried are the accepted ones plus the first rejected one
        (none if all k passed), so a = accepted / tried, each as a moving average (per sequence,
        and over all). (accepted / k, the share of drafts kept, is lower: at a = 0.9 and K = 4 it
        is 0.77, which made E(a, 4) 3.0 instead of 4.1 and the policy bypass drafts that pay.)"""
        if k == 0:
            return
        self._observations += 1
        tried = accepted + (1 if accepted < k else 0)
        s0, t0 = self._acc_st.get(seq_id, (self._global, 1.0))
        s1 = self.decay * s0 + (1 - self.decay) * accepted
        t1 = self.decay * t0 + (1 - self.decay) * tried
        self._acc_st[seq_id] = (s1, t1)
        self._acc[seq_id] = s1 / t1
        gs, gt = self._global_st
        self._global_st = (0.95 * gs + 0.05 * accepted, 0.95 * gt + 0.05 * tried)
        self._global = self._global_st[0] / self._global_st[1]
        self._a_hi = None

    def reset_acceptance(self) -> None:
        """Forget every acceptance seen (back to the prior) and restart probing, keeping the
        measured costs: a benchmark that changes the draft's acceptance between passes (bench_engine
        part c) starts each from what a fresh engine would believe."""
        self._acc.clear()
        self._acc_st.clear()
        self._global, self._global_st = self.prior, (self.prior, 1.0)
        self._observations = 0
        self._a_hi = None
        self._since_probe, self._probe_interval = 0, self.probe_every

    def forget(self, seq_id: int) -> None:
        self._acc_st.pop(seq_id, None)
        if self._acc.pop(seq_id, None) is not None:
            self._a_hi = None

    def _could_pay(self, a: float, per_k: float, rho: float) -> bool:
        """Whether some K pays for a sequence with acceptance a: rho E(a, K) > 1 + K per_k. With
        rho = 1 that is a > per_k (k = 1 is where the mean of a, ..., a^k peaks); below 1 a
        longer K may be the one that pays, so every K is tried."""
        if rho >= 1.0:
            return a > per_k
        return any(rho * expected_tokens(a, k) > 1.0 + k * per_k for k in range(1, self.k_max + 1))

    def _bypass_bound(self) -> float:
        """The highest acceptance a sequence is scored with. A step whose cost per draft position
        (c + r) is at least that is bypassed: a sequence with acceptance a gains from k drafts
        only if E(a, k) - 1 = a + a^2 + ... + a^k > k (c + r), and that mean of a, ..., a^k is
        largest at k = 1, where it is a."""
        if self._a_hi is None:
            self._a_hi = max(self._global, max(self._acc.values(), default=0.0))
        return self._a_hi

    def state(self, catch_up_tokens: int = 1024) -> dict:
        """What the policy believes now, for reports (`LLM.spec_info()["policy"]`): why a draft is or
        is not used. per_k: c + r per draft position (None until choose_step has run); the overlap
        ratio; the acceptance it scores new sequences with (global) and the highest any sequence
        has (a_hi); the probe interval and floor (bypassed steps between probes); the target's
        decode step (seconds) and the draft's catch-up forward for `catch_up_tokens` tokens
        (seconds, None until measured); the running average of a request's generated tokens."""
        step = self._target.at(self.batch) if self._target.fit is not None else None
        cost = self._draft_prefill.at_or_proportional(catch_up_tokens)
        return {"fixed": self.fixed, "per_k": None if self._per_k_key is None else round(self._per_k, 4),
                "overlap_ratio": round(self.overlap_ratio, 4), "acceptance_global": round(self._global, 4),
                "acceptance_hi": round(self._bypass_bound(), 4), "sequences_scored": len(self._acc),
                "probe_interval": self._probe_interval, "probe_floor": round(self._probe_floor, 1),
                "target_step_s": None if not step else round(step, 6),
                "catch_up_tokens": catch_up_tokens, "catch_up_s": None if cost is None else round(cost, 6),
                "generated_tokens_avg": round(self._generated, 1)}

    # ---- costs -----------------------------------------------------------------------------------
    @property
    def cost_ratio(self) -> float:
        """c at the current batch size: draft decode forward / target decode step."""
        d, t = self._draft.at(self.batch), self._target.at(self.batch)
        if d is None or not t:
            return self._c_prior
        return d / t

    @property
    def costs_measured(self) -> bool:
        """Whether c comes from timed draft and target forwards (not the prior)."""
        return self._draft.at(self.batch) is not None and bool(self._target.at(self.batch))

    @cost_ratio.setter
    def cost_ratio(self, value: float) -> None:
        self._c_prior = value

    @property
    def verify_cost(self) -> float:
        """r: the extra cost of one more position per decoding sequence, relative to a decode
        step of the current batch (0 until measured)."""
        step = self._target.at(self.batch)
        if not step:
            return 0.0
        return self._target.fit[1] * self.batch / step

    # ---- the choice ------------------------------------------------------------------------------
    def choose_step(self, seq_ids: list[int]) -> int:
        """K for this step's decoding sequences (0: decode without the draft)."""
        self.probing = self._bypassing = False
        if self.fixed:
            return self.k_max
        if not seq_ids:
            return 0
        b = self.batch
        key = (self._target.version, self._draft.version, b, self._c_prior)
        if key != self._per_k_key:  # c + r, recomputed only when a line or the batch changed
            draft, step = self._draft.at(b), self._target.at(b)
            self._measured = draft is not None and bool(step)  # c from timed forwards, not the prior
            if not self._measured:
                self._per_k = self._c_prior + (self._target.fit[1] * b / step if step else 0.0)
            else:
                self._per_k = (draft + self._target.fit[1] * b) / step
            self._per_k_key = key
        per_k = self._per_k
        rho = self.overlap_ratio
        if not self._could_pay(self._bypass_bound(), per_k, rho):  # no sequence's K pays
            best = 0
        else:
            best = best_step_k([self._acc.get(s, self._global) for s in seq_ids], per_k, self.k_max, rho)
        if best > 0:
            self._since_probe, self._probe_interval = 0, self.probe_every
            return best
        hopeless = self._measured and not self._could_pay(1.0, per_k, rho)  # no K pays at any acceptance
        if hopeless:
            self._probe_interval = max(self._probe_interval, 16 * self.probe_every)
        self._since_probe += 1
        if self._since_probe >= self._probe_interval and self._since_probe >= self._probe_floor:
            # acceptance (or the costs) may have changed
            self._since_probe = 0
            # while probes confirm the bypass the interval doubles: up to 16x probe_every, and
            # without bound while the costs alone rule the draft out (a probe there can only
            # re-measure the costs, so over a run its price must vanish)
            cap = float("inf") if hopeless else 16 * self.probe_every
            self._probe_interval = min(cap, 2 * self._probe_interval)
            self.probing = True
            return 1
        self._bypassing = True
        return 0

    def choose(self, seq_id: int) -> int:
        """The choice for a single decoding sequence."""
        return self.choose_step([seq_id])
