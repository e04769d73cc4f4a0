"""Canonical JSON: byte for byte what the reference RFC 8785 encoder (`rfc8785`) writes, or its refusal."""

from __future__ import annotations

import math
import struct
from enum import IntEnum
from typing import Any

import orjson
import pytest
import rfc8785
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.canonical import _HIGH_LEAD_BYTES, NotCanonicalizable, _fast_form, _Unsure, canonical_json

SAFE_INT = 2**53 - 1


def reference(value: Any) -> bytes:
    return rfc8785.dumps(value)


def float_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


# Every float a record can hold, not only the ones a uniform draw favours: any bit pattern (subnormals, every
# exponent), the boundaries where ECMAScript switches notation, integral floats on both sides of 2**53.
finite_floats = (
    st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(0, 2**64 - 1).map(float_from_bits).filter(math.isfinite)
    | st.sampled_from([1e-7, 1e-6, 1e-5, 1e15, 1e16, 1e20, 1e21, 1e22, 2.0**53, 2.0**53 + 2]).flatmap(
        lambda edge: st.sampled_from([edge, -edge, math.nextafter(edge, 0), math.nextafter(edge, math.inf)])
    )
    | st.integers(-(2**70), 2**70).map(float)
    | st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308])
)
characters = st.characters(exclude_categories=("Cs",))  # every code point but lone surrogates
texts = st.text(characters, max_size=12) | st.text(
    st.sampled_from('\x00\x01\x08\t\n\x0c\r\x1f\x7f"\\/\u2028\u2029\ue000\uffff\U0001f600\U0010ffff é'),
    max_size=8,
)
scalars = st.none() | st.booleans() | st.integers(-SAFE_INT, SAFE_INT) | finite_floats | texts
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=1500)
@given(values)
@example({"\ue000": 1, "\U0001f600": 2})
@example({"a": [1.0, -0.0, 1.5e-6, 1e16, 1e21, 123456789012345680.0]})
def test_the_bytes_are_the_reference_encoders(value: Any) -> None:
    assert canonical_json(value) == reference(value)


@settings(max_examples=3000)
@given(finite_floats)
def test_every_float_is_written_as_ecmascript_writes_it(number: float) -> None:
    assert canonical_json(number) == reference(number), repr(number)
    assert canonical_json([number]) == reference([number]) and canonical_json({"x": number}) == reference(
        {"x": number}
    )


@pytest.mark.parametrize(
    ("number", "text"),
    [
        (1.0, b"1"),
        (-0.0, b"0"),
        (0.0, b"0"),
        (1e-6, b"0.000001"),
        (1.5e-6, b"0.0000015"),
        (1e-7, b"1e-7"),
        (1e-5, b"0.00001"),
        (1e16, b"10000000000000000"),
        (9.999999999999999e20, b"999999999999999900000"),
        (1e21, b"1e+21"),
        (1.5e21, b"1.5e+21"),
        (5e-324, b"5e-324"),
        (1.7976931348623157e308, b"1.7976931348623157e+308"),
        (-3.4e-8, b"-3.4e-8"),
        (0.1, b"0.1"),
    ],
)
def test_floats_at_the_boundaries_of_ecmascript_notation(number: float, text: bytes) -> None:
    assert canonical_json(number) == text == reference(number)


def test_keys_sort_by_utf16_code_units() -> None:
    """An astral character is a surrogate pair, which sorts below U+E000..U+FFFF in UTF-16."""
    value = {"\uffff": 1, "\U0001f600": 2, "z": 3, "é": 4}
    assert canonical_json(value) == reference(value)
    assert canonical_json(value).index("😀".encode()) < canonical_json(value).index("\uffff".encode())


def test_strings_keep_the_reference_escapes() -> None:
    text = "".join(chr(c) for c in range(0x30)) + '\x7f\u2028\u2029"\\/\U0001f600'
    assert canonical_json(text) == reference(text)
    assert canonical_json({text[:5]: text}) == reference({text[:5]: text})


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        math.inf,
        {"logprob": -math.inf},
        [1, [2, {"x": math.nan}]],
        2**53,
        -(2**53),
        {"n": 2**64},
        "\ud800",
        {"a": "x\udc00"},
        {"\ud800": 1},
        {1: "non-string key"},
        {"x": object()},
    ],
)
def test_what_has_no_canonical_form_is_refused(value: Any) -> None:
    with pytest.raises(NotCanonicalizable, match="cannot be written as canonical JSON"):
        canonical_json(value)


def test_the_largest_safe_integers_are_written() -> None:
    assert canonical_json([SAFE_INT, -SAFE_INT]) == b"[9007199254740991,-9007199254740991]"


class Level(IntEnum):
    LOW = 1


def test_values_the_fast_path_does_not_vouch_for_get_the_reference_form() -> None:
    """Tuples and subclasses are not what records hold; they are written as the reference writes them."""
    for value in [(1, 2.0), {"level": Level.LOW}, [True, (None,)]]:
        assert canonical_json(value) == reference(value)


def test_the_value_given_is_not_changed() -> None:
    value = {"a": [1.0, {"b": -0.0}], "c": 2.5}
    canonical_json(value)
    assert value == {"a": [1.0, {"b": -0.0}], "c": 2.5} and math.copysign(1, value["a"][1]["b"]) == -1


@settings(max_examples=500)
@given(values)
def test_the_fast_path_alone_is_right_wherever_it_vouches_for_a_value(value: Any) -> None:
    """The property above holds whichever encoder wrote the bytes; this one keeps the fast path under test."""
    try:
        fast = orjson.dumps(_fast_form(value), option=orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER)
    except (_Unsure, orjson.JSONEncodeError):
        return
    if not any(lead in fast for lead in _HIGH_LEAD_BYTES):
        assert fast == reference(value)


def test_a_record_takes_the_fast_path() -> None:
    token = {
        "token": " Paris",
        "logprob": -0.0,
        "bytes": [32, 80],
        "top_logprobs": [{"token": "x", "logprob": 0.0}],
    }
    record = {"response": {"choices": [{"logprobs": {"content": [token] * 3}, "text": "é 😀"}]}, "seed": 7}
    fast = _fast_form(record)
    assert orjson.dumps(fast, option=orjson.OPT_SORT_KEYS) == reference(record) == canonical_json(record)
