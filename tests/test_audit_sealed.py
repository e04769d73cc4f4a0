"""The request path's entries: sealed from values the proxy built, the validated entry's bytes, refused alike."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest

from proxy.audit import InvalidEntry, NewEntry, SealedEntry, seal, stack_fingerprint
from proxy.audit.entries import prompt_sha256, sha256_hex
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


def new(**overrides: Any) -> NewEntry:
    return NewEntry(**{**VALUES, "stack": STACK, **overrides})


def sealed(**overrides: Any) -> SealedEntry:
    return seal(**{**VALUES, "stack": CanonicalDocument.of(STACK), **overrides})


def test_the_request_paths_entry_is_the_validated_entrys_byte_for_byte() -> None:
    """`seal` skips validation of what the proxy built itself; what it makes must not differ in any byte."""
    prompt = "Be terse."
    made = new(prompt_text=prompt, stack_declared=True, replica="replica-a", model="tiny").sealed()
    fast = sealed(prompt_text=prompt, prompt_sha256=prompt_sha256(prompt), stack_declared=True,
                  replica="replica-a", model="tiny")  # fmt: skip
    assert fast == made
    assert (
        fast.encoded
        == new(prompt_text=prompt, stack_declared=True, replica="replica-a", model="tiny").text.encode()
    )
    assert fast.sha256 == sha256_hex(fast.encoded.decode()) and fast.leaf_hash == leaf_hash(fast.encoded)
    assert fast.fingerprint == stack_fingerprint(STACK) and fast.stack_json == canonical_json(STACK).decode()


def test_the_request_paths_entry_without_a_stack_names_none() -> None:
    made = sealed(stack=None, part="flag", status="stack_changed")
    assert made.fingerprint is None and made.stack_declared is None and made.stack_json is None
    assert made == new(stack=None, part="flag", status="stack_changed").sealed()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"content": {"logprob": math.nan}}, "content: value cannot be written as canonical JSON"),
        ({"content": {"n": 2**53}}, "content: value cannot be written as canonical JSON"),
        ({"fingerprint": "0" * 64}, "does not match the stack given"),
        ({"created_at": datetime(2026, 1, 2, 3, 4, 5)}, "time zone"),
        ({"part": "answered"}, "part must be one of"),
        ({"record_id": ""}, "record_id"),
        ({"tenant": "t" * 201}, "tenant"),
        ({"status": "s" * 65}, "status"),
        ({"tenant": "ac\x00me"}, "tenant must not contain NUL"),
        ({"model": "ti\x00ny"}, "model must not contain NUL"),
        ({"prompt_text": "Be \x00terse."}, "prompt_text must not contain NUL"),
        ({"model": "tiny\ud800"}, "the entry's fields: value cannot be written as canonical JSON"),
    ],
)
def test_the_request_paths_entry_refuses_what_the_proxy_may_still_get_wrong(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidEntry, match=message):
        sealed(**overrides)
