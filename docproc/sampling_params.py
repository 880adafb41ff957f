"""SamplingParams: per-request decoding settings (vLLM-shaped), and StructuredOutputsParams: the
form a request's output must take."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON Schema, as a dict or its text: the output is one JSON value
    valid for it), `regex` (the output matches it whole), `choice` (the output is one of these
    strings) or `grammar` (an EBNF grammar in xgrammar's GBNF dialect, its start rule `root`).
    Decoding is constrained token by token (engine/structured.py): every output that ends by
    itself (not by max_tokens) is valid."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of json, regex, choice or grammar, got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON Schema as a dict or its text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if isinstance(self.json, dict):
            try:
                json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"json schema is not JSON: {e}") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) and c
                                                                            for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    def key(self) -> str:
        """A text that names the constraint (equal constraints share one compiled grammar). A
        schema's key order is kept: it is the order the output writes the properties in."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            value = json.dumps(value)
        return f"{self.kind}:{value if isinstance(value, str) else json.dumps(value)}"


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy. top_k -1 and top_p 1.0 disable those filters. `stop` strings end
    the output (the stop string itself is not included in the text). `seed` makes a sampled
    request reproducible whatever else is in the batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.structured_outputs is not None and self.stop:
            raise ValueError("stop strings and structured_outputs do not go together: a stop string would cut the "
                             "constrained output short of valid (the constraint ends the output by itself)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
