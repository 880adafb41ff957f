"""Request outputs returned by LLM.generate (vLLM-shaped), with metrics as a dataclass."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """What the engine did for one request. Times are seconds (time.perf_counter based)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0
    num_images: int = 0
    num_encoded_images: int = 0  # images this request sent through the vision tower
    num_preemptions: int = 0
    time_to_first_token: float | None = None
    total_time: float = 0.0
    finish_reason: str | None = None
    # speculative decoding (filled by the speculative issue; zero without a draft)
    draft_proposed: int = 0
    draft_accepted: int = 0


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
