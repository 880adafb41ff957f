"""Speculative decoding: the acceptance rule and the adaptive choice of K.

Acceptance (Leviathan et al. / Chen et al.): the draft proposed d_1..d_k with probabilities q_i;
the target scored the same k + 1 positions in one forward, giving p_1..p_{k+1}. For i = 1..k,
accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token drawn
from norm(max(0, p_i - q_i)) and stop; if all k are accepted emit a bonus token drawn from
p_{k+1}. Every emitted token is then distributed exactly as the target's own sampling would be.
Greedy requests are the special case of one-hot p and q: the longest prefix of drafts equal to
the target's argmax, then the target's argmax.

Choice of K: with per-token acceptance rate a, k drafts yield E(a, k) = (1 - a^(k+1)) / (1 - a)
tokens per verification; a step costs 1 + k c target-step units, c = draft step / target step.
The policy picks the k in 0..k_max that maximises E(a, k) / (1 + k c); k = 0 means decode
without the draft, re-probing with k = 1 every `probe_every` steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def expected_tokens(a: float, k: int) -> float:
    """E(a, k): expected tokens per verification with k drafts at acceptance rate a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, c: float, k_max: int, r: float = 0.0) -> int:
    """The k in 0..k_max with the highest expected speedup E(a, k) / (1 + k (c + r)): c is a draft
    step's cost and r the extra cost of each verified position, both relative to a decode step of
    the target (r ~ 0 where decode is memory-bound, as on a GPU; r ~ 1 where the target's step
    time grows with its tokens, as on a CPU)."""
    return max(range(k_max + 1), key=lambda k: (expected_tokens(a, k) / (1.0 + k * (c + r)), -k))


def accept_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> tuple[list[int], int]:
    """target_logits: (k + 1, V). Returns (emitted tokens, number of drafts accepted)."""
    top = target_logits.argmax(-1).tolist()
    j = 0
    while j < len(draft_tokens) and draft_tokens[j] == top[j]:
        j += 1
    return draft_tokens[:j] + [top[j]], j


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # the exponential trick, as in the sampler: argmax(p / E), E ~ Exp(1)
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / e).argmax())


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int],
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """p: (k + 1, V) target probabilities, q: (k, V) draft probabilities of the proposals.
    Returns (emitted tokens, number of drafts accepted)."""
    out: list[int] = []
    for i, d in enumerate(draft_tokens):
        u = torch.rand((), generator=generator, device=p.device).item()
        pd, qd = p[i, d].item(), q[i, d].item()
        if qd > 0 and u < min(1.0, pd / qd):
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        out.append(_draw(residual / total if total > 0 else p[i], generator))
        return out, i
    out.append(_draw(p[len(draft_tokens)], generator))
    return out, len(draft_tokens)


@dataclass
class SpecStats:
    """Speculation figures, per request and per engine."""

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    bypassed_steps: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts per verification
    k_hist: dict[int, int] = field(default_factory=dict)  # k chosen per verification

    def record(self, k: int, accepted: int) -> None:
        self.proposed += k
        self.accepted += accepted
        self.verifications += 1
        self.accepted_hist[accepted] = self.accepted_hist.get(accepted, 0) + 1
        self.k_hist[k] = self.k_hist.get(k, 0) + 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.accepted / self.verifications if self.verifications else None

    def as_dict(self) -> dict:
        return {"draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "verifications": self.verifications, "bypassed_steps": self.bypassed_steps,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "accepted_length_histogram": dict(sorted(self.accepted_hist.items())),
                "k_histogram": dict(sorted(self.k_hist.items()))}


class AdaptiveK:
    """Per-sequence acceptance estimate (exponential moving average over verifications, prior
    `prior`) and the measured draft/target cost ratio c; picks K each step."""

    def __init__(self, k_max: int, fixed: bool, prior: float = 0.7, decay: float = 0.8, probe_every: int = 16):
        self.k_max = k_max
        self.fixed = fixed
        self.prior = prior
        self.decay = decay
        self.probe_every = probe_every
        self.cost_ratio = 0.2  # replaced by measurements as steps run
        self.batch = 1  # sequences decoding this step (set by the engine before it chooses)
        self._acc: dict[int, float] = {}
        self._bypass: dict[int, int] = {}
        self._steps: list[tuple[int, float]] = []  # (tokens in the target's forward, seconds)
        self._fit: tuple[float, float] | None = None  # step seconds = alpha + beta * tokens

    def observe_cost(self, draft_step_s: float, target_step_s: float) -> None:
        if draft_step_s > 0 and target_step_s > 0:
            self.cost_ratio = 0.8 * self.cost_ratio + 0.2 * (draft_step_s / target_step_s)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A target forward's size and time: a least-squares line over the last 64 steps gives
        the fixed and the per-token part of a step's cost."""
        if tokens <= 0 or seconds <= 0:
            return
        self._steps = (self._steps + [(tokens, seconds)])[-64:]
        if len(self._steps) < 8:
            return
        n = len(self._steps)
        mx = sum(x for x, _ in self._steps) / n
        my = sum(y for _, y in self._steps) / n
        vx = sum((x - mx) ** 2 for x, _ in self._steps)
        if vx <= 0:
            return
        beta = max(0.0, sum((x - mx) * (y - my) for x, y in self._steps) / vx)
        self._fit = (max(0.0, my - beta * mx), beta)

    @property
    def verify_cost(self) -> float:
        """r: the extra cost of one more position per decoding sequence, relative to a decode
        step of the current batch (0 until measured)."""
        if self._fit is None:
            return 0.0
        alpha, beta = self._fit
        step = alpha + beta * self.batch
        return beta * self.batch / step if step > 0 else 0.0

    def choose(self, seq_id: int) -> int:
        if self.fixed:
            return self.k_max
        a = self._acc.get(seq_id, self.prior)
        k = best_k(a, self.cost_ratio, self.k_max, self.verify_cost)
        if k == 0:
            n = self._bypass.get(seq_id, 0) + 1
            self._bypass[seq_id] = n
            if n % self.probe_every == 0:
                return 1  # re-probe: acceptance may have recovered
        return k

    def observe(self, seq_id: int, k: int, accepted: int) -> None:
        if k == 0:
            return
        rate = accepted / k
        self._acc[seq_id] = self.decay * self._acc.get(seq_id, self.prior) + (1 - self.decay) * rate

    def forget(self, seq_id: int) -> None:
        self._acc.pop(seq_id, None)
        self._bypass.pop(seq_id, None)
