"""Building records (proxy/serving/records.py): which audit entries a served request becomes, field by field.

A non-streamed answer is one `answer` entry; a stream is an `opened` entry and a `closed` one; a stream a stopped
proxy left open is closed at the next start; a `flag` marks an earlier record. Each entry holds the exact request
as forwarded and the stack that served it; what a field holds is what these tests say.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from proxy.audit import InvalidEntry, OpenStream, SealedEntry
from proxy.audit.entries import payload_sha256
from proxy.pins import Pin
from proxy.replicas.kinds import STACKPIN, UPSTREAM
from proxy.replicas.registry import Registry, Replica, ReplicaSnapshot
from proxy.serving.prompts import PromptBook
from proxy.serving.records import (
    DECODING_KEYS,
    PAYLOAD_KEYS,
    Served,
    answer_entry,
    closed_entry,
    decoding_settings,
    flag_entry,
    interrupted_at_start_entry,
    opened_entry,
)
from proxy.stack import Stack
from tests.support.fake_replica import tiny_stack

RECEIVED = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
NOW = RECEIVED + timedelta(seconds=2)
STACK = Stack.model_validate(tiny_stack())
RECORD = "rec_" + "a" * 32
CHAT = "/v1/chat/completions"
FORWARDED = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "temperature": 0,
    "seed": 7,
    "max_tokens": 3,
    "stream": False,
}
RESPONSE = {
    "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "the quiet"}, "finish_reason": "length"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    "system_fingerprint": STACK.fingerprint,
}
EVENTS = ['data: {"choices": [{"index": 0, "delta": {"content": "the"}}]}\n\n']


def replica(*, declared: bool = False) -> ReplicaSnapshot:
    """A replica in rotation with STACK, proved (or declared, as an upstream's configuration does)."""
    registry = Registry.of([Replica("replica-0", "http://127.0.0.1:9", UPSTREAM if declared else STACKPIN)])
    registry.observe("replica-0", STACK, STACK.fingerprint, RECEIVED)
    served_by = registry.get("replica-0")
    assert served_by is not None
    return served_by.snapshot()


def served(*, declared: bool = False, **overrides: Any) -> Served:
    """The one place a served request is built for these tests."""
    fields: dict[str, Any] = {
        "record_id": RECORD,
        "tenant": "acme",
        "endpoint": CHAT,
        "pin": Pin(model="fake-model", kernel_mode="batch_invariant"),
        "route": None,
        "prompt": None,
        "replica": replica(declared=declared),
        "forwarded": FORWARDED,
        "received_at": RECEIVED,
    }
    return Served(**{**fields, **overrides})


def closed(**overrides: Any) -> SealedEntry:
    fields: dict[str, Any] = {
        "status": "complete",
        "events": EVENTS,
        "terminal": "data: [DONE]\n\n",
        "answer": RESPONSE,
        "replica_answer": None,
        "upstream_fingerprint": "upstream-fp",
        "error": None,
    }
    return closed_entry(served(), NOW, **{**fields, **overrides})


def test_an_answer_is_one_complete_entry_naming_the_record_tenant_replica_and_stack() -> None:
    entry = answer_entry(served(), RESPONSE, NOW)
    assert (entry.record_id, entry.part, entry.status, entry.tenant) == (RECORD, "answer", "complete", "acme")
    assert entry.created_at == NOW
    assert (entry.replica, entry.model) == ("replica-0", "fake-model")
    assert entry.fingerprint == STACK.fingerprint
    assert entry.stack == STACK.document(), "the whole stack, not only its fingerprint"
    assert not entry.stack_declared
    assert entry.prompt_text is None and entry.replay_of is None


def test_an_answers_content_is_the_request_as_forwarded_and_the_whole_body_the_client_got() -> None:
    content = answer_entry(served(), RESPONSE, NOW).content
    assert content == {
        "endpoint": CHAT,
        "request": FORWARDED,
        "pin": {"model": "fake-model", "kernel_mode": "batch_invariant"},
        "route": None,
        "prompt": None,
        "decoding": {"temperature": 0, "seed": 7, "max_tokens": 3},
        "stack_declared": False,
        "stack_source": "proven",
        "received_at": RECEIVED.isoformat(),
        "stream": False,
        "response": RESPONSE,
        "upstream_fingerprint": None,
        "answered_at": NOW.isoformat(),
    }


def test_the_decoding_settings_are_every_decoding_key_the_forwarded_request_sets_and_nothing_else() -> None:
    everything = {key: f"value of {key}" for key in DECODING_KEYS}
    assert decoding_settings({**everything, "messages": [], "model": "m", "stream": True}) == everything
    assert decoding_settings({"messages": []}) == {}
    assert decoding_settings({"temperature": None}) == {"temperature": None}, "set to null is still set"


def test_a_prompt_version_is_recorded_as_its_exact_text_and_its_name_version_and_hash() -> None:
    prompt = PromptBook.from_config({"support@3": "You answer in one sentence."}).resolve("support@3")
    entry = answer_entry(served(prompt=prompt, route="support"), RESPONSE, NOW)
    assert entry.prompt_text == "You answer in one sentence."
    assert entry.content["prompt"] == {"name": "support", "version": 3, "sha256": prompt.sha256}
    assert entry.content["route"] == "support"


def test_the_replicas_own_fingerprint_is_kept_beside_the_one_the_client_got() -> None:
    upstream = {"system_fingerprint": "fp_upstream"}
    content = answer_entry(served(), RESPONSE, NOW, upstream=upstream).content
    assert content["upstream_fingerprint"] == "fp_upstream"
    assert "upstream" not in content, "a fingerprint alone is not repeated"
    replaced = {"system_fingerprint": "fp_upstream", "id": "resp_theirs"}
    content = answer_entry(served(), RESPONSE, NOW, upstream=replaced).content
    assert content["upstream"] == replaced, "whatever else the proxy replaced is kept whole"


def test_a_translated_request_keeps_the_clients_request_where_it_went_and_the_replicas_own_answer() -> None:
    client = {"model": "fake-model", "input": "hello"}
    translated = served(endpoint="/v1/responses", replica_endpoint=CHAT, translated_from=client)
    content = answer_entry(translated, {"object": "response"}, NOW, replica_response=RESPONSE).content
    assert content["endpoint"] == "/v1/responses" and content["replica_endpoint"] == CHAT
    assert content["translated_from"] == client and content["request"] == FORWARDED
    assert content["response"] == {"object": "response"} and content["replica_response"] == RESPONSE


def test_a_continued_response_names_the_record_it_continues() -> None:
    content = answer_entry(served(continues="rec_" + "b" * 32), RESPONSE, NOW).content
    assert content["continues"] == "rec_" + "b" * 32


def test_a_tag_is_kept_beside_the_request_only_when_the_client_gave_one() -> None:
    assert answer_entry(served(tag="study/st-1/a/c1/0"), RESPONSE, NOW).content["tag"] == "study/st-1/a/c1/0"
    assert opened_entry(served(tag="mine"), NOW).content["tag"] == "mine"
    assert "tag" not in answer_entry(served(), RESPONSE, NOW).content


def test_a_replay_is_recorded_as_its_original_was_linked_to_it_with_its_outcome() -> None:
    outcome = {"outcome": "reproduced", "of": "rec_" + "c" * 32}
    entry = answer_entry(served(replay_of="rec_" + "c" * 32), RESPONSE, NOW, replay=outcome)
    assert entry.replay_of == "rec_" + "c" * 32 and entry.content["replay"] == outcome
    assert entry.content["request"] == FORWARDED


def test_a_declared_stack_says_so_in_the_entry_and_its_content() -> None:
    entry = answer_entry(served(declared=True), RESPONSE, NOW)
    assert entry.stack_declared and entry.content["stack_declared"] is True
    assert entry.content["stack_source"] == "declared"
    assert answer_entry(served(), RESPONSE, NOW).content["stack_source"] == "proven"
    assert entry.stack == STACK.document()


def test_a_stream_opens_with_the_request_alone_before_any_answer() -> None:
    entry = opened_entry(served(), NOW)
    assert (entry.part, entry.status, entry.created_at) == ("opened", "streaming", NOW)
    assert entry.fingerprint == STACK.fingerprint and entry.stack == STACK.document()
    request = dict(answer_entry(served(), RESPONSE, NOW).content)
    for answered in ("stream", "response", "upstream_fingerprint", "answered_at"):
        del request[answered]
    assert entry.content == {**request, "stream": True, "opened_at": NOW.isoformat()}


def test_a_stream_closes_with_every_event_the_client_read_the_terminal_one_and_their_answer() -> None:
    entry = closed()
    assert (entry.part, entry.status, entry.record_id) == ("closed", "complete", RECORD)
    assert entry.fingerprint == STACK.fingerprint and entry.replica == "replica-0"
    assert entry.content == {
        "events": EVENTS,
        "terminal": "data: [DONE]\n\n",
        "answer": RESPONSE,
        "usage": RESPONSE["usage"],
        "chunks": 1,
        "upstream_fingerprint": "upstream-fp",
        "error": None,
        "closed_at": NOW.isoformat(),
    }


def test_an_interrupted_stream_closes_with_what_was_sent_and_why() -> None:
    entry = closed(status="interrupted", terminal=None, answer=None, error="client went away: CancelledError")
    assert entry.status == "interrupted"
    assert entry.content["error"] == "client went away: CancelledError"
    assert entry.content["events"] == EVENTS and entry.content["chunks"] == 1
    assert entry.content["answer"] is None and entry.content["usage"] is None


def test_a_translated_or_replayed_stream_keeps_the_replicas_own_answer_and_the_outcome() -> None:
    plain = closed()
    assert "replica_answer" not in plain.content and "replay" not in plain.content
    entry = closed(replica_answer=RESPONSE, replay={"outcome": "diverged"})
    assert entry.content["replica_answer"] == RESPONSE and entry.content["replay"] == {"outcome": "diverged"}


def test_an_answer_the_log_cannot_hold_fails_as_its_entry_is_built() -> None:
    # No JSON reader carries this integer exactly, so canonical JSON refuses it; serving then serves nothing.
    unsafe = {**RESPONSE, "stackpin": {"seed": 2**63 - 1}}
    with pytest.raises(InvalidEntry, match=r"^payload: .*canonical JSON"):
        answer_entry(served(), unsafe, NOW)
    with pytest.raises(InvalidEntry, match=r"^payload: .*canonical JSON"):
        closed(answer=unsafe)


def test_a_stream_left_open_by_a_stopped_proxy_closes_as_interrupted_knowing_nothing_it_sent() -> None:
    left_open = OpenStream(record_id=RECORD, tenant="acme", created_at=RECEIVED, replica="replica-0",
                           model="fake-model", fingerprint=STACK.fingerprint)  # fmt: skip
    entry = interrupted_at_start_entry(left_open, NOW)
    assert (entry.part, entry.status, entry.record_id, entry.tenant) == (
        "closed",
        "interrupted",
        RECORD,
        "acme",
    )
    assert (entry.replica, entry.model, entry.fingerprint) == ("replica-0", "fake-model", STACK.fingerprint)
    assert entry.stack is None, "the opened entry holds it"
    assert entry.content["marked_at_start"] is True and "proxy stopped" in entry.content["error"]
    assert {k: v for k, v in entry.content.items() if v is None} == {
        k: None for k in ("events", "terminal", "answer", "usage", "chunks", "upstream_fingerprint")
    }
    assert entry.content["closed_at"] == NOW.isoformat()


def test_a_flag_marks_an_earlier_record_with_its_reason_and_the_evidence() -> None:
    detail = {"registered": STACK.fingerprint, "observed": "f" * 64, "last_good_check": RECEIVED.isoformat()}
    entry = flag_entry(RECORD, "acme", NOW, reason="stack_changed", replica="replica-0", detail=detail)
    assert (entry.part, entry.status, entry.record_id, entry.tenant) == (
        "flag",
        "stack_changed",
        RECORD,
        "acme",
    )
    assert entry.replica == "replica-0" and entry.created_at == NOW
    assert entry.model is None and entry.fingerprint is None and entry.stack is None
    assert entry.content == {"reason": "stack_changed", **detail}


def test_what_the_client_said_and_got_is_the_payload_kept_apart_under_a_salted_hash() -> None:
    """So that it can be erased while the entry, and every proof of it, stays (proxy/audit/erasure.py)."""
    answered = answer_entry(served(), RESPONSE, NOW)
    streamed = closed()
    assert set(answered.payload or {}) == {"request", "response"}
    assert set(streamed.payload or {}) == {"events", "terminal", "answer"}
    for entry in (answered, streamed):
        hashed = json.loads(entry.encoded)
        assert not set(hashed["content"]) & PAYLOAD_KEYS, "none of it in the log's hashed bytes"
        assert hashed["payload_sha256"] == entry.payload_sha256 and entry.salt is not None
        assert payload_sha256(entry.salt, entry.payload_json or "") == entry.payload_sha256
    assert answer_entry(served(), RESPONSE, NOW).payload_sha256 != answered.payload_sha256, (
        "a new salt each time"
    )
    flag = flag_entry(RECORD, "acme", NOW, reason="stack_changed", replica="replica-0", detail={})
    assert flag.payload is None and "payload_sha256" not in json.loads(flag.encoded)
