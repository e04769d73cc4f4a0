"""What a record shows as a stored response: its body, its listed input, why one is not shown, and the entry that
deletes one."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from proxy.audit import AuditRecord, EntryView
from proxy.errors import BadRequest, NotFound
from proxy.state.stored_responses import (
    deletion_entry,
    input_page,
    page,
    record_id_of,
    sequence_number,
    stored_body,
    stored_events,
    unreadable,
    with_id,
)

NOW = datetime(2026, 12, 3, 4, 5, 6, tzinfo=UTC)
HEX = "ab" * 16


def entry(part: str, status: str, content: dict[str, Any]) -> EntryView:
    return EntryView(seq=1, index=None, part=part, created_at=NOW, status=status, replica="r", model="m",  # type: ignore[arg-type]
                     fingerprint="f" * 64, stack_declared=False, content=content, sha256="0" * 64)  # fmt: skip


def record(*entries: EntryView, flags: tuple[EntryView, ...] = ()) -> AuditRecord:
    return AuditRecord(id=f"rec_{HEX}", tenant="local", created_at=NOW, model="m", fingerprint="f" * 64,
                       replica="r", replay_of=None, status=entries[-1].status, stack=None, stack_declared=False,
                       prompt_sha256=None, prompt_text=None, entries=list(entries), flags=list(flags))  # fmt: skip


def answered(request: dict[str, Any]) -> AuditRecord:
    content = {"endpoint": "/v1/responses", "request": {"messages": []}, "translated_from": request,
               "response": {"id": f"resp_{HEX}", "object": "response", "output": [], "status": "completed"}}  # fmt: skip
    return record(entry("answer", "complete", content))


def test_a_response_id_names_its_record_and_anything_else_is_a_404() -> None:
    assert record_id_of(f"resp_{HEX}") == f"rec_{HEX}"
    with pytest.raises(NotFound, match="resp_<32 hex>"):
        record_id_of(f"rec_{HEX}")


def test_what_is_not_shown_says_why() -> None:
    assert unreadable(answered({"input": "hi"})) is None
    assert unreadable(None) == "no response of yours has this id"
    assert "store: false" in str(unreadable(answered({"input": "hi", "store": False})))
    deleted = answered({"input": "hi"})
    deleted.flags.append(entry("flag", "deleted", {"reason": "deleted"}))
    assert unreadable(deleted) == "it was deleted"
    chat = record(
        entry("answer", "complete", {"endpoint": "/v1/chat/completions", "request": {}, "response": {}})
    )
    assert unreadable(chat) == "its record holds no response"
    with pytest.raises(NotFound, match="store: false"):
        stored_body(answered({"store": False}), f"resp_{HEX}")


def test_the_stored_body_carries_the_stack_and_an_interrupted_stream_says_it_failed() -> None:
    body = stored_body(answered({"input": "hi"}), f"resp_{HEX}")
    assert body["system_fingerprint"] == "f" * 64 and body["status"] == "completed"
    opened = entry("opened", "streaming", {"endpoint": "/v1/responses", "request": {}})
    assert stored_body(record(opened), f"resp_{HEX}")["status"] == "in_progress"
    closed = entry("closed", "interrupted", {"answer": {"object": "response", "status": "in_progress"},
                                             "events": [], "terminal": None, "error": "replica: gone"})  # fmt: skip
    failed = stored_body(record(opened, closed), f"resp_{HEX}")
    assert failed["status"] == "failed" and failed["error"]["message"] == "replica: gone"


def test_a_streams_events_are_given_again_after_a_sequence_number() -> None:
    events = [f'event: e\ndata: {{"type": "e", "sequence_number": {n}}}\n\n' for n in range(3)]
    terminal = 'event: response.completed\ndata: {"type": "response.completed", "sequence_number": 3}\n\n'
    opened = entry("opened", "streaming", {"endpoint": "/v1/responses", "request": {}})
    closed = entry("closed", "complete", {"events": events, "terminal": terminal, "answer": {}})
    assert stored_events(record(opened, closed), "r", 1) == [events[2], terminal]
    assert stored_events(record(opened, closed), "r", None) == [*events, terminal]
    assert sequence_number("data: [DONE]\n\n") == -1
    with pytest.raises(BadRequest, match="not streamed"):
        stored_events(answered({}), f"resp_{HEX}", None)


def test_input_items_are_typed_given_ids_and_paged_as_openai_pages_them() -> None:
    assert with_id({"role": "user", "content": "hi"}, HEX, 0) == {
        "type": "message", "role": "user", "id": f"msg_{HEX}_0", "status": "completed",
        "content": [{"type": "input_text", "text": "hi"}],
    }  # fmt: skip
    assert with_id({"type": "message", "id": "msg_x", "role": "assistant", "content": "a"}, HEX, 1)[
        "content"
    ] == [{"type": "output_text", "text": "a"}]
    items = [{"id": str(i)} for i in range(5)]
    assert page(items, after=None, limit=2, order="asc") == {
        "object": "list", "data": items[:2], "first_id": "0", "last_id": "1", "has_more": True,
    }  # fmt: skip
    assert [i["id"] for i in page(items, after="3", limit=9, order="desc")["data"]] == ["2", "1", "0"]
    with pytest.raises(BadRequest, match="after"):
        page(items, after="9", limit=2, order="asc")
    listed = input_page(answered({"input": "hi"}), f"resp_{HEX}", after=None, limit=20, order="asc")
    assert [i["id"] for i in listed["data"]] == [f"msg_{HEX}_0"]


def test_deleting_is_a_flag_entry_on_the_record() -> None:
    sealed = deletion_entry(answered({}), f"resp_{HEX}", NOW)
    assert (sealed.record_id, sealed.part, sealed.status, sealed.tenant) == (
        f"rec_{HEX}",
        "flag",
        "deleted",
        "local",
    )
