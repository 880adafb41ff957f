"""The acceptance rule of speculative decoding, batched over a step's sequences.

Leviathan et al. / Chen et al.: the draft proposed d_1..d_k with probabilities q_i; the target
scored the same k + 1 positions in one forward, giving p_1..p_{k+1}. For i = 1..k, accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token drawn from
norm(max(0, p_i - q_i)) and stop; if all k are accepted emit a bonus token drawn from p_{k+1}.
Every emitted token is then distributed exactly as the target's own sampling would be. Greedy
requests are the special case of one-hot p and q: the longest prefix of drafts equal to the
target's argmax, then the target's argmax.

The sampled rule runs on the device: every window's uniforms, the recovery token of every
position (the residual's draw at i <= k, p_{k+1}'s at k + 1) and the accepted count are tensors,
and the host reads all windows of a step in one transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def accept_greedy(top: list[int], draft_tokens: list[int]) -> tuple[list[int], int]:
    """top: the target's argmax at the k + 1 verified positions. Returns (emitted tokens, number
    of drafts accepted)."""
    j = 0
    while j < len(draft_tokens) and draft_tokens[j] == top[j]:
        j += 1
    return draft_tokens[:j] + [top[j]], j


@dataclass
class Window:
    """One sequence's sampled verification: the target's p (k + 1, V) and the draft's q (k, V)
    over the same positions, the proposals and the generator the sequence draws from (None: the
    engine's)."""

    p: torch.Tensor
    q: torch.Tensor
    draft_tokens: list[int]
    generator: torch.Generator | None


def _window_on_device(w: Window) -> torch.Tensor:
    """(k + 2,) int64 on the device: [accepted, emitted_0, ..., emitted_k]; the first accepted + 1
    emitted tokens are the window's output."""
    p, q = w.p, w.q
    k = len(w.draft_tokens)
    dev = p.device
    d = torch.tensor(w.draft_tokens, dtype=torch.long).to(dev, non_blocking=True)  # (k,)
    rows = torch.arange(k, device=dev)
    pd, qd = p[rows, d], q[rows, d]
    u = torch.rand(k, generator=w.generator, device=dev)
    ok = (qd > 0) & (u * qd < pd)  # u < min(1, pd / qd), without dividing by qd
    accepted = ok.long().cumprod(0).sum()  # drafts before the first rejection
    # the token each position emits if it is the first rejected one (or the bonus, at k)
    residual = (p[:k] - q).clamp_min(0)  # (k, V)
    total = residual.sum(-1, keepdim=True)
    dist = torch.cat([torch.where(total > 0, residual / total.clamp_min(1e-30), p[:k]), p[k:k + 1]])  # (k + 1, V)
    e = torch.empty_like(dist).exponential_(generator=w.generator)  # argmax(dist / E) draws from dist
    recovered = (dist / e).argmax(-1)  # (k + 1,)
    keep = torch.arange(k + 1, device=dev) < accepted
    emitted = torch.where(keep, torch.cat([d, d.new_zeros(1)]), recovered)
    return torch.cat([accepted.view(1), emitted])


def accept_sampled_batch(windows: list[Window]) -> list[tuple[list[int], int]]:
    """(emitted tokens, drafts accepted) per window, with one device-to-host transfer for all."""
    if not windows:
        return []
    flat = torch.cat([_window_on_device(w) for w in windows]).tolist()
    out, i = [], 0
    for w in windows:
        k = len(w.draft_tokens)
        accepted = flat[i]
        out.append((flat[i + 1: i + 2 + accepted], accepted))
        i += k + 2
    return out


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int],
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """The rule for one window: p (k + 1, V) target probabilities, q (k, V) the draft's.
    Returns (emitted tokens, number of drafts accepted)."""
    return accept_sampled_batch([Window(p, q, list(draft_tokens), generator)])[0]
