"""Sealed entries: made by `seal` from values the proxy built, their bytes and hashes made once, and refused with
the field named when a value is wrong."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from proxy.audit import InvalidEntry, SealedEntry, seal, stack_fingerprint
from proxy.audit.entries import entry_text, prompt_sha256, sha256_hex
from proxy.audit.merkle import leaf_hash
from proxy.canonical import CanonicalDocument, canonical_json

STACK = {"schema": 1, "model": "tiny", "kernel_mode": "batch_invariant"}
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
VALUES: dict[str, Any] = {
    "record_id": "r1",
    "part": "answer",
    "tenant": "acme",
    "created_at": T0,
    "status": "complete",
    "content": {"b": 1, "a": [0.5]},
}


def sealed(**overrides: Any) -> SealedEntry:
    return seal(**{**VALUES, "stack": CanonicalDocument.of(STACK), **overrides})


def test_an_entry_is_hashed_once_from_its_own_fields() -> None:
    made = sealed(prompt_text="Be terse.", stack_declared=True, replica="replica-a", model="tiny")
    assert made.encoded == entry_text(made).encode()
    whole = {**made.header(), "content": {"a": [0.5], "b": 1}}
    assert made.encoded == canonical_json(whole), "spliced, yet the whole entry's JCS"
    assert made.sha256 == sha256_hex(made.encoded.decode()) and made.leaf_hash == leaf_hash(made.encoded)
    assert '"stack_declared":true' in made.encoded.decode()
    assert made.content_json == '{"a":[0.5],"b":1}' and made.content == {"a": [0.5], "b": 1}


def test_the_fingerprint_is_filled_in_from_the_stack() -> None:
    made = sealed()
    assert made.fingerprint == stack_fingerprint(STACK)
    assert made.stack_json == canonical_json(STACK).decode() and made.stack == STACK


def test_an_entry_without_a_stack_names_none_and_declares_nothing() -> None:
    made = sealed(stack=None, part="flag", status="stack_changed", stack_declared=True)
    assert made.fingerprint is None and made.stack_declared is None and made.stack_json is None
    assert '"stack_declared":null' in made.encoded.decode()


def test_created_at_is_kept_in_utc() -> None:
    made = sealed(created_at=T0.astimezone(timezone(timedelta(hours=5))))
    assert made.created_at == T0 and made.created_at.utcoffset() == timedelta(0)
    assert made == sealed(), "one instant, one entry, whatever the zone it was given in"


def test_a_prompt_is_addressed_by_the_sha256_of_its_text() -> None:
    assert sealed(prompt_text="Be terse.").prompt_sha256 == prompt_sha256("Be terse.")
    given = sealed(prompt_text="Be terse.", prompt_sha256=prompt_sha256("Be terse."))
    assert given == sealed(prompt_text="Be terse."), "the prompt version's own hash, trusted"
    assert sealed().prompt_sha256 is None and sealed().prompt_text is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"content": {"logprob": math.nan}}, "content: value cannot be written as canonical JSON"),
        ({"content": {"n": 2**53}}, "content: value cannot be written as canonical JSON"),
        ({"fingerprint": "0" * 64}, "does not match the stack given"),
        ({"created_at": datetime(2026, 1, 2, 3, 4, 5)}, "created_at must carry a time zone"),
        ({"part": "answered"}, r"part must be one of \['answer', 'closed', 'flag', 'opened'\]"),
        ({"record_id": ""}, "record_id must be 1 to 100"),
        ({"tenant": "t" * 201}, "tenant must be 1 to 200"),
        ({"status": "s" * 65}, "status must be 1 to 64"),
        ({"status": None}, "status is required"),
        ({"tenant": "ac\x00me"}, "tenant must not contain NUL"),
        ({"model": "ti\x00ny"}, "model must not contain NUL"),
        ({"prompt_text": "Be \x00terse."}, "prompt_text must not contain NUL"),
        ({"model": "tiny\ud800"}, "the entry's fields: value cannot be written as canonical JSON"),
        ({"status": "ok\ud800"}, "the entry's fields: value cannot be written as canonical JSON"),
    ],
)
def test_what_the_proxy_may_still_get_wrong_is_refused_with_the_field_named(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidEntry, match=message):
        sealed(**overrides)


def test_an_entry_has_no_field_for_anything_else() -> None:
    """Secrets travel only in headers: an entry has no field a key could be put in by mistake."""
    with pytest.raises(TypeError, match="api_key"):
        sealed(api_key="sk-secret")
