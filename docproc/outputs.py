"""Request outputs returned by LLM.generate (vLLM-shaped), with metrics as a dataclass."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


def ratio(num: int, den: int) -> float | None:
    return num / den if den else None


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
        return ratio(self.accepted, self.proposed)

    @property
    def mean_accepted_length(self) -> float | None:
        """Drafts accepted per verification (each verification also emits one target token)."""
        return ratio(self.accepted, self.verifications)

    def as_dict(self) -> dict:
        return {"draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "verifications": self.verifications, "bypassed_steps": self.bypassed_steps,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "accepted_length_histogram": dict(sorted(self.accepted_hist.items())),
                "k_histogram": dict(sorted(self.k_hist.items()))}


@dataclass
class RequestMetrics:
    """What the engine did for one request. Times are seconds (time.perf_counter based). A request
    with n > 1 sampled outputs runs as n sequences: the counts of work (cached and generated
    tokens, encoded images, preemptions, drafts) add up over them, the prompt's tokens and images
    count once, the first token is the earliest and the total time the longest."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0
    num_images: int = 0
    num_encoded_images: int = 0  # images this request sent through the vision tower
    num_preemptions: int = 0
    time_to_first_token: float | None = None
    total_time: float = 0.0
    finish_reason: str | None = None
    # speculative decoding (zero / empty without a draft)
    draft_proposed: int = 0  # draft tokens proposed for this request
    draft_accepted: int = 0  # of which the target accepted
    draft_verifications: int = 0  # verification steps (each accepts 0..K drafts, plus one target token)
    draft_bypassed_steps: int = 0  # decode steps without the draft (the adaptive policy chose K = 0)
    draft_accepted_length_histogram: dict[int, int] = field(default_factory=dict)  # accepted -> steps
    draft_k_histogram: dict[int, int] = field(default_factory=dict)  # K chosen -> steps

    @property
    def draft_acceptance_rate(self) -> float | None:
        return ratio(self.draft_accepted, self.draft_proposed)

    @property
    def draft_mean_accepted_length(self) -> float | None:
        """Drafts accepted per verification step (the step also emits the target's own token)."""
        return ratio(self.draft_accepted, self.draft_verifications)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error"
    stop_reason: str | int | None = None  # the stop string or EOS id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    error: str | None = None  # set when this request failed alone (e.g. longer than max_model_len)
    extra: dict = field(default_factory=dict)


def merge_samples(runs: list[RequestOutput], n: int) -> RequestOutput:
    """One request's output from the runs of its sequences (SamplingParams.sequences): n runs of
    a sampled request, or one run of a greedy request, whose completion is repeated n times.
    `error` is the first error among the runs (each completion keeps its own finish_reason)."""
    if len(runs) == 1 and n == 1:
        return runs[0]
    first = runs[0]
    outputs = [replace(runs[i % len(runs)].outputs[0], index=i) for i in range(n)]
    if len(runs) == 1:
        return replace(first, outputs=outputs)
    ms = [r.metrics for r in runs]
    merged = {}
    for f in fields(RequestMetrics):
        values = [getattr(m, f.name) for m in ms]
        if f.name in ("num_prompt_tokens", "num_images", "finish_reason"):  # the prompt's, once
            merged[f.name] = values[0]
        elif f.name == "time_to_first_token":
            known = [v for v in values if v is not None]
            merged[f.name] = min(known) if known else None
        elif f.name == "total_time":
            merged[f.name] = max(values)
        elif isinstance(values[0], dict):  # histograms
            hist: dict = {}
            for h in values:
                for k, v in h.items():
                    hist[k] = hist.get(k, 0) + v
            merged[f.name] = dict(sorted(hist.items()))
        else:
            merged[f.name] = sum(values)
    prompt_ids = next((r.prompt_token_ids for r in runs if r.prompt_token_ids), first.prompt_token_ids)
    error = next((r.error for r in runs if r.error is not None), None)
    return RequestOutput(first.request_id, first.prompt, prompt_ids, outputs, RequestMetrics(**merged),
                         first.finished, error, dict(first.extra))
