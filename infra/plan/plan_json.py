"""The plan as one JSON document (`make plan FORMAT=json`): the bytes of Python's
`json.dumps(plan, indent=2)` (ASCII only, two-space indent, keys in the plan's order), written
by orjson (issue 44: Python's encoder with an indent is its pure-Python one, about 30 ms of a
4x-prod plan's render, orjson 3 ms).

orjson writes text as UTF-8 and Python as `\\uXXXX` escapes: the escapes are put back here, the
way Python's ASCII encoder writes them (DEL and everything above ASCII, characters beyond the
Basic Multilingual Plane as a surrogate pair). Where orjson's own forms differ from Python's and
cannot be mended as cheaply, the plan is encoded by Python's json instead: what orjson refuses
(integers beyond 64 bits, keys that are not text, lone surrogates, types it does not know) and
floats under 1e-4, which Python writes with an exponent of two digits or more (`1e-05`) and orjson
not (`0.00001`, `5e-8`). One difference is kept: a NaN or an infinity, which no plan holds (the
stack's amounts are finite, infra/model/spec_base.py) and which JSON cannot hold, is written as
`null` rather than Python's `NaN` / `Infinity`.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

import orjson

# orjson's forms of a float under 1e-4 (`0.00001799`, `5.98e-8`), which Python writes `1.799e-05`,
# `5.98e-08` (an exponent of one digit Python never writes). Found as text first (fast: literal
# searches), then each place checked to be a number where JSON puts one: after `[`, `:`, `,` or
# the indent, not inside a name such as `scrape-0-9100` or an ID such as `6e2e-7a09`. One inside
# text (`ratio: 1e-5`) falls back too, which costs time only.
_EXPONENT = re.compile(rb"e-[0-9]")
_DIGITS = frozenset(b"0123456789.")
_BEFORE = frozenset(b" \n[:,")


def _token_start(raw: bytes, at: int) -> int:
    """Where the number whose digits run up to `at` starts (its sign included)."""
    while at > 0 and raw[at - 1] in _DIGITS:
        at -= 1
    return at - 1 if at > 0 and raw[at - 1] == ord("-") else at


def _number(raw: bytes, start: int) -> bool:
    return start == 0 or raw[start - 1] in _BEFORE


def _small_float(raw: bytes) -> bool:
    """Whether orjson wrote a float under 1e-4 (see above)."""
    for found in _EXPONENT.finditer(raw):
        e, end = found.start(), found.end()
        start = _token_start(raw, e)
        if start < e and raw[e - 1] in b"0123456789" and _number(raw, start) \
                and (end == len(raw) or raw[end] not in b"0123456789"):
            return True
    at = raw.find(b"0.0000")
    while at >= 0:
        start = at - 1 if at > 0 and raw[at - 1] == ord("-") else at  # a number that starts "0.0000" or "-0.0000"
        if _token_start(raw, at) == start and _number(raw, start):
            return True
        at = raw.find(b"0.0000", at + 1)
    return False


# Subclasses of dict and list (an OrderedDict moved about, a list with its own `__iter__`) are
# written by Python through their own methods and by orjson from their contents; dataclasses and
# dates Python refuses and orjson writes: all of them go to Python's encoder (orjson refuses what
# it passes through). Two kinds orjson writes natively and Python refuses remain, the plan holds
# neither: a plain Enum member (its value) and a UUID (its text).
_OPTIONS = (orjson.OPT_INDENT_2 | orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
            | orjson.OPT_PASSTHROUGH_DATETIME)


def _escapes(error: UnicodeError) -> tuple[str, int]:
    """A codec error handler: the characters ASCII cannot hold as Python's ASCII encoder writes
    them (`\\u00e9`; beyond the Basic Multilingual Plane a surrogate pair), so that the encoder's
    own loop does the rest of the text."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    out = []
    for char in error.object[error.start:error.end]:
        code = ord(char)
        if code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            code -= 0x10000
            out.append(f"\\u{0xd800 | (code >> 10):04x}\\u{0xdc00 | (code & 0x3ff):04x}")
    return "".join(out), error.end


codecs.register_error("gts-json-escape", _escapes)


def dumps(plan: Any) -> str:
    """`json.dumps(plan, indent=2)`, byte for byte (but for the NaN above), faster."""
    try:
        raw = orjson.dumps(plan, option=_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(plan, indent=2)
    if _small_float(raw):
        return json.dumps(plan, indent=2)
    # orjson escapes what lies below ' ' as Python does (`\\n`, `\\u001f`); DEL and all above ASCII
    # it leaves as they are, and Python escapes them.
    if not raw.isascii():
        raw = raw.decode("utf-8").encode("ascii", "gts-json-escape")
    return raw.decode("ascii").replace("\x7f", "\\u007f")
