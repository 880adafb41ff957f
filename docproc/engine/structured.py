"""Structured outputs: a request's tokens constrained to a JSON Schema, a regex, a choice of
strings or an EBNF grammar, with xgrammar (CPU and CUDA).

Each constrained sequence holds a grammar matcher (`seq.grammar`) that has accepted every token it
generated. Before a row samples, its matcher writes the bitmask of the tokens that may come next
and the row's logits outside it become -inf; after the token is chosen the matcher accepts it.
When the grammar is complete only the stop tokens remain allowed, so the output ends by itself.
Equal constraints share one compiled grammar (a cache keyed by the constraint's text).

A grammar alone does not make an output whole: one that runs to max_tokens is cut wherever it
is. So what a schema lets grow without end is bounded at compile time (numbers: at most 15 integer
digits and 6 decimals, no exponent), and each matcher knows its request's token budget
(BudgetMatcher): when the shortest completion of the output so far needs nearly all the tokens
left, the rows are steered onto it, one forced token per step, so that the output closes within
max_tokens.

xgrammar is a dependency of docproc (pyproject.toml says why it and not llguidance); an install
without it decodes free text, and the pipeline checks answers against their rules after.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from docproc.sampling_params import StructuredOutputsParams
from docproc.schema_walk import (GRAMMAR_FORMATS, MAX_PATTERN_REPEAT, MAX_SCHEMA_REPEAT, STRICT_LENGTH_LIMIT,
                                 grammar_multiple_of, rebuild, stray_ref, subschemas)
from kernels.token_mask import apply_token_mask

INSTALL_HINT = "structured outputs need xgrammar, a dependency of docproc that is missing here: pip install xgrammar"
CACHE_ENTRIES = 256  # compiled grammars kept


class FillThreads:
    """How many threads xgrammar's batch fill of a step's masks gets: measured, not assumed.

    Its default (half the host's cores) suits costly fills (a large vocabulary's masks), but each
    call pays for its threads: on the H200 machine's 16 cores a step of the bundled target at
    batch 64 took 1,003 us on 8 threads against 158 us on one (`bench/mask_fill_threads.py`,
    BENCHMARKS.md). So each thread count in THREADS (up to the default) is timed on the steps
    it fills, per bucket of row counts (twice: the first call warms it up), and a step takes the
    count with the lowest mean seconds so far; the count taken is timed on every call, and every
    REMEASURE-th call of a bucket times the next count in turn again, so a change of grammars or
    load is followed. The masks are the same whatever the count."""

    THREADS = (1, 2, 4)
    REMEASURE = 64
    DECAY = 0.8  # weight of the mean so far against the newest time

    def __init__(self, xgr, cores: int | None = None, clock=time.perf_counter) -> None:
        most = max(1, (cores or os.cpu_count() or 2) // 2)
        self.clock = clock
        self.counts = tuple(sorted({t for t in self.THREADS if t <= most} | {most}))
        self._xgr = xgr
        self._matchers: dict[int, object] = {}
        self.seconds: dict[tuple[int, int], float] = {}  # (bucket, threads) -> mean seconds a call
        self.samples: dict[tuple[int, int], int] = {}  # (bucket, threads) -> calls timed
        self.calls: dict[int, int] = {}  # bucket -> calls

    @staticmethod
    def bucket(rows: int) -> int:
        return max(1, rows - 1).bit_length()  # 2, 3-4, 5-8, ... rows

    def choose(self, rows: int) -> int:
        b = self.bucket(rows)
        calls = self.calls.get(b, 0)
        untimed = [t for t in self.counts if self.samples.get((b, t), 0) < 2]
        if untimed:
            return untimed[0]
        if calls % self.REMEASURE == 0:
            return self.counts[(calls // self.REMEASURE) % len(self.counts)]
        return min(self.counts, key=lambda t: self.seconds[(b, t)])

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A call's time. A count's first call in a bucket only warms it up (xgrammar's first fills
        of fresh matchers took 5 ms on one thread where the next took 0.15): its second call's
        time replaces it, and the mean starts there."""
        b = self.bucket(rows)
        self.calls[b] = self.calls.get(b, 0) + 1
        n = self.samples.get((b, threads), 0)
        self.samples[(b, threads)] = n + 1
        old = self.seconds.get((b, threads))
        self.seconds[(b, threads)] = seconds if n < 2 else self.DECAY * old + (1 - self.DECAY) * seconds

    def fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        threads = self.choose(len(rows))
        batch = self._matchers.get(threads)
        if batch is None:
            batch = self._matchers[threads] = self._xgr.BatchGrammarMatcher(max_threads=threads)
        t0 = self.clock()
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        self.record(len(rows), threads, self.clock() - t0)


class BudgetMatcher:
    """A request's grammar matcher with its token budget (max_tokens).

    Before each token the row is masked by the grammar, unless the shortest completion of the
    output so far (GrammarCompiler.completion: the text the grammar forces, and at each choice the
    character that closes soonest, `null` before an empty string) takes at least all but MARGIN
    of the tokens left, counting what one more token of the model's could add to it (`_growth`:
    a `,` that opens an array element of objects with required fields adds all of them): then
    only that completion's first token is allowed.

    Looking for the completion costs a walk of the grammar (about 0.1 ms), so it is looked for at
    every token only near the end: at every CHECK_EVERY-th token (a checkpoint) the completion is
    measured, and the positions up to the next checkpoint are near when it takes at least all but
    MARGIN + CHECK_EVERY of the tokens left there. Inside a forced completion whose remaining
    tokens alone take all but MARGIN of the budget left, each next token is taken from it without
    walking again (180 rows of the default query set on a 2-core CPU: 74-78 us of host time a row
    and token before, 30 after, BENCHMARKS.md). Every decision is a function of the tokens
    generated (the checkpoint's state, the current one), never of the order in which a path
    visited them: plain decoding, a draft's proposals and the target's verification of them mask
    a position alike (speculation stays lossless). An output whose completion grows faster than
    the margins allow, or never fits (a max_tokens smaller than the schema's shortest answer), is
    cut as before, and the pipeline reports it as truncated. A forced end is a cut only where the
    grammar would take more there (a number's next digit): the end of a closed JSON value, the
    only token its grammar takes, is not (ENDED)."""

    MARGIN = 4
    CHECK_EVERY = 8
    CHECKPOINTS_KEPT = 64
    CLOSERS_PROBED = 3
    BRANCHES_KEPT = 256

    def __init__(self, matcher, max_tokens: int | None, compiler: "GrammarCompiler", json_text: bool,
                 growth_bound: int = 0) -> None:
        self.matcher = matcher
        self.max_tokens = max_tokens
        # the most one token can add to the completion (json_growth_bound): checkpoints look that
        # much further ahead
        self.growth_bound = growth_bound
        self.num_accepted = 0
        self._compiler = compiler
        # JSON outputs: (inside a string, after a backslash) after each accepted token, which
        # decides what closes soonest (a quote inside a string, a brace outside)
        self._scan: list[tuple[bool, bool]] | None = [(False, False)] if json_text else None
        self._history = [0]  # a hash of the tokens accepted so far, after each count: keys checkpoints
        self._near: dict[tuple[int, int], bool] = {}  # (count, history hash) at a checkpoint -> near
        # the decision at each position of the output so far (FREE, or (token forced, the forced
        # completion's tokens, the index of the next one)); None where not asked
        self._path: list[tuple | None] = []
        # decisions at positions a rollback took away (a draft's rejected proposals), by (count,
        # history hash), for a path that comes back: the newest BRANCHES_KEPT
        self._branches: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._tokens: list[int] = []  # the tokens accepted (positions decided late are replayed)

    def accept_token(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        self._tokens.append(token)
        self._history.append(hash((self._history[-1], token)))
        if self._scan is not None:
            self._scan.append(scan_json(self._compiler.token_text(token), self._scan[-1]))
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        n = self.num_accepted - num_tokens
        for i in range(n + 1, len(self._path)):
            if self._path[i] is not None:
                self._branches[(i, self._history[i])] = self._path[i]
        del self._path[n + 1:]
        while len(self._branches) > self.BRANCHES_KEPT:
            self._branches.popitem(last=False)
        self.num_accepted = n
        del self._tokens[len(self._tokens) - num_tokens:]
        del self._history[len(self._history) - num_tokens:]
        if self._scan is not None:
            del self._scan[len(self._scan) - num_tokens:]

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        return self.matcher.is_completed()

    def _completion_tokens(self, matcher, count: int, left: int, found=False) -> list[int] | None:
        """The completion's tokens from matcher (at count; found: its completion when looked for
        already); [] when it is surely shorter than left tokens (its bytes, at least one a token,
        are fewer); None when none was found."""
        if found is False:
            found = self._compiler.completion(matcher, self._scan[count] if self._scan is not None else None)
        if found is None:
            return None
        lead, text = found
        if len(lead) + len(text.encode()) < left:
            return []
        return lead + self._compiler.encode(text)

    def _growth(self, matcher, count: int, length: int, text: str, enough: int) -> int:
        """How many tokens longer the completion (`length` tokens, `text` its characters) can get
        by the model's next token: the most that opening a value does (GROWERS: a next element
        or property, an object, an array; an element of objects with required fields costs all
        of them), also where the token first closes up to CLOSERS_PROBED of what is open. The
        walk stops once the growth found reaches `enough` (all the caller asks is whether it
        does): a row the budget is closing pays one or two probes a token, not a dozen."""
        scan = self._scan[count] if self._scan is not None else None
        most = 0
        for cut in range(min(self.CLOSERS_PROBED, len(text)) + 1):
            if scan is not None and scan_json(text[:cut], scan)[0]:
                continue  # (inside a string these are characters of it)
            for ch in GROWERS:
                probe = matcher.fork()
                if not probe.accept_string(text[:cut] + ch):
                    continue
                after = scan_json(text[:cut] + ch, scan) if scan is not None else None
                found = self._compiler.completion(probe, after)
                if found is not None:
                    most = max(most, 1 + len(found[0]) + len(self._compiler.encode(found[1])) - length)
                    if most >= enough:
                        return most
        return most

    def _is_near(self) -> bool:
        """Whether the current position is near the end, by its checkpoint's completion."""
        n = self.num_accepted
        c = n - n % self.CHECK_EVERY
        key = (c, self._history[c])
        near = self._near.get(key)
        if near is None:
            matcher = self.matcher
            if c < n:  # the checkpoint was passed without a mask (tokens accepted after a verification)
                matcher = self.matcher.fork()
                matcher.rollback(n - c)
            left = self.max_tokens - c - self.MARGIN - self.CHECK_EVERY - self.growth_bound
            ids = self._completion_tokens(matcher, c, left)
            near = self._near[key] = ids is None or len(ids) >= left  # (none found: look at every token)
            if len(self._near) > self.CHECKPOINTS_KEPT:
                del self._near[next(iter(self._near))]
        return near

    def forced_token(self) -> int | None:
        """The only token the next position may take, or None (the grammar's mask applies).

        Inside a completion the budget forced, where the completion's remaining tokens alone take
        all but MARGIN of the tokens left (a walk would force its next token whatever the growth),
        the next token is taken from it without walking the grammar again. The decision at a
        position is therefore a function of the one before it; every position's is kept, and a
        position reached with the one before it undecided (tokens accepted without a mask) has
        the positions before it decided first, in order, so that every path to a position
        decides it alike."""
        if self.max_tokens is None:
            return None
        n = self.num_accepted
        decision = self._decision(n)
        if decision is None:
            if n > 0 and self._decision(n - 1) is None:
                self._decide_before(n)
            decision = self._decide()
            self._path.extend([None] * (n + 1 - len(self._path)))
            self._path[n] = decision
        return decision[0]

    def _decision(self, count: int) -> tuple | None:
        """The decision kept for this position of the output so far (None: not asked)."""
        if count < len(self._path) and self._path[count] is not None:
            return self._path[count]
        decision = self._branches.get((count, self._history[count]))
        if decision is not None:
            self._path.extend([None] * (count + 1 - len(self._path)))
            self._path[count] = decision
        return decision

    def _decide_before(self, n: int) -> None:
        """Decide, in order, the positions before n that were passed undecided (the matcher is
        taken back to the first of them and brought forward again, also if a decision raises)."""
        back = 1
        while back < n and self._decision(n - 1 - back) is None:
            back += 1
        tokens = self._tokens[n - back:]
        self.rollback(back)
        done = 0
        try:
            for t in tokens:
                self.forced_token()
                if not self.accept_token(t):
                    raise RuntimeError(f"the grammar refused token {t} it accepted before")
                done += 1
        finally:
            for t in tokens[done:]:
                self.accept_token(t)

    def _decide(self) -> tuple:
        left = self.max_tokens - self.num_accepted
        if left <= 0 or self.matcher.is_terminated():
            return FREE
        if self.matcher.is_completed():  # the output may end here: end it rather than open more
            stops = self._compiler.stop_token_ids
            if not stops or left > self.MARGIN + 1:
                return FREE
            # where the grammar takes nothing more (a closed JSON value), the end forced is the
            # one the mask allows anyway: it cuts nothing (ENDED), the output is not steered
            return stops[0], (), 0 if self._compiler.takes_more(self.matcher) else ENDED
        if not self._is_near():
            return FREE
        if self.num_accepted > 0:  # inside a forced completion that takes the rest: its next token
            token, plan, i = self._path[self.num_accepted - 1]
            if token is not None and token == self._tokens[-1] and 0 <= i < len(plan) \
                    and len(plan) - i + self.MARGIN >= left and self.matcher.fork().accept_token(plan[i]):
                return plan[i], plan, i + 1
        found = self._compiler.completion(self.matcher, self._scan[-1] if self._scan is not None else None)
        ids = self._completion_tokens(self.matcher, self.num_accepted, left - self.MARGIN - self.growth_bound, found)
        if not ids:
            return FREE
        need = left - self.MARGIN - len(ids)  # the growth that makes the completion take the rest
        if need > 0 and (not self.growth_bound
                         or self._growth(self.matcher, self.num_accepted, len(ids), found[1], need) < need):
            return FREE
        token, plan = ids[0], tuple(ids)
        probe = self.matcher.fork()
        if not probe.accept_token(token):  # the tokenizer's view of the text is not the grammar's (a
            # normaliser, a special token's text): the completion's first byte as its own token
            lead, text = found
            token = self._compiler.byte_token((text.encode() or b"\0")[0]) if not lead else lead[0]
            plan = ()  # (the next position walks again)
        return token, plan, 1

    def steered(self) -> bool:
        """Whether a token of the output so far was forced by the budget (the output was closed by
        max_tokens, not ended by the model)."""
        return any((d := self._decision(n)) is not None and d[0] is not None and d[2] != ENDED
                   for n in range(self.num_accepted))

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        token = self.forced_token()
        if token is None:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            only_token(bitmask, row, token)


FREE = (None, (), 0)  # a position where the budget forces nothing
ENDED = -1  # a decision's index where the end is forced where the grammar takes nothing else
GROWERS = (",", "{", "[")  # what opens more of a JSON value than its shortest completion holds
GROWTH_UNKNOWN = 64  # bytes: a subschema whose shortest form is not worked out ($ref outside, too deep)


def json_growth_bound(params: StructuredOutputsParams) -> int:
    """For a JSON constraint, the most bytes (so tokens, at least a byte each) one token can add
    to the shortest completion: the shortest form of the largest value a model can open (an array
    element, a property with its key, an alternative), plus its separator. 0 for other kinds."""
    if params.kind != "json":
        return 0
    try:
        root = json.loads(params.json) if isinstance(params.json, str) else params.json
    except (TypeError, ValueError):
        return GROWTH_UNKNOWN
    most = 4  # `, ""` and the like, where nothing is said
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        props = node.get("properties")
        if isinstance(props, dict):
            for k, sub in props.items():
                most = max(most, len(json.dumps(k)) + 4 + _shortest(sub, root))
                stack.append(sub)
        for key in ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf", "$defs",
                    "definitions"):
            sub = node.get(key)
            subs = sub.values() if isinstance(sub, dict) and key in ("$defs", "definitions") else \
                sub if isinstance(sub, list) else [sub]
            for one in subs:
                if isinstance(one, dict):
                    most = max(most, 2 + _shortest(one, root))
                    stack.append(one)
    return most


def _shortest(schema, root, depth: int = 0) -> int:
    """Bytes of the shortest JSON value a schema admits, as the completion writes it (an upper
    bound where it cannot tell)."""
    if depth > 16:
        return GROWTH_UNKNOWN
    if not isinstance(schema, dict):
        return 4
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            return GROWTH_UNKNOWN
        node = root
        for part in [p for p in ref[1:].split("/") if p]:
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        return _shortest(node, root, depth + 1) if isinstance(node, dict) else GROWTH_UNKNOWN
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(len(json.dumps(v)) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return min(_shortest(s, root, depth + 1) for s in schema[key])
    types = schema.get("type")
    types = types if isinstance(types, list) and types else [types]
    return min(_shortest_of_type(t, schema, root, depth) for t in types)


def _shortest_of_type(kind, schema: dict, root, depth: int) -> int:
    if kind in ("null", "boolean"):
        return 4
    if kind in ("number", "integer"):
        return max(1, len(str(schema.get("minimum", 0))))
    if kind == "string":
        n = schema.get("minLength", 0)
        return 2 + (n if isinstance(n, int) else 0) + (GROWTH_UNKNOWN if "pattern" in schema or "format" in schema
                                                        else 0)
    if kind == "array":
        n = schema.get("minItems", 0)
        return 2 + (n if isinstance(n, int) else 0) * (2 + _shortest(schema.get("items", {}), root, depth + 1))
    if kind == "object" or kind is None and "properties" in schema:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        return 2 + sum(len(json.dumps(k)) + 4 + _shortest(props.get(k, {}), root, depth + 1) for k in required)
    return 4  # no type: the completion writes null


def max_output_bytes(params: StructuredOutputsParams) -> int | None:
    """The most bytes an output of the constraint can have (a token holds at least one), or None
    when it has no bound: choices, and regexes of bounded width in the subset Python's parser
    reads alike (the query rules are written in it)."""
    if params.kind == "choice":
        return max(len(c.encode()) for c in params.choice)
    if params.kind != "regex":
        return None
    try:
        import re._parser as sre  # Python 3.11 and later
    except ImportError:  # pragma: no cover
        import sre_parse as sre  # type: ignore[no-redef]
    try:
        width = _regex_bytes(sre.parse(params.regex), sre)
    except Exception:  # noqa: BLE001 -- a syntax only xgrammar reads: no bound known
        return None
    return None if width == float("inf") else int(width)


def _regex_bytes(pattern, sre) -> float:
    """The most UTF-8 bytes a parsed regex matches (inf when unbounded)."""
    c = sre._constants if hasattr(sre, "_constants") else sre
    total = 0.0
    for op, arg in pattern:
        if op is c.LITERAL or op is c.NOT_LITERAL:
            total += len(chr(arg).encode()) if op is c.LITERAL else 4
        elif op is c.IN:
            total += max((len(chr(a[1] if t is c.RANGE else a).encode()) if t in (c.LITERAL, c.RANGE) else 4)
                         for t, a in arg)
        elif op is c.ANY:
            total += 4
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = arg
            if hi >= c.MAXREPEAT:
                return float("inf")
            total += hi * _regex_bytes(sub, sre)
        elif op is c.SUBPATTERN:
            total += _regex_bytes(arg[-1], sre)
        elif op is c.BRANCH:
            total += max(_regex_bytes(b, sre) for b in arg[1])
        elif op is c.AT:
            continue
        else:  # back references, look-arounds, anything else: no bound claimed
            return float("inf")
    return total


def only_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Row of an (n, ceil(V / 32)) int32 bitmask allowing token alone."""
    bitmask[row].zero_()
    bit = 1 << (token & 31)
    bitmask[row, token >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit


def scan_json(text: str, state: tuple[bool, bool]) -> tuple[bool, bool]:
    """(inside a JSON string, after a backslash) after text, from state."""
    inside, escaped = state
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside, escaped


_PRINTABLE = "".join(chr(c) for c in range(32, 127))
# outside a string: close what is open, else go on to what is still required, else the shortest
# value (0, null, ""); a digit comes after the separators so that a number is ended, not grown
CLOSE_OUTSIDE = '}],0n"' + _PRINTABLE
CLOSE_INSIDE = '"0' + _PRINTABLE  # inside a string: its closing quote
CLOSE_OTHER = '0 "' + _PRINTABLE  # other grammars: a digit, then anything printable
ENCODED_KEPT = 4096  # texts whose ids encode() keeps
COMPLETION_CHARS = 512  # a completion longer than this is not looked for (the output is cut)


def bounded_numbers(schema):
    """The schema with every number and integer given a range where it has none (at most 15
    integer digits; xgrammar then writes at most 6 decimals and no exponent): an unbounded
    number's grammar lets a model write digits until max_tokens (`261.85E2645101416...`). The
    answer is validated against the schema as written."""
    return rebuild(schema, _bounded_number)


def _bounded_number(out: dict) -> dict:
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if "multipleOf" in out and grammar_multiple_of(out):
        # xgrammar enforces an integer's multipleOf only without a range: its digits are left to
        # the budget (steered closed at max_tokens), the multiple kept
        return out
    if "number" in types or "integer" in types:
        low = out.get("minimum", out.get("exclusiveMinimum"))
        high = out.get("maximum", out.get("exclusiveMaximum"))
        # (a bound past the limit given on one side: the other side stays open, the budget closes it)
        if low is None and (high is None or high > -NUMBER_LIMIT):
            out["minimum"] = -NUMBER_LIMIT
        if high is None and (low is None or low < NUMBER_LIMIT):
            out["maximum"] = NUMBER_LIMIT
    return out


NUMBER_LIMIT = 10**15 - 1


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (or xgrammar missing): its request fails alone."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputError(f"{INSTALL_HINT} ({e})") from None
    return xgrammar


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary width (the model's logits' width,
    which may exceed the tokenizer's: ids past it are never allowed).

    xgrammar sees only the ids the tokenizer knows (`num_tokens`): a model's embedding padded past
    its tokenizer would otherwise give it that many tokens without text to carry through every
    mask and every accepted token (a 384-token tokenizer on 152,064 logits: fills of ~400 us a row
    instead of ~20, accepts of ~100 us instead of ~25, on 2 CPU cores). The ids past it are masked
    with the rest, in kernels/token_mask.py on CUDA."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_tokens = min(vocab_size, tokenizer_size(tokenizer))
        self.stop_token_ids = sorted(t for t in stop_token_ids if t < self.num_tokens)
        self._compiler = None
        self._xgr = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # text -> its ids (encode)
        self._vocab: list[bytes] = []  # each token's bytes (xgrammar's decoded vocabulary)
        self._continuations: list[int] | None = None
        self._bytes: dict[int, int] | None = None  # a byte -> the token of that byte alone
        self._widths: dict[str, tuple] = {}  # a constraint's key -> (max_output_bytes, json_growth_bound)
        self._fills = None  # FillThreads: a step's masks filled on the thread count measured fastest
        self.num_reused_masks = 0  # verification rows masked with the draft's mask of that state
        self._pinned: torch.Tensor | None = None  # the host side of CUDA masks
        self._tail: torch.Tensor | None = None  # per row: 1 where the ids past num_tokens stay allowed
        self._copied = None  # a CUDA event after the last copy out of them
        # compile() may run in other threads (the server compiles a request's constraint before
        # the engine takes it): the compiler's creation and the caches are taken under this lock;
        # xgrammar compiles without the GIL, outside it
        self._lock = threading.Lock()

    def _ensure(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.num_tokens,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._vocab = info.decoded_vocab
                self._xgr, self._compiler = xgr, xgr.GrammarCompiler(info, cache_enabled=False)
        return self._xgr, self._compiler

    def compile(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint ahead of its request (from any thread): the compiled grammar goes
        with these parameters (and into the cache), so the request's matcher costs no compile
        on the engine's thread, whatever the cache has dropped since. StructuredOutputError if
        it does not compile."""
        self._widths_of(params)
        params._compiled = (self, self._compiled(params))

    def matcher(self, params: StructuredOutputsParams, max_tokens: int) -> BudgetMatcher:
        """A fresh matcher for the constraint and a request of max_tokens (StructuredOutputError if
        it does not compile). A constraint whose every output fits in max_tokens (a bounded regex,
        choices) is never steered: its budget is None."""
        most, growth = self._widths_of(params)
        fits = most is not None and most <= max_tokens  # every output fits: nothing to steer
        compiled = self._compiled(params)
        return BudgetMatcher(self._xgr.GrammarMatcher(compiled), None if fits else max_tokens, self,
                             json_text=params.kind == "json", growth_bound=growth)

    def _widths_of(self, params: StructuredOutputsParams) -> tuple:
        """(max_output_bytes, json_growth_bound) of a constraint (parsing a rule takes
        milliseconds: once a constraint)."""
        key = params.key()
        with self._lock:
            widths = self._widths.get(key)
        if widths is None:
            widths = (max_output_bytes(params), json_growth_bound(params))
            with self._lock:
                if len(self._widths) >= CACHE_ENTRIES:
                    self._widths.pop(next(iter(self._widths)))
                self._widths[key] = widths
        return widths

    def token_text(self, token: int) -> str:
        """A token's bytes as latin-1 text (one character a byte: quotes and backslashes are
        single bytes in UTF-8, all scan_json looks for)."""
        return self._vocab[token].decode("latin-1") if token < len(self._vocab) else ""

    def encode(self, text: str) -> list[int]:
        """text's token ids (no special tokens), from a cache: the budget encodes the same
        completions (a closing quote and brace, a schema's remaining properties) for every row and
        token near an answer's end, at about 50 us an encode."""
        ids = self._encoded.get(text)
        if ids is not None:
            self._encoded.move_to_end(text)
            return list(ids)
        fast = getattr(self.tokenizer, "_tokenizer", None)  # the tokenizers library's own: no wrapper's cost
        if fast is not None and hasattr(fast, "encode"):
            ids = fast.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._encoded[text] = tuple(ids)
        if len(self._encoded) > ENCODED_KEPT:
            self._encoded.popitem(last=False)
        return list(ids)

    def completion(self, matcher, scan: tuple[bool, bool] | None) -> tuple[list[int], str] | None:
        """The shortest completion of matcher's output (greedy: the text the grammar forces, else
        the first character of the state's preference list it accepts): the byte tokens that end a
        character the output stopped inside of (a multi-byte character split between tokens), then
        text. None when none of at most COMPLETION_CHARS characters is found. matcher itself does
        not move."""
        fork = matcher.fork()
        lead: list[int] = []
        out: list[str] = []
        length = 0
        while length <= COMPLETION_CHARS:
            if fork.is_completed():
                return lead, "".join(out)
            forced = fork.find_jump_forward_string()
            if forced and fork.accept_string(forced):
                chunk = forced
            else:
                order = CLOSE_OTHER if scan is None else CLOSE_INSIDE if scan[0] else CLOSE_OUTSIDE
                if len(out) >= 2 and out[-1] == out[-2] and len(out[-1]) == 1:
                    # the same character twice: a repeat that may never close ("0" for [0-9]+-[A-Z]),
                    # so it goes last
                    order = order.replace(out[-1], "") + out[-1]
                chunk = next((ch for ch in order if fork.accept_string(ch)), None)
                if chunk is None:
                    if out or len(lead) >= 3:  # nothing printable goes on
                        return None
                    byte = next((t for t in self._continuation_bytes() if fork.accept_token(t)), None)
                    if byte is None:
                        return None
                    lead.append(byte)  # the rest of a character cut between tokens
                    continue
            out.append(chunk)
            length += len(chunk)
            if scan is not None:
                scan = scan_json(chunk, scan)
        return None

    def takes_more(self, matcher) -> bool:
        """Whether matcher (its output complete) takes any token but the end here: the digits a
        number may go on with do, a closed JSON value's end does not (JSON is compiled without
        free whitespace); whitespace counts, as a pattern may go on after it (one mask filled:
        about 0.1 ms, once a request at most)."""
        xgr, _ = self._ensure()
        mask = xgr.allocate_token_bitmask(1, self.num_tokens)
        matcher.fill_next_token_bitmask(mask, 0)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: self.num_tokens]
        stops = set(self.stop_token_ids)
        return any(t not in stops for t in np.flatnonzero(bits).tolist())

    def byte_token(self, byte: int) -> int:
        """The token that is this one byte (byte-level vocabularies have one for each)."""
        if self._bytes is None:
            self._bytes = {b[0]: t for t, b in reversed(list(enumerate(self._vocab))) if len(b) == 1}
        return self._bytes[byte]

    def _continuation_bytes(self) -> list[int]:
        """The tokens that are one UTF-8 continuation byte (0x80-0xBF) each."""
        if self._continuations is None:
            self._continuations = [t for t, b in enumerate(self._vocab) if len(b) == 1 and 0x80 <= b[0] <= 0xBF]
        return self._continuations

    def _compiled(self, params: StructuredOutputsParams):
        """The constraint's compiled grammar, from the cache or compiled now (outside the lock:
        a slow compile holds up nobody else)."""
        xgr, compiler = self._ensure()
        ahead = getattr(params, "_compiled", None)
        if ahead is not None and ahead[0] is self:
            return ahead[1]
        key = params.key()  # (the parameters checked themselves: a JSON-able text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        try:
            compiled = compiler.compile_grammar(grammar(xgr, params))
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 -- xgrammar raises RuntimeError/ValueError with its reason
            raise StructuredOutputError(f"the {params.kind} constraint does not compile: {_reason(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def mask(self, logits: torch.Tensor, rows: list[tuple], keep: bool = False) -> dict[int, torch.Tensor] | None:
        """Mask a step's constrained rows of logits (n, V) in place, in one fill and one apply:
        (row, matcher, None) masks that row by the matcher's state (every token it does not allow
        next becomes -inf); (first row, matcher, proposals[, masks]) masks a speculative window,
        row first + j by the state after proposals 0..j-1 (the states verification scores them
        in), taking masks[j] where given instead of filling it again (the draft's: it masked its
        round j in that same state). A window's rows past a proposal the grammar refuses (which
        is rejected there) or past the grammar's end are left as they are, being never sampled;
        its matcher is rolled back to where it was (the tokens verification emits are accepted as
        they are appended). keep: returns each masked single row's mask (a host copy), by row."""
        if not rows:
            return {} if keep else None
        bitmask = self._bitmask(logits)
        masked: list[int] = []
        fills = []  # (row, xgrammar matcher): single rows whose mask the grammar fills
        for r0, matcher, tokens, *given in rows:
            premade = given[0] if given else None
            if tokens is None:
                masked.append(r0)
                token = matcher.forced_token()
                if token is None:
                    fills.append((r0, matcher.matcher))
                else:
                    only_token(bitmask, r0, token)
                continue
            advanced = 0
            for j in range(len(tokens) + 1):
                if matcher.is_terminated():
                    break
                if premade is not None and j < len(premade) and premade[j] is not None:
                    bitmask[r0 + j].copy_(premade[j])
                    self.num_reused_masks += 1
                else:
                    matcher.fill_next_token_bitmask(bitmask, r0 + j)
                masked.append(r0 + j)
                if j == len(tokens) or not matcher.accept_token(tokens[j]):
                    break
                advanced += 1
            if advanced:
                matcher.rollback(advanced)
        if len(fills) == 1:
            fills[0][1].fill_next_token_bitmask(bitmask, fills[0][0])
        elif fills:
            if self._fills is None:
                self._fills = FillThreads(self._xgr)
            self._fills.fill([m for _, m in fills], bitmask, [i for i, _ in fills])
        kept = {r0: bitmask[r0].clone() for r0, _, tokens, *_ in rows if tokens is None} if keep else None
        if masked:
            self._apply(logits, bitmask, sorted(masked))
        return kept

    def mask_rows(self, logits: torch.Tensor, matchers: list, keep: bool = False) -> dict[int, torch.Tensor] | None:
        """mask() for one row each: row i by matchers[i], rows whose matcher is None as they are."""
        return self.mask(logits, [(i, m, None) for i, m in enumerate(matchers) if m is not None], keep)

    def _bitmask(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, ceil(V / 32)) int32 on the host; for CUDA logits a pinned buffer, so that its copy to
        the device does not make the host wait for the work queued before it (an overlapped
        step's forward). Only the rows a fill writes are applied."""
        xgr, _ = self._ensure()
        n = logits.shape[0]
        if not logits.is_cuda:
            return xgr.allocate_token_bitmask(n, self.num_tokens)
        if self._pinned is None or self._pinned.shape[0] < n:
            self._pinned, self._tail = self._host_buffers(max(n, 64), pin=True)
        elif self._copied is not None:
            self._copied.synchronize()  # its last copy to the device is done before it is written again
        return self._pinned[:n]

    def _host_buffers(self, rows: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask's and the tails' host buffers, made as ordinary tensors even when a step
        under inference mode asks first: they are written in place by steps outside it too (a
        verification's), and an inference tensor refuses that ("Inplace update to inference tensor
        outside InferenceMode": a draft's verification after plain, masked steps failed so)."""
        with torch.inference_mode(False):
            return (torch.empty((rows, (self.num_tokens + 31) // 32), dtype=torch.int32, pin_memory=pin),
                    torch.empty(rows, dtype=torch.int32, pin_memory=pin))

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # (a draft's logits may be narrower than the target's vocabulary the masks are made for)
        width = min(self.num_tokens, logits.shape[-1])
        if not logits.is_cuda:
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
            if logits.shape[-1] > width:  # ids without text: never allowed under a grammar
                logits[torch.tensor(rows), width:] = float("-inf")
            return
        # on the device without an index tensor from the host (whose copy would wait for the
        # forward queued before it): rows without a mask allow everything
        n = bitmask.shape[0]
        tail = self._tail[:n]
        if len(rows) < n:
            free = sorted(set(range(n)) - set(rows))
            bitmask[free] = -1
            tail.fill_(0)
            tail[free] = 1
        else:
            tail.fill_(0)
        device_mask = bitmask.to(logits.device, non_blocking=True)
        device_tail = tail.to(logits.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        apply_token_mask(logits, device_mask, device_tail, self.num_tokens)


def tokenizer_size(tokenizer) -> int:
    """The ids a tokenizer has text for: one past its largest (added tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1


# JSON Schema's "date" format (RFC 3339 full-date, as the validator reads it): real dates only.
# xgrammar's own rule lets any day up to 31 through in any month (2026-02-30), an answer the
# validator then rejects.
_LEAP_YEAR = "([12][0-9]([02468][48]|[2468]0|[13579][26])|1200|1600|2000|2400|2800)"
ISO_DATE = "^([12][0-9]{3}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)" \
           "|02-(0[1-9]|1[0-9]|2[0-8]))|" + _LEAP_YEAR + "-02-29)$"


def _strict_strings(schema):
    """The schema with every `format: date` string given as the real dates' pattern, and every
    length-bounded string (minLength / maxLength, no pattern or format) given as the equivalent
    pattern over JSON string characters (unescaped, or an escape: each counts as one character).
    xgrammar 0.2.9 compiles such a string to any characters but quote, backslash and newlines,
    control characters included, which strict JSON parsers reject; its pattern strings and
    unbounded strings are right. A string with a pattern or a format xgrammar knows loses its
    length bounds (xgrammar decodes the pattern or format alone and logs that it ignores them, on
    stderr whatever --quiet says), and one of another format loses the format (decoded as any
    string by xgrammar): the answer is validated against them after, and json_schema.unenforced
    names them."""
    return rebuild(schema, _strict_string)


def _strict_string(node: dict) -> dict:
    if node.get("type") == "string" and node.get("format") == "date" and "pattern" not in node:
        del node["format"]
        node["pattern"] = ISO_DATE
    if node.get("type") == "string" and "format" in node and node["format"] not in GRAMMAR_FORMATS:
        del node["format"]  # (decoded as any string either way: its length bounds become a strict pattern)
    types = node.get("type")
    strings = types == "string" or (isinstance(types, list) and "string" in types)  # (["string", "null"] too)
    if strings and ("maxLength" in node or "minLength" in node) and "pattern" not in node and "format" not in node:
        lo, hi = int(node.pop("minLength", 0)), node.pop("maxLength", None)
        if max(lo, hi or 0) > STRICT_LENGTH_LIMIT:
            return node  # (any string: the bounds are validated after)
        char = '(?:[^"\\\\\\x00-\\x1f]|\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})'  # one JSON string character
        node["pattern"] = "^%s{%d,%s}$" % (char, lo, "" if hi is None else int(hi))
    if isinstance(node.get("pattern"), str) or node.get("format") in GRAMMAR_FORMATS:
        node.pop("minLength", None)  # (xgrammar decodes the pattern or the format alone)
        node.pop("maxLength", None)
    return node


def _repeat_counts(pattern: str) -> list[int]:
    """The numbers of a pattern's counted repetitions ({n}, {m,n}, {m,}), outside character
    classes and escapes."""
    counts, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1: i + 2] == "]" or pattern[i + 1: i + 3] == "^]":  # (a ] first is a member)
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "{":
            m = re.match(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", pattern[i:])
            if m:
                counts += [int(n) for n in m.groups() if n]
                i += m.end()
                continue
        i += 1
    return counts


def _patterns(schema):
    """Every string `pattern` and `patternProperties` key in a schema (its subschemas included),
    each occurrence."""
    for node in subschemas(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from node["patternProperties"]


def _check_patterns(xgr, schema, strict) -> None:
    """Refuse a pattern that xgrammar 0.2.9 would constrain as raw text. It matches a pattern
    against the string's characters, written as JSON escapes where JSON needs them, unless the
    pattern itself names a quote, a backslash or a control character (`^".$`, `^C:\\\\`,
    `^a\\n$`): then the whole pattern is matched against the JSON text between the quotes, and
    its quote, backslash, newline and every `.` or class are written unescaped, which is not JSON.
    Which way it goes shows in the grammar (a `Regex(` rule is the escaped way). Also refuse
    counts xgrammar would take too long to build: one pattern's, and all of `strict`'s (the
    schema as the grammar gets it, its strict strings' length patterns included) together."""
    patterns = list(dict.fromkeys(_patterns(schema)))  # each distinct pattern once
    for pattern in patterns:  # (counted before any is built: the counts bound the time)
        counts = _repeat_counts(pattern)
        if counts and max(counts) > MAX_PATTERN_REPEAT:
            raise StructuredOutputError(
                f"the pattern {_shown(pattern)} repeats {max(counts):,} times: more than {MAX_PATTERN_REPEAT:,} takes "
                f"xgrammar too long to build (its time grows with the square of the count); use + or *, or a "
                f"maxLength beside the pattern (validated after decoding)")
    # every occurrence of every count, the strict strings' length patterns included: what the
    # grammar will build
    total = sum(sum(_repeat_counts(p)) for p in _patterns(strict))
    if total > MAX_SCHEMA_REPEAT:
        raise StructuredOutputError(
            f"the schema's patterns and string lengths count {total:,} repetitions in all, more than "
            f"{MAX_SCHEMA_REPEAT:,}: xgrammar would take too long to build them; use + or * in some patterns, or "
            f"leave some lengths out (validated after decoding)")
    for pattern in patterns:
        try:
            text = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}),
                                                    any_whitespace=False))
        except Exception:  # noqa: BLE001 -- the whole schema's compile gives xgrammar's reason
            continue
        if "Regex(" not in text:
            if not _names_raw(pattern):
                raise StructuredOutputError(
                    f"the pattern {_shown(pattern)} is too large for xgrammar to hold as a JSON string's pattern "
                    f"(its repetitions, nested, multiply); make the counts smaller or use + and *")
            raise StructuredOutputError(
                f"the pattern {_shown(pattern)} names a quote, a backslash or a control character, which xgrammar "
                "would write unescaped inside the JSON string (an answer that is not JSON); write the pattern "
                "without them (a negated class such as [^\\n] is fine)")


def _shown(pattern: str) -> str:
    return repr(pattern) if len(pattern) <= 80 else repr(pattern[:77]) + "..."


def _names_raw(pattern: str) -> bool:
    """Whether a pattern names a quote, a backslash or a control character (what makes xgrammar
    match it against the raw JSON text)."""
    return ('"' in pattern or "\\\\" in pattern or any(ord(c) < 32 for c in pattern)
            or re.search(r"\\(?:[nrtfv0]|x[01][0-9a-fA-F]|x22|x5[cC]|u00[01][0-9a-fA-F]|u0022|u005[cC]|c)",
                         pattern) is not None)


def grammar(xgr, params: StructuredOutputsParams):
    """The xgrammar Grammar of a constraint (no tokenizer needed): what the engine compiles, and
    what `compile_problem` checks before a model loads."""
    if params.kind == "json":
        try:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"the json constraint is not valid JSON: {e}") from None
        stray = stray_ref(schema)
        if stray is not None:
            raise StructuredOutputError(f"the json constraint does not compile: $ref {stray!r} points outside the "
                                        f"schema's subschemas: move what it names under $defs (\"#/$defs/NAME\")")
        strict = _strict_strings(schema)
        _check_patterns(xgr, schema, strict)
        return xgr.Grammar.from_json_schema(json.dumps(bounded_numbers(strict)),
                                            any_whitespace=False)
    if params.kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if params.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_gbnf_string(c) for c in params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


def compile_problem(params: StructuredOutputsParams) -> str | None:
    """Why xgrammar cannot compile this constraint (its own reason), or None. Schemas that pass
    the JSON Schema checks can still be beyond it: `false` subschemas, fractional integer bounds,
    empty ranges, regex backreferences."""
    try:
        grammar(_xgrammar(), params)
    except StructuredOutputError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 -- xgrammar raises RuntimeError/ValueError with its reason
        return _reason(e)
    return None


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text)


def _gbnf_string(text: str) -> str:
    """A GBNF string literal for text."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)
