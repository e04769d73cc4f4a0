"""An entry's bytes: canonical JSON, the documented entry object, and the chain envelope of chained entries."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.audit.entries import (
    GENESIS_SHA256,
    EntryFields,
    NotCanonicalizable,
    StoredFields,
    chain_hash,
    entry_bytes,
    entry_text,
    envelope_text,
    format_timestamp,
    load_canonical,
    parse_content,
    prompt_sha256,
    stack_fingerprint,
)
from proxy.audit.header import HEADER
from proxy.canonical import canonical_json


def canonical_text(value: Any) -> str:
    return canonical_json(value).decode("utf-8")


T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
SAFE_INT = 2**53 - 1
NEVER_CHAINED = {f.name for f in HEADER if not f.chained}

keys = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-SAFE_INT, SAFE_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(keys, json_values, max_size=5)
fields_strategy = st.builds(
    EntryFields,
    record_id=st.text(min_size=1, max_size=8),
    part=st.sampled_from(["answer", "opened", "closed", "flag"]),
    tenant=st.text(min_size=1, max_size=8),
    created_at=st.datetimes(datetime(1970, 1, 1), datetime(9000, 1, 1), timezones=st.just(UTC)),
    replica=st.none() | st.text(max_size=8),
    model=st.none() | st.text(max_size=8),
    fingerprint=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
    prompt_sha256=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
    replay_of=st.none() | st.text(min_size=1, max_size=8),
    status=st.text(min_size=1, max_size=8),
    content_json=json_objects.map(canonical_text),
    stack_declared=st.none() | st.booleans(),
)


def fields(record_id: str = "r1", **overrides: Any) -> EntryFields:
    values: dict[str, Any] = {
        "record_id": record_id,
        "part": "answer",
        "tenant": "acme",
        "created_at": T0,
        "replica": "replica-a",
        "model": "tiny",
        "fingerprint": "ab" * 32,
        "prompt_sha256": None,
        "replay_of": None,
        "status": "complete",
        "content": {"token_ids": [1, 2], "token_logprobs": [-0.5, -1.25]},
    }
    values.update(overrides)
    values["content_json"] = canonical_text(values.pop("content"))
    return EntryFields(**values)


def test_an_entry_is_the_documented_object() -> None:
    """Written out by hand from docs/audit.md, so a change to an entry's bytes cannot pass unnoticed."""
    text = (
        '{"content":{"token_ids":[1,2],"token_logprobs":[-0.5,-1.25]},'
        '"created_at":"2026-01-02T03:04:05.678901Z","fingerprint":"' + "ab" * 32 + '","model":"tiny",'
        '"part":"answer","prompt_sha256":null,"record_id":"r1","replay_of":null,"replica":"replica-a",'
        '"stack_declared":false,"status":"complete","tenant":"acme"}'
    )
    made = fields(stack_declared=False)
    assert entry_text(made) == text
    assert StoredFields(made, hashlib.sha256(text.encode()).hexdigest()).text() == text


def test_a_chained_entry_keeps_the_documented_envelope() -> None:
    """The hash chain's envelope, as revisions 0001 and 0002 wrote it: it never held stack_declared."""
    envelope = (
        '{"entry":{"content":{"token_ids":[1,2],"token_logprobs":[-0.5,-1.25]},'
        '"created_at":"2026-01-02T03:04:05.678901Z","fingerprint":"' + "ab" * 32 + '","model":"tiny",'
        '"part":"answer","prompt_sha256":null,"record_id":"r1","replay_of":null,"replica":"replica-a",'
        '"status":"complete","tenant":"acme"},"position":1,"prev":"' + "0" * 64 + '"}'
    )
    assert (
        chain_hash(1, GENESIS_SHA256, fields(stack_declared=True))
        == hashlib.sha256(envelope.encode()).hexdigest()
    )
    assert StoredFields(fields(), "", chained_at=(1, GENESIS_SHA256)).text() == envelope


def test_a_stack_fingerprint_is_sha256_of_its_canonical_json() -> None:
    stack = {"schema": 1, "model": "tiny", "software": {"torch": "2.13.0", "cuda": None}}
    expected = '{"model":"tiny","schema":1,"software":{"cuda":null,"torch":"2.13.0"}}'
    assert stack_fingerprint(stack) == hashlib.sha256(expected.encode()).hexdigest()
    assert prompt_sha256("Ünïcode") == hashlib.sha256("Ünïcode".encode()).hexdigest()


@settings(max_examples=60)
@given(fields_strategy, st.integers(1, 10**12), st.text("0123456789abcdef", min_size=64, max_size=64))
def test_the_bytes_are_the_canonical_json_of_the_documented_objects(
    fields: EntryFields, position: int, prev: str
) -> None:
    """The stored content text is spliced into an entry's bytes; that must equal canonicalizing it all."""
    content = load_canonical(fields.content_json)
    assert entry_text(fields) == canonical_text({**fields.header(), "content": content})
    whole = {"position": position, "prev": prev, "entry": {**fields.header(chained=True), "content": content}}
    assert envelope_text(position, prev, fields) == canonical_text(whole)


@given(json_objects)
def test_canonical_json_ignores_key_order_and_round_trips(value: dict[str, Any]) -> None:
    reordered = dict(reversed(list(value.items())))
    text = canonical_text(value)
    assert canonical_text(reordered) == text
    assert canonical_text(load_canonical(text)) == text, (
        "stored content must hash the same after reading it back"
    )
    assert parse_content(text) == (load_canonical(text), True)


def test_an_integral_float_beyond_2_to_the_53_reads_back_as_a_float() -> None:
    text = canonical_text({"x": 2.0**60, "n": 7})
    assert text == '{"n":7,"x":1152921504606847000}'
    assert load_canonical(text) == {"n": 7, "x": 2.0**60}
    assert parse_content(text)[1], "JCS output must count as canonical when read back"


@pytest.mark.parametrize(
    "value", [{"x": math.nan}, {"x": math.inf}, {"x": 2**60}, {1: "non-string key"}, {"x": "\ud800"}]
)
def test_values_without_a_canonical_form_are_refused(value: dict[Any, Any]) -> None:
    with pytest.raises(NotCanonicalizable, match="canonical JSON"):
        canonical_json(value)


def test_a_timestamp_has_one_spelling_per_instant() -> None:
    elsewhere = T0.astimezone(timezone(timedelta(hours=-7)))
    assert format_timestamp(elsewhere) == format_timestamp(T0) == "2026-01-02T03:04:05.678901Z"
    with pytest.raises(ValueError, match="time zone"):
        format_timestamp(T0.replace(tzinfo=None))
    assert format_timestamp(datetime(999, 1, 1, tzinfo=UTC)) == "0999-01-01T00:00:00.000000Z"


@settings(max_examples=60)
@given(fields_strategy, st.sampled_from(sorted(EntryFields.__dataclass_fields__)), st.integers(1, 10**12))
def test_every_field_is_covered_by_the_bytes(base: EntryFields, name: str, position: int) -> None:
    before = chain_hash(position, GENESIS_SHA256, base)
    text = entry_text(base)
    changed: dict[str, Any] = {
        "created_at": base.created_at + timedelta(microseconds=1),
        "content_json": canonical_text(
            {**load_canonical(base.content_json), "\x00longer-than-any-key": True}
        ),
    }
    old = getattr(base, name)
    if name in changed:
        new_value = changed[name]
    elif name == "stack_declared":
        new_value = old is not True
    else:
        new_value = "x" if old is None else old + "x"
    edited = replace(base, **{name: new_value})
    assert entry_text(edited) != text
    if name not in NEVER_CHAINED:  # the chain's envelope never held these (stack_declared)
        assert chain_hash(position, GENESIS_SHA256, edited) != before
    assert chain_hash(position + 1, GENESIS_SHA256, base) != before
    assert chain_hash(position, "1" * 64, base) != before


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a":1}', ({"a": 1}, True)),
        ('{"a": 1}', ({"a": 1}, False)),
        ('{"b":1,"a":2}', ({"b": 1, "a": 2}, False)),
        ("[1,2]", (None, False)),
        ("not json", (None, False)),
    ],
)
def test_parse_content_tells_canonical_from_not(text: str, expected: tuple[Any, bool]) -> None:
    assert parse_content(text) == expected


@settings(max_examples=60)
@given(fields_strategy)
def test_an_entry_spliced_from_its_contents_bytes_is_its_text_in_utf8(fields: EntryFields) -> None:
    assert entry_bytes(fields, fields.content_json.encode()) == entry_text(fields).encode()
