"""What each query type's answer may be, as a constraint the engine decodes under, and the same
rules checked on an answer decoded without one (no xgrammar installed). Torch-free.

A `date` answer is a date in a form the normaliser reads (ISO, 31.12.2024, 12/31/2024,
"December 31, 2024", "31 Dec 2024") or "none"; a `number` is an amount as printed (digits with
thousands separators and one to two decimals, a currency code or symbol before or after) or
"none"; a `string` is one line of printable text. The value column then holds the normalised
form: an ISO date, a plain decimal. A `json` query's answer is one JSON object, valid for its
schema when it has one. The patterns are written in the regex subset that xgrammar and Python's
`re` read alike. What they let grow is bounded (an amount has at most 18 integer digits, a date's
spaces come one to three at a time), so no answer can run on without end; an answer that nears its
max_tokens is closed by the engine (engine/structured.py, BudgetMatcher).
"""
from __future__ import annotations

import importlib.util
import json
import re

from docproc.pipeline import json_schema

_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]


def _names(months: list[str]) -> str:
    """Month names and abbreviations, in three cases, longest first."""
    forms = {f(n) for m in months for n in (m, m[:3], *(["Sept"] if m == "September" else [])) for f in
             (str, str.upper, str.lower)}
    return "(" + "|".join(sorted(forms, key=lambda n: (-len(n), n))) + ")"


_YEAR = "[12][0-9]{3}"
# years with a 29 February: multiples of 4, centuries only when a multiple of 400
_LEAP = "([12][0-9]([02468][48]|[2468]0|[13579][26])|1200|1600|2000|2400|2800)"
# (month, day, year) that make a real date: a month of 31, of 30 days, February, 29 February
_CALENDAR = [("(0?[13578]|1[02])", "(0?[1-9]|[12][0-9]|3[01])", _YEAR),
             ("(0?[469]|11)", "(0?[1-9]|[12][0-9]|30)", _YEAR),
             ("0?2", "(0?[1-9]|1[0-9]|2[0-8])", _YEAR),
             ("0?2", "29", _LEAP)]
_NAMED = [(_names([m for i, m in enumerate(_MONTHS) if i in (0, 2, 4, 6, 7, 9, 11)]), _CALENDAR[0][1], _YEAR),
          (_names(["April", "June", "September", "November"]), _CALENDAR[1][1], _YEAR),
          (_names(["February"]), _CALENDAR[2][1], _YEAR), (_names(["February"]), "29", _LEAP)]
_LATE_DAY = {"(0?[1-9]|[12][0-9]|3[01])": "(1[3-9]|2[0-9]|3[01])", "(0?[1-9]|[12][0-9]|30)": "(1[3-9]|2[0-9]|30)",
             "(0?[1-9]|1[0-9]|2[0-8])": "(1[3-9]|2[0-8])", "29": "29"}


def _dates(form: str, table=_CALENDAR) -> str:
    """The real dates of a form ({m}, {d}, {y} in it): one alternative per kind of month."""
    return "|".join(form.format(m=m, d=d, y=y) for m, d, y in table)


NONE_PATTERN = "(none|None|NONE|null)"
# an optional space first: a model may spell an answer as read after its label (" CHF"); a date
# may end in a full stop (the normaliser drops it). Only real dates: a day that its month has, 29
# February in leap years. Slashed dates are read day/month unless the second number is over 12
# (pipeline/normalize.py): day/month, or month/day with a day from 13 on.
DATE_PATTERN = (" ?(" + "|".join([
    _dates("{y}-{m}-{d}"),  # ISO
    _dates("{d}\\.{m}\\.{y}\\.?"),  # 31.12.2024
    _dates("{d}/{m}/{y}"), "|".join(f"{m}/{_LATE_DAY[d]}/{y}" for m, d, y in _CALENDAR),  # 31/12/2024, 12/31/2024
    _dates("{m}\\.? {{1,3}}{d},? {{1,3}}{y}\\.?", _NAMED),  # December 31, 2024
    _dates("{d}\\.? {{1,3}}{m}\\.?,? {{1,3}}{y}\\.?", _NAMED),  # 31 Dec 2024
    NONE_PATTERN]) + ")")
_CURRENCY = "([A-Za-z]{3}|[$€£¥₹])"
_SIGN = "[-−]?"  # ASCII or Unicode minus
# groups of three (1,234,567.89; 1 234,56; 1'234.50, also with a no-break space), Indian grouping
# (1,23,456.00), plain digits, or decimals alone (.50)
_INTEGER = "([0-9]{1,3}([ ,.'\u00a0][0-9]{3}){1,5}|[0-9]{1,2}(,[0-9]{2}){1,6},[0-9]{3}|[0-9]{1,18})"
_AMOUNT = f"({_INTEGER}([.,][0-9]{{1,2}})?|[.,][0-9]{{1,2}})"
# one sign at most, before the currency or after it (-$12.00, $-12.00)
NUMBER_PATTERN = f" ?(({_SIGN}({_CURRENCY} ?)?|{_CURRENCY} ?{_SIGN}){_AMOUNT}( ?{_CURRENCY})?|{NONE_PATTERN})"
STRING_PATTERN = " ?[^\\x00-\\x1f]+"  # one line of printable text
ANY_OBJECT = {"type": "object"}  # a json query without a schema: some JSON object
# what the parser reads as no answer (queries.NONE_ANSWERS): allowed when answers are checked
_NONE_WORDS = {"", "none", "null", "n/a", "na", "-"}

SCHEMA_PROBLEM = "not valid for the schema"  # how answer_allowed's schema breaches begin

PATTERNS = {"date": DATE_PATTERN, "number": NUMBER_PATTERN, "string": STRING_PATTERN}
# What a rule is fingerprinted as: the text of its first form. What was added since (at most 18
# integer digits and 5 thousands groups, one to three spaces in a row, only real dates) refuses
# only answers that nothing stored under the first form can usefully hold (they were parse errors
# or never written), so documents done under it are not redone for them. A change that can change
# an answer must change this text.
_ANY_NAME = "(" + "|".join(sorted({f(n) for n in _MONTHS + [m[:3] for m in _MONTHS] + ["Sept"]
                                   for f in (str, str.upper, str.lower)}, key=lambda n: (-len(n), n))) + ")"
_DAY, _MONTH = "(0?[1-9]|[12][0-9]|3[01])", "(0?[1-9]|1[0-2])"
RULE_FINGERPRINTS = {
    "date": " ?(" + "|".join([f"[0-9]{{4}}-{_MONTH}-{_DAY}", f"{_DAY}\\.{_MONTH}\\.[0-9]{{4}}\\.?",
                              "[0-9]{1,2}/[0-9]{1,2}/[0-9]{4}", f"{_ANY_NAME}\\.? +{_DAY},? +[0-9]{{4}}\\.?",
                              f"{_DAY}\\.? +{_ANY_NAME}\\.?,? +[0-9]{{4}}\\.?", NONE_PATTERN]) + ")",
    "number": NUMBER_PATTERN.replace("[0-9]{3}){1,5}|", "[0-9]{3})+|").replace("[0-9]{2}){1,6},", "[0-9]{2})+,")
    .replace("|[0-9]{1,18})", "|[0-9]+)"),
    "string": STRING_PATTERN,
}
_COMPILED = {k: re.compile(v) for k, v in PATTERNS.items()}


def xgrammar_available() -> bool:
    """Whether answers can be decoded under their rules (without importing xgrammar, which
    imports torch)."""
    try:
        return importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):  # a broken install; or sys.modules["xgrammar"] = None
        return False


def answer_allowed(qtype: str, text: str, schema: str | None = None, choices: tuple[str, ...] | None = None,
                   constrained: bool = True) -> str | None:
    """Why an answer decoded without a constraint breaks its query's rule, or None if it keeps it
    (what decoding under the constraint guarantees)."""
    if choices is not None:
        return None if text in choices else f"not one of the choices: {text[:40]!r}"
    if qtype == "json":
        if schema is None:
            return None  # parse_answer looks for the object
        try:
            value = json_schema.loads(text)
        except json_schema.AnswerJSONError as e:
            return f"invalid JSON: {e}"
        except (ValueError, RecursionError):  # (JSONDecodeError; a number of more than 4,300 digits)
            return "not one JSON value"
        problem = json_schema.violation(value, json.loads(schema))
        return None if problem is None else f"{SCHEMA_PROBLEM}: {problem}"
    t = text.strip()
    if not constrained or t.lower().rstrip(".") in _NONE_WORDS or _COMPILED[qtype].fullmatch(t):
        return None
    return f"not a {qtype} answer: {text[:40]!r}"
