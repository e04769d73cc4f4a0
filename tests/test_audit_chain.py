"""The chain's pure functions: canonical JSON, entry hashes, and the walker that finds the first broken link."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.audit.chain import (
    GENESIS_SHA256,
    ChainWalker,
    EntryFields,
    Link,
    NotCanonicalizable,
    canonical_json,
    chain_links,
    check_prompt_row,
    check_stack_row,
    entry_hash,
    envelope_text,
    format_timestamp,
    load_canonical,
    parse_content,
    prompt_sha256,
    stack_fingerprint,
)

T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
SAFE_INT = 2**53 - 1

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
    content_json=json_objects.map(canonical_json),
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
    values["content_json"] = canonical_json(values.pop("content"))
    return EntryFields(**values)


def test_entry_hash_is_sha256_of_the_documented_envelope() -> None:
    """Written out by hand from docs/audit.md, so a change to the hashing cannot pass unnoticed."""
    envelope = (
        '{"entry":{"content":{"token_ids":[1,2],"token_logprobs":[-0.5,-1.25]},'
        '"created_at":"2026-01-02T03:04:05.678901Z","fingerprint":"' + "ab" * 32 + '","model":"tiny",'
        '"part":"answer","prompt_sha256":null,"record_id":"r1","replay_of":null,"replica":"replica-a",'
        '"status":"complete","tenant":"acme"},"position":1,"prev":"' + "0" * 64 + '"}'
    )
    assert entry_hash(1, GENESIS_SHA256, fields()) == hashlib.sha256(envelope.encode()).hexdigest()


def test_a_stack_fingerprint_is_sha256_of_its_canonical_json() -> None:
    stack = {"schema": 1, "model": "tiny", "software": {"torch": "2.13.0", "cuda": None}}
    expected = '{"model":"tiny","schema":1,"software":{"cuda":null,"torch":"2.13.0"}}'
    assert stack_fingerprint(stack) == hashlib.sha256(expected.encode()).hexdigest()
    assert prompt_sha256("Ünïcode") == hashlib.sha256("Ünïcode".encode()).hexdigest()


@settings(max_examples=60)
@given(fields_strategy, st.integers(1, 10**12), st.text("0123456789abcdef", min_size=64, max_size=64))
def test_the_envelope_is_the_canonical_json_of_the_documented_object(
    fields: EntryFields, position: int, prev: str
) -> None:
    """The hash splices the stored content text into the envelope; that must equal canonicalizing it all."""
    whole = {
        "position": position,
        "prev": prev,
        "entry": {**fields.header(), "content": load_canonical(fields.content_json)},
    }
    assert envelope_text(position, prev, fields) == canonical_json(whole)


@given(json_objects)
def test_canonical_json_ignores_key_order_and_round_trips(value: dict[str, Any]) -> None:
    reordered = dict(reversed(list(value.items())))
    text = canonical_json(value)
    assert canonical_json(reordered) == text
    assert canonical_json(load_canonical(text)) == text, (
        "stored content must hash the same after reading it back"
    )
    assert parse_content(text) == (load_canonical(text), True)


def test_an_integral_float_beyond_2_to_the_53_reads_back_as_a_float() -> None:
    text = canonical_json({"x": 2.0**60, "n": 7})
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
def test_every_field_is_covered_by_the_hash(base: EntryFields, name: str, position: int) -> None:
    before = entry_hash(position, GENESIS_SHA256, base)
    changed: dict[str, Any] = {
        "created_at": base.created_at + timedelta(microseconds=1),
        "content_json": canonical_json(
            {**load_canonical(base.content_json), "\x00longer-than-any-key": True}
        ),
    }
    old = getattr(base, name)
    new_value = changed.get(name, "x" if old is None else (old + "x" if isinstance(old, str) else None))
    assert entry_hash(position, GENESIS_SHA256, replace(base, **{name: new_value})) != before
    assert entry_hash(position + 1, GENESIS_SHA256, base) != before
    assert entry_hash(position, "1" * 64, base) != before


def _chain(count: int) -> list[Link]:
    return chain_links(0, GENESIS_SHA256, [fields(f"r{i}", content={"i": i}) for i in range(1, count + 1)])


def _walk(
    links: list[Link], page: int, head: tuple[int, str], expect_head: tuple[int, str] | None = None
) -> Any:
    walker = ChainWalker(expect_head)
    for start in range(0, len(links), page):
        if walker.feed(links[start : start + page]) is not None:
            break
    return walker.finish(*head)


@given(st.integers(1, 40), st.integers(1, 7))
def test_an_intact_chain_verifies_whatever_the_page_size(count: int, page: int) -> None:
    links = _chain(count)
    assert links[0].prev_sha256 == GENESIS_SHA256
    assert [link.position for link in links] == list(range(1, count + 1))
    assert _walk(links, page, (links[-1].position, links[-1].sha256)) is None


def test_an_empty_chain_verifies() -> None:
    assert _walk([], 5, (0, GENESIS_SHA256)) is None


MUTATIONS = ["edit", "rehash", "swap", "delete", "truncate", "truncate_and_rewind_head", "respace"]


@settings(max_examples=80)
@given(st.integers(3, 30), st.data(), st.sampled_from(MUTATIONS), st.integers(1, 7))
def test_any_single_tampering_is_found_and_located(
    count: int, data: st.DataObject, mutation: str, page: int
) -> None:
    links = _chain(count)
    head = (links[-1].position, links[-1].sha256)
    kept = head
    k = data.draw(st.integers(0, count - 2), label="index")
    tampered = list(links)
    expected_kind, expected_position = "", 0
    if mutation == "edit":
        tampered[k] = replace(links[k], fields=replace(links[k].fields, status="forged"))
        expected_kind, expected_position = "hash_mismatch", k + 1
    elif mutation == "rehash":
        tampered[k] = replace(links[k], sha256="f" * 64)
        expected_kind, expected_position = "hash_mismatch", k + 1
    elif mutation == "respace":
        respaced = " " + links[k].fields.content_json
        tampered[k] = replace(links[k], fields=replace(links[k].fields, content_json=respaced))
        expected_kind, expected_position = "content_not_canonical", k + 1
    elif mutation == "swap":
        first, second = links[k], links[k + 1]
        tampered[k] = replace(second, position=first.position)
        tampered[k + 1] = replace(first, position=second.position)
        expected_kind, expected_position = "prev_mismatch", k + 1
    elif mutation == "delete":
        del tampered[k]
        expected_kind, expected_position = "gap", k + 2
    elif mutation == "truncate":
        tampered = links[: k + 1]
        expected_kind, expected_position = "head_mismatch", k + 1
    else:
        tampered = links[: k + 1]
        head = (tampered[-1].position, tampered[-1].sha256)
        expected_kind, expected_position = "expect_head_mismatch", k + 1
        assert _walk(tampered, page, head) is None, "a cut tail with a rewound head needs the kept head"
    problem = _walk(tampered, page, head, expect_head=kept)
    assert problem is not None, f"{mutation} at index {k} went unnoticed"
    assert (problem.kind, problem.position) == (expected_kind, expected_position)


def test_a_kept_head_from_earlier_matches_a_chain_that_only_grew() -> None:
    links = _chain(10)
    head = (links[-1].position, links[-1].sha256)
    assert _walk(links, 3, head, expect_head=(4, links[3].sha256)) is None
    problem = _walk(links, 3, head, expect_head=(4, "9" * 64))
    assert problem is not None and (problem.kind, problem.position, problem.record_id) == (
        "expect_head_mismatch",
        4,
        "r4",
    )


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


def test_stored_stacks_and_prompts_are_checked_against_their_addresses() -> None:
    stack_text = canonical_json({"model": "tiny", "schema": 1})
    fingerprint = hashlib.sha256(stack_text.encode()).hexdigest()
    assert check_stack_row(fingerprint, stack_text) is None
    edited = check_stack_row(fingerprint, stack_text.replace("tiny", "huge"))
    assert edited is not None and edited.kind == "stack_hash_mismatch"
    assert check_prompt_row(prompt_sha256("Be terse."), "Be terse.") is None
    prompt = check_prompt_row(prompt_sha256("Be terse."), "Be verbose.")
    assert prompt is not None and prompt.kind == "prompt_hash_mismatch"
