"""Sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampled rows use the exponential trick: argmax(p / E) with E ~ Exp(1) draws exactly from p, needs
no cumulative sum and no host sync. A request with a seed draws E from its own generator, so its
output does not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None  # per-request generator when the request has a seed


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on the device, copied from pinned memory without waiting for
    the work queued before it (torch.tensor(..., device=cuda) and indexing with a list copy from
    pageable memory, which makes the host wait for the forward in flight)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside top-k and the top-p nucleus. logits: (B, V); top_k: (B,)
    with V meaning off; top_p: (B,) with 1.0 meaning off."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass before it already reaches top_p (always keep the first)
    cum_before = probs.cumsum(dim=-1) - probs
    drop |= cum_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def probabilities(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each sampled row draws from: (B, V) float32 (greedy rows are one-hot)."""
    vocab = logits.shape[-1]
    dev = logits.device
    temps = on_device([r.temperature if r.temperature > 0 else 1.0 for r in rows], torch.float32, dev)
    x = logits.float() / temps.unsqueeze(1)
    if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
        top_k = on_device([r.top_k if r.top_k > 0 else vocab for r in rows], torch.int64, dev)
        top_p = on_device([r.top_p for r in rows], torch.float32, dev)
        x = filter_logits(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    greedy = [i for i, r in enumerate(rows) if r.temperature == 0]
    if greedy:
        g = on_device(greedy, torch.int64, dev)
        probs[g] = torch.nn.functional.one_hot(logits[g].argmax(-1), vocab).float()
    return probs


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def exponential(self, rows: list[SamplingRow], vocab: int, device) -> torch.Tensor:
        """E ~ Exp(1), (B, V): seeded rows from their own generator, the rest from the engine's."""
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            return torch.empty(len(rows), vocab, device=device).exponential_(generator=self.generator)
        e = torch.empty(len(rows), vocab, device=device)
        if unseeded:
            drawn = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=self.generator)
            e[on_device(unseeded, torch.int64, device)] = drawn
        for i, r in enumerate(rows):
            if r.generator is not None:
                e[i].exponential_(generator=r.generator)
        return e

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits: (B, V) -> token ids (B,) on the logits' device."""
        if all(r.temperature == 0 for r in rows):
            return logits.argmax(dim=-1)
        probs = probabilities(logits, rows)
        sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
        e = self.exponential([rows[i] for i in sampled], logits.shape[-1], logits.device)
        if len(sampled) == len(rows):
            return (probs / e).argmax(dim=-1)
        tokens = logits.argmax(dim=-1)
        index = on_device(sampled, torch.int64, logits.device)
        tokens[index] = (probs[index] / e).argmax(dim=-1)
        return tokens
