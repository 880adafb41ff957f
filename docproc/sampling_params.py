"""SamplingParams: per-request decoding settings (vLLM-shaped), and StructuredOutputsParams: the
form a request's output must take."""
from __future__ import annotations

import functools
import json
import math
import numbers
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from docproc.json_finite import endless

# The checks below raise ValueError for a value of the wrong type as for one out of range, as vLLM
# does: one `except ValueError` catches every bad argument. An unknown keyword is a TypeError, as
# Python makes it for any function.


def shown(value: Any) -> str:
    """A value for an error message: its repr (cut at 60 characters) and its type."""
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"


def whole_number(owner: str, name: str, value: Any, minimum: int | None = None, optional: bool = False) -> int | None:
    """value as an int (a bool is not a whole number here); ValueError naming owner.name."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{owner}.{name} must be a whole number{bound}{' or None' if optional else ''}, "
                         f"got {shown(value)}")
    return int(value)


def real_number(owner: str, name: str, value: Any, what: str = "a number") -> float:
    """value as a finite float; the range is the caller's to check (`what` words it)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be {what}, got {shown(value)}")
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {shown(value)}")
    return value


def text(owner: str, name: str, value: Any, optional: bool = False, path: bool = False) -> str | None:
    """value as a str; path: a str or an os.PathLike (a folder), returned as its str."""
    if value is None and optional:
        return None
    if isinstance(value, str) or (path and isinstance(value, os.PathLike)):
        return os.fspath(value) if path else value
    what = "a path (str or pathlib.Path)" if path else "a string"
    raise ValueError(f"{owner}.{name} must be {what}{' or None' if optional else ''}, got {shown(value)}")


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
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            except ValueError:
                schema = None  # (text that is not JSON: refused where the grammar is built, with its reason)
            problem = endless(schema)
            if problem is not None:
                raise ValueError(f"json schema: {problem}")
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


MIN_TEMPERATURE = 1e-5  # a temperature below it decodes greedily
MAX_TEMPERATURE = 1e4  # past it, masked (-inf) logits over it are not numbers in float32
TEMPERATURE_RANGE = f"a number from 0 (greedy) to {MAX_TEMPERATURE:g}"


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy (as does any below 1e-5). top_k -1 and top_p 1.0 disable those filters. `stop` strings end
    the output (the stop string itself is not included in the text). `seed` makes a sampled
    request reproducible whatever else is in the batch. `n` outputs per prompt: a sampled request
    runs as n sequences drawn independently (with a seed, sequence i draws from seed + i); a
    greedy one runs once and its output is repeated n times, as every greedy run gives it.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1

    def __post_init__(self) -> None:
        own = "SamplingParams"
        if not 0 <= real_number(own, "temperature", self.temperature, TEMPERATURE_RANGE) <= MAX_TEMPERATURE:
            raise ValueError(f"{own}.temperature must be {TEMPERATURE_RANGE}, got {shown(self.temperature)}")
        # below MIN_TEMPERATURE, greedy (the limit): float32 logits divided by less overflow
        self.temperature = float(self.temperature) if self.temperature >= MIN_TEMPERATURE else 0.0
        if not 0.0 < real_number(own, "top_p", self.top_p, "a number in (0, 1]") <= 1.0:
            raise ValueError(f"{own}.top_p must be a number in (0, 1], got {shown(self.top_p)}")
        self.top_p = float(self.top_p)
        self.top_k = whole_number(own, "top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"{own}.top_k must be -1 (off) or a whole number >= 1, got {shown(self.top_k)}")
        self.max_tokens = whole_number(own, "max_tokens", self.max_tokens, 1)
        self.n = whole_number(own, "n", self.n, 1)
        # torch.Generator.manual_seed takes 0 .. 2**64 - 1; sequence i of n draws from seed + i
        self.seed = whole_number(own, "seed", self.seed, 0, optional=True)
        if self.seed is not None and self.seed + self.n > 2 ** 64:
            raise ValueError(f"{own}.seed must be below 2**64 - n ({2 ** 64 - self.n}), got {self.seed}")
        self.ignore_eos = flag(own, "ignore_eos", self.ignore_eos)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"{own}.stop must be a string or a list of strings, got {shown(self.stop)}")
        self.stop = [s for s in stop if s]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"{own}.structured_outputs must be a StructuredOutputsParams, "
                             f"got {shown(self.structured_outputs)}")
        if self.structured_outputs is not None and self.stop:
            raise ValueError("stop strings and structured_outputs do not go together: a stop string would cut the "
                             "constrained output short of valid (the constraint ends the output by itself)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def sequences(self) -> list[SamplingParams]:
        """The parameters of each sequence the request runs as (each with n = 1): n for a sampled
        request, one for a greedy one (its n outputs are copies)."""
        if self.n == 1:
            return [self]
        if self.is_greedy:
            return [replace(self, n=1)]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]


def _refuse_unknown_keywords(init):
    """The dataclass __init__, refusing every keyword it does not take in one TypeError (vLLM's
    logprobs, presence_penalty, ... are not implemented: one message lists all of those given)."""
    known = [f.name for f in fields(SamplingParams)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise TypeError(f"SamplingParams does not support {', '.join(unknown)}: remove "
                            f"{'it' if len(unknown) == 1 else 'them'}; it takes {', '.join(known)}")
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _refuse_unknown_keywords(SamplingParams.__init__)
