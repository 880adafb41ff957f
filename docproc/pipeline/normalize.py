"""Normalising dates and amounts as printed on business documents, for answer parsing and
evaluation. Pure functions, no torch."""
from __future__ import annotations

import re
import unicodedata
from datetime import date, datetime
from decimal import Decimal, InvalidOperation

MONTHS = {m.lower(): i for i, m in enumerate(
    ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
     "November", "December"], start=1)}
MONTHS.update({k[:3]: v for k, v in list(MONTHS.items())})
MONTHS["sept"] = 9

# year first, with -, / or . between (one kind), and an ISO time after it that is left out
_ISO = re.compile(r"^(\d{4})([-/.])(\d{1,2})\2(\d{1,2})(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?$")
_COMPACT = re.compile(r"^(\d{4})(\d{2})(\d{2})$")  # 20230902
_DMY_DOT = re.compile(r"^(\d{1,2})\.(\d{1,2})\.(\d{4})$")
_SLASH = re.compile(r"^(\d{1,2})([/-])(\d{1,2})\2(\d{4})$")
_MDY_WORDS = re.compile(r"^([A-Za-z]+)\.?\s+(\d{1,2}),?\s+(\d{4})$")
_DMY_WORDS = re.compile(r"^(\d{1,2})\.?\s+([A-Za-z]+)\.?,?\s+(\d{4})$")


def normalize_date(text: str | None) -> str | None:
    """ISO date (YYYY-MM-DD) for the formats our documents use, else None.

    Year-first dates may use -, / or . and carry an ISO time (left out); eight digits are
    YYYYMMDD. Dotted dates are day.month.year (the European convention). Slashed (or dashed)
    dates are ambiguous; they are read day/month/year unless the first number cannot be a
    day-first month (> 12 as month).
    """
    if not text:
        return None
    s = text.strip().rstrip(".")
    y = m = d = None
    if mo := _ISO.match(s):
        y, m, d = int(mo.group(1)), int(mo.group(3)), int(mo.group(4))
    elif mo := _COMPACT.match(s):
        y, m, d = (int(x) for x in mo.groups())
    elif mo := _DMY_DOT.match(s):
        d, m, y = (int(x) for x in mo.groups())
    elif mo := _SLASH.match(s):
        a, b, y = int(mo.group(1)), int(mo.group(3)), int(mo.group(4))
        d, m = (a, b) if b <= 12 else (b, a)
    elif mo := _MDY_WORDS.match(s):
        m, d, y = MONTHS.get(mo.group(1).lower()), int(mo.group(2)), int(mo.group(3))
    elif mo := _DMY_WORDS.match(s):
        d, m, y = int(mo.group(1)), MONTHS.get(mo.group(2).lower()), int(mo.group(3))
    if m is None:
        return None
    try:
        return date(y, m, d).isoformat()
    except (TypeError, ValueError):
        return None


_AMOUNT_CHARS = re.compile(r"[^\d.,\-]")


def normalize_amount(text: str | None) -> str | None:
    """A plain decimal string ("1234.56") from amounts printed as 1,234.56 / 1.234,56 /
    1 234,56 / 1234.56 / 1'234.56, with or without a currency code or symbol; None if unreadable.

    The last separator followed by one or two digits is the decimal point; every other separator
    groups thousands.
    """
    if text is None:
        return None
    s = _AMOUNT_CHARS.sub("", str(text).replace("\u2212", "-"))
    if not s or not any(c.isdigit() for c in s):
        return None
    neg = s.startswith("-")
    s = s.lstrip("-")
    m = re.search(r"[.,](\d{1,2})$", s)
    if m:
        whole, frac = s[: m.start()], m.group(1)
    else:
        whole, frac = s, ""
    whole = re.sub(r"[.,]", "", whole)
    if not whole.isdigit() and whole != "":
        return None
    if len(whole) > 24:  # beyond any amount (and beyond quantize's default 28-digit precision)
        return None
    try:
        value = Decimal(f"{whole or '0'}.{frac or '0'}").quantize(Decimal("0.01"))
    except InvalidOperation:
        return None
    return f"{'-' if neg and value != 0 else ''}{value}"


def normalize_text(text: str | None) -> str | None:
    """Case-, space- and Unicode-composition-insensitive form for string fields (NFC: an `é`
    typed as e + a combining accent is the same text as the one character)."""
    if text is None:
        return None
    return unicodedata.normalize("NFC", " ".join(str(text).split()).casefold()) or None


def format_date(d: date, fmt: str) -> str:
    return datetime(d.year, d.month, d.day).strftime(fmt)
