"""What the audit store accepts: a `NewEntry` is checked when it is built, with messages that say what to fix."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.audit import EntryCheck, NewEntry, stack_fingerprint
from proxy.audit.entries import entry_text, prompt_sha256, sha256_hex
from proxy.audit.merkle import leaf_hash
from proxy.canonical import canonical_json

STACK = {"schema": 1, "model": "tiny", "kernel_mode": "batch_invariant"}
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def new(**overrides: Any) -> NewEntry:
    values: dict[str, Any] = {
        "record_id": "r1",
        "part": "answer",
        "tenant": "acme",
        "created_at": T0,
        "stack": STACK,
        "status": "complete",
        "content": {"b": 1, "a": [0.5]},
    }
    values.update(overrides)
    return NewEntry(**values)


def test_the_fingerprint_is_filled_in_from_the_stack() -> None:
    made = new()
    assert made.fingerprint == stack_fingerprint(STACK)
    assert made.stack_json == canonical_json(STACK).decode()
    assert made.content_json == '{"a":[0.5],"b":1}'


def test_a_fingerprint_that_does_not_match_its_stack_is_refused() -> None:
    with pytest.raises(ValidationError, match="does not match the stack given"):
        new(fingerprint="0" * 64)


def test_created_at_must_carry_a_zone_and_is_kept_in_utc() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        new(created_at=datetime(2026, 1, 2, 3, 4, 5))
    made = new(created_at=T0.astimezone(timezone(timedelta(hours=5))))
    assert made.created_at == T0 and made.created_at.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"content": {"logprob": math.nan}}, "content: value cannot be written as canonical JSON"),
        ({"stack": {"schema": math.inf}}, "stack: value cannot be written as canonical JSON"),
        ({"part": "answered"}, "'answer', 'opened', 'closed' or 'flag'"),
        ({"record_id": ""}, "record_id"),
        ({"tenant": "t" * 201}, "tenant"),
        ({"fingerprint": "XYZ", "stack": None}, "fingerprint"),
        ({"status": ""}, "status"),
        ({"api_key": "sk-secret"}, "api_key"),
        ({"tenant": "ac\x00me"}, "tenant must not contain NUL"),
        ({"prompt_text": "Be \x00terse."}, "prompt_text must not contain NUL"),
        ({"status": "ok\ud800"}, "status\n.*unicode"),
    ],
)
def test_bad_entries_are_refused_with_the_field_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        new(**overrides)


def test_a_prompt_is_addressed_by_the_sha256_of_its_text() -> None:
    assert new(prompt_text="Be terse.").prompt_sha256 == prompt_sha256("Be terse.")
    assert new().prompt_sha256 is None


def test_an_entry_is_hashed_once_from_its_own_fields() -> None:
    made = new(stack_declared=True)
    assert made.text == entry_text(made.fields())
    assert made.sha256 == sha256_hex(made.text) and made.leaf_hash == leaf_hash(made.text.encode())
    assert '"stack_declared":true' in made.text
    assert '"stack_declared":null' in new(stack=None, fingerprint=None).text, "no stack, nothing declared"


def test_an_entry_check_is_ok_only_when_every_part_holds() -> None:
    base = {"seq": 3, "index": 2, "part": "answer", "sha256": "a" * 64}
    assert EntryCheck(**base, recomputes=True, included=True).ok
    assert EntryCheck(**base, recomputes=True, included=None).ok, "not integrated yet is not a failure"
    assert not EntryCheck(**base, recomputes=True, included=False).ok
    assert not EntryCheck(**base, recomputes=False, included=True).ok
