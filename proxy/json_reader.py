"""Reading JSON: the value `json.loads` gives, at orjson's speed wherever orjson is known to give the same.

Both follow RFC 8259 and refuse the same malformed texts (control characters in strings, trailing commas, leading
zeros, trailing data), keep the last of duplicate keys, and give the same strings and correctly rounded floats.
They part ways where `json.loads` is lenient and orjson refuses (NaN and Infinity, 1e400 read as infinity, lone
surrogates, a byte order mark, UTF-16 or UTF-32 bytes, nesting past 1024), and where orjson turns an integer
beyond 64 bits into a float while `json.loads` keeps it exact. The first kind is handed to `json.loads` when
orjson refuses; the second cannot be seen from orjson's answer, so a text holding a run of 19 digits (the shortest
integer that may leave 64 bits) goes to `json.loads` unread by orjson. Either way the caller sees exactly what
`json.loads` returns or raises, so what the proxy refuses, and the messages saying why, stay what they were
(proxy/serving/recordable.py). This module knows nothing of requests or replicas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

_LONG_DIGITS = re.compile(r"\d{19}")
# Bytes: every ASCII digit as "0" and every other byte as " ", so that a run of 19 digits is a run of 19 zeros,
# which a substring search finds ten times as fast as the regex does (every request's body and answer pass here).
_DIGITS_AS_ZEROS = bytes(ord("0") if ord("0") <= byte <= ord("9") else ord(" ") for byte in range(256))
_LONG_RUN = b"0" * 19


def read_json(text: bytes | str, *, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """`json.loads(text, parse_constant=parse_constant)`: its value, or its exception."""
    if isinstance(text, bytes):
        long_digits = _LONG_RUN in text.translate(_DIGITS_AS_ZEROS)
    else:
        long_digits = _LONG_DIGITS.search(text) is not None
    if not long_digits:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # json.loads decides: it may read what orjson refuses, and it says why in its own words
    if parse_constant is None:
        return json.loads(text)
    return json.loads(text, parse_constant=parse_constant)
