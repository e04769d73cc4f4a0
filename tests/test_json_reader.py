"""Reading JSON: whatever `json.loads` returns or raises, whichever parser did the reading."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.json_reader import read_json


def float_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


numbers = (
    st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(0, 2**64 - 1).map(float_from_bits).filter(math.isfinite)
)
texts = st.text(max_size=12)  # lone surrogates included: json.dumps escapes them
values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts, inner, max_size=5),
    max_leaves=30,
)
# Number literals as a client may write them, not only as Python writes them.
literals = st.builds(
    lambda sign, whole, fraction, exponent: sign + whole + fraction + exponent,
    st.sampled_from(["", "-"]),
    st.from_regex(r"\A(0|[1-9][0-9]{0,24})\Z"),
    st.sampled_from([""]) | st.from_regex(r"\A\.[0-9]{1,25}\Z"),
    st.sampled_from([""]) | st.from_regex(r"\A[eE][+-]?[0-9]{1,3}\Z"),
)


def same(text: bytes | str) -> None:
    expected = json.loads(text)
    assert repr(read_json(text)) == repr(expected)  # repr tells 1 from 1.0 and -0.0 from 0.0


@settings(max_examples=800)
@given(values, st.booleans())
def test_a_value_reads_as_json_loads_reads_it(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    same(text)
    same(text.encode("utf-8", "surrogatepass") if not ascii_only else text.encode())


@settings(max_examples=1500)
@given(literals)
def test_a_number_literal_reads_as_json_loads_reads_it(literal: str) -> None:
    same(literal)
    same(f'{{"n":[{literal}]}}'.encode())


def outcome(read: Any, text: bytes | str, **kwargs: Any) -> tuple[str, str]:
    try:
        return "value", repr(read(text, **kwargs))
    except (ValueError, RecursionError) as e:
        return type(e).__name__, str(e)


def refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@pytest.mark.parametrize(
    "text",
    [
        b'{"t": NaN}',
        b"[Infinity]",
        b"[-Infinity]",
        b'{"x": 1e400}',
        b'{"s": "\\ud800"}',
        b'{"\\udc00": 1}',
        b"\xef\xbb\xbf{}",
        '{"a": 1}'.encode("utf-16"),
        b'{"a": "\xff"}',
        b'{"n": 123456789012345678901234567890}',
        b'{"n": -9223372036854775809}',
        b'{"n": 18446744073709551616}',
        b'{"a": 1, "a": 2}',
        b"[" * 2000 + b"]" * 2000,
        b"[" * 1030 + b"]" * 1030,
        b'{"a": 1,}',
        b"",
        b'"\x01"',
        b"[1] x",
    ],
)
def test_what_json_loads_refuses_or_bends_is_refused_or_bent_the_same(text: bytes) -> None:
    assert outcome(read_json, text) == outcome(json.loads, text)
    assert outcome(read_json, text, parse_constant=refuse_constant) == outcome(
        json.loads, text, parse_constant=refuse_constant
    )
