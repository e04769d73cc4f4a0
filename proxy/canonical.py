"""Canonical JSON (RFC 8785, JCS): the one encoding that the log hashes and that stack fingerprints are made of.

`canonical_json` gives the bytes of `rfc8785.dumps`, the reference, at the speed of orjson wherever orjson's output
is provably the same. For the values records hold the two agree on everything but a few floats:

- strings: both escape `"`, `\\`, `\\b \\f \\n \\r \\t` and every other control character as lowercase `\\u00xx`,
  and write everything else as UTF-8 (DEL, U+2028, astral characters included);
- integers: both write digits; orjson refuses beyond ±(2**53 - 1) (OPT_STRICT_INTEGER), as JCS does;
- key order: JCS sorts keys by UTF-16 code units, orjson by code points, which agree unless a key holds a
  character at or above U+E000 (a surrogate pair of an astral character sorts below U+E000..U+FFFF in UTF-16);
- floats: both write the shortest digits that round-trip, but orjson writes integral floats as `1.0`, `-0.0`,
  `1e+16`, and numbers from 1e-6 to 1e-5 as `1.5e-6`, where ECMAScript writes `1`, `0`, `10000000000000000` and
  `0.0000015`; orjson writes NaN and infinities as `null`, which JCS refuses.

So one walk over the value checks what orjson would not: exact JSON types (no subclasses, tuples or other objects
that orjson would serialise its own way) and finite floats; floats that orjson formats differently are written
here (`_ecmascript_number`) and handed to orjson as ready fragments. Keys are looked at only when the output holds
a character at or above U+E000 at all (orjson itself refuses keys that are not exactly `str`). Whatever
the walk is unsure of goes to `rfc8785` whole, so the result and the errors are the reference's. A property test
(tests/test_canonical.py) holds the two equal over record-like values. This module knows nothing of records.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson
import rfc8785

_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER
# The first character at which UTF-16 and code point order part ways (see the module docstring), and the UTF-8
# lead bytes of it and every character after it.
_FIRST_MISORDERED = "\ue000"
_HIGH_LEAD_BYTES = tuple(
    bytes([lead]) for lead in range(0xEE, 0xF5)
)  # searched one by one: memchr, not a regex


class NotCanonicalizable(ValueError):
    """A value has no RFC 8785 form: NaN or infinite floats, integers beyond 2**53, non-string keys."""


class _Unsure(Exception):
    """The value holds something the fast path does not vouch for: the reference encoder decides."""


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of a JSON value; raises NotCanonicalizable with the reason."""
    try:
        encoded = orjson.dumps(_fast_form(value), option=_OPTIONS)
        # A key at or above U+E000 leaves one of these lead bytes in the output; without any, no key can.
        if not encoded.isascii() and any(lead in encoded for lead in _HIGH_LEAD_BYTES):
            _check_key_order(value)
        return encoded
    except (_Unsure, orjson.JSONEncodeError):
        # Lone surrogates, integers beyond 2**53 and keys that are not exactly str reach here through orjson's
        # refusal.
        return _reference(value)


@dataclass(frozen=True, slots=True)
class CanonicalDocument:
    """A JSON document in canonical form, with the SHA-256 of those bytes (its address): made once, so that what
    refers to the document by its hash never canonicalises it again."""

    json: str
    sha256: str

    @classmethod
    def of(cls, value: Any) -> CanonicalDocument:
        encoded = canonical_json(value)
        return cls(encoded.decode("utf-8"), hashlib.sha256(encoded).hexdigest())


def _reference(value: Any) -> bytes:
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, UnicodeEncodeError) as exc:
        raise NotCanonicalizable(f"value cannot be written as canonical JSON (RFC 8785): {exc}") from exc


def _fast_form(value: Any) -> Any:
    """`value` as orjson may write it: itself, or a copy in which every float orjson would format otherwise
    than ECMAScript is a ready fragment. Raises _Unsure for anything else it does not vouch for."""
    kind = type(value)
    if kind is dict:
        return _object(value)
    if kind is list:
        return _array(value)
    if kind is float:
        return _number(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    raise _Unsure


def _object(value: dict[Any, Any]) -> dict[str, Any]:
    copy: dict[str, Any] | None = None
    for key, item in value.items():
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if kind is float:
            written = _number(item)
        elif kind is dict:
            written = _object(item)
        elif kind is list:
            written = _array(item)
        else:
            raise _Unsure
        if written is not item:
            if copy is None:
                copy = dict(value)
            copy[key] = written
    return value if copy is None else copy


def _array(value: list[Any]) -> list[Any]:
    copy: list[Any] | None = None
    for index, item in enumerate(value):
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if kind is float:
            written = _number(item)
        elif kind is dict:
            written = _object(item)
        elif kind is list:
            written = _array(item)
        else:
            raise _Unsure
        if written is not item:
            if copy is None:
                copy = list(value)
            copy[index] = written
    return value if copy is None else copy


def _check_key_order(value: Any) -> None:
    """Raises _Unsure if any key of `value` holds a character whose UTF-16 order is not its code point order."""
    pending = [value]
    while pending:
        item = pending.pop()
        if type(item) is dict:
            if any(not key.isascii() and max(key) >= _FIRST_MISORDERED for key in item):
                raise _Unsure
            pending.extend(item.values())
        elif type(item) is list:
            pending.extend(item)


def _number(value: float) -> float | orjson.Fragment:
    if value - value != 0.0:  # NaN or an infinity, which orjson would write as null
        raise _Unsure
    magnitude = abs(value)
    # Where orjson's text is ECMAScript's: integral floats from 1e21 up (exponent form in both), non-integral
    # ones outside [1e-6, 1e-5), tiny ones below 1e-6 (exponent form in both).
    if magnitude >= 1e21 or 0.0 < magnitude < 1e-6:
        return value
    if magnitude >= 1e-5 and not value.is_integer():
        return value
    return orjson.Fragment(_ecmascript_number(value).encode("ascii"))


def _ecmascript_number(value: float) -> str:
    """ECMAScript's Number::toString (ECMA-262, 6.1.6.1.20) for a finite float: the shortest round-trip
    digits, which Python's repr also finds, laid out by ECMAScript's rules."""
    if value == 0.0:
        return "0"  # -0 too
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    # `point`: how many digits stand before the decimal point, once leading zeros are gone (ECMAScript's n).
    point = len(whole) + (int(exponent) if exponent else 0)
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    count = len(digits)  # ECMAScript's k
    if count <= point <= 21:
        return sign + digits + "0" * (point - count)
    if 0 < point <= 21:
        return sign + digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return sign + "0." + "0" * -point + digits
    shown = point - 1
    tail = "e" + ("+" if shown >= 0 else "-") + str(abs(shown))
    return sign + (digits if count == 1 else digits[0] + "." + digits[1:]) + tail
