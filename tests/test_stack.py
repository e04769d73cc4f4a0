"""The stack fingerprint: SHA-256 of RFC 8785 canonical JSON, stable across key order and processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from proxy.canonical import canonical_json
from proxy.stack import Stack, fingerprint, fingerprinted
from tests.support.fake_replica import fingerprint_of, tiny_stack

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6))
def test_fingerprint_ignores_key_order(document: dict[str, object]) -> None:
    reversed_order = dict(reversed(list(document.items())))
    assert fingerprint(document) == fingerprint(reversed_order)
    assert fingerprint(document) == hashlib.sha256(canonical_json(document)).hexdigest()


@given(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=6))
def test_fingerprint_changes_with_any_value(document: dict[str, object]) -> None:
    changed = {**document, next(iter(document)): ["changed"]}
    if changed != document:
        assert fingerprint(changed) != fingerprint(document)


def test_a_stack_round_trips_to_the_document_the_backend_hashed() -> None:
    document = tiny_stack()
    stack = Stack.model_validate(document)
    assert stack.document() == document
    assert stack.fingerprint == fingerprint_of(document)


def test_a_capacity_limited_moes_stack_hashes_as_the_backend_hashed_it() -> None:
    routing = {"policy": "capacity", "capacity_factor": 1.25, "overflow": "next_expert"}
    document = {**tiny_stack(), "kernel_mode": "batch_invariant_kernels"}
    document["batching"] = {**document["batching"], "expert_routing": routing}
    stack = Stack.model_validate(document)
    assert (stack.kernel_mode, stack.document()) == ("batch_invariant_kernels", document)
    assert stack.fingerprint == fingerprint_of(document)
    assert not stack.batch_invariant, "its answers depend on the batch, whatever its kernels"
    assert Stack.model_validate(tiny_stack()).batch_invariant


def test_the_fingerprint_is_the_same_in_another_process() -> None:
    document = tiny_stack()
    code = "import json,sys; from proxy.stack import fingerprint; print(fingerprint(json.loads(sys.stdin.read())))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(document, sort_keys=False),
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip() == fingerprint(document)


def test_a_declared_stack_fills_every_key() -> None:
    stack = Stack(model="gpt-4o-mini-2024-07-18")
    document = stack.document()
    assert set(document) == set(tiny_stack())
    assert document["kernel_mode"] == "unknown" and document["weights_sha256"] is None


def test_a_schema_2_stack_names_its_embedding_and_round_trips() -> None:
    document = {**tiny_stack(), "schema": 2, "embedding": {"pooling": "mean", "normalized": True}}
    stack = Stack.model_validate(document)
    assert stack.document() == document and stack.fingerprint == fingerprint_of(document)
    assert "embedding" not in Stack(model="m").document(), "a schema-1 stack's fingerprint is what it was"
    with pytest.raises(ValidationError, match="names its 'embedding'"):
        Stack.model_validate({**tiny_stack(), "schema": 2})


def test_the_serving_features_of_the_batching_policy_are_left_out_of_the_fingerprint() -> None:
    plain = tiny_stack()
    features = {"prefix_cache": True, "speculation": {"method": "prompt_lookup", "draft_tokens": 4}}
    served = tiny_stack(batching={**plain["batching"], **features})
    assert fingerprinted(served) == plain
    assert fingerprint(served) == fingerprint(plain) == hashlib.sha256(canonical_json(plain)).hexdigest()
    assert fingerprint(tiny_stack(batching={**plain["batching"], "max_batch_size": 9})) != fingerprint(plain)


def test_a_stack_is_canonicalised_once_into_the_document_its_fingerprint_addresses() -> None:
    stack = Stack.model_validate(tiny_stack())
    assert stack.canonical.json.encode() == canonical_json(stack.document())
    assert stack.canonical.sha256 == stack.fingerprint
    assert stack.canonical is stack.canonical, "made once per stack, not once per entry"
