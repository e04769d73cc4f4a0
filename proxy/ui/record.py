"""One record as the page shows it: the request as forwarded, the answer, timings, replay and flags. Pure.

Everything comes from the record's entries as the store returns them (`AuditRecord`); nothing is recomputed but
the display: which keys of the forwarded body are decoding settings is `proxy/serving/records.py`'s decision, and what
the answer holds is `answer.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proxy.audit import AuditRecord
from proxy.serving.records import DECODING_KEYS
from proxy.ui.answer import AnswerView, answer_body, answer_view, parts

SHOWN_REQUEST_KEYS = ("messages", "prompt", "model", "stream", "stream_options", *DECODING_KEYS)


@dataclass(frozen=True)
class Message:
    role: str
    content: str | None  # text content
    content_parts: list[Any] | None  # content given as a list of parts
    other: dict[str, Any]  # name, tool_calls, tool_call_id, ...


@dataclass(frozen=True)
class Timing:
    label: str
    at: str | None
    after_s: float | None  # since the proxy received the request


@dataclass(frozen=True)
class RecordView:
    record: AuditRecord
    endpoint: str | None
    stream: bool
    request: dict[str, Any]
    messages: list[Message]
    prompt_input: Any  # the completions route's `prompt`
    system_prompt: dict[str, Any] | None  # name, version, sha256 of the prompt version applied
    decoding: dict[str, Any]
    seed: int | None
    seed_drawn: bool  # the backend drew the seed (the request gave none); a replay sends it
    pin: dict[str, Any]
    route: str | None
    other_request: dict[str, Any]  # forwarded fields the sections above do not show
    answer: AnswerView | None
    status: str
    error: str | None
    upstream_fingerprint: str | None
    timings: list[Timing]
    replay: dict[str, Any] | None  # for a replay: of, outcome, comparison


def record_view(record: AuditRecord) -> RecordView:
    held = parts(record)
    first = held.get("answer") or held.get("opened") or {}
    closed = held.get("closed") or {}
    request = first.get("request") if isinstance(first.get("request"), dict) else {}
    body = answer_body(record)
    answer = answer_view(body) if body is not None else None
    requested_seed = request.get("seed") if isinstance(request.get("seed"), int) else None
    return RecordView(
        record=record,
        endpoint=first.get("endpoint"),
        stream=bool(first.get("stream")),
        request=request,
        messages=[_message(m) for m in request.get("messages") or [] if isinstance(m, dict)],
        prompt_input=request.get("prompt"),
        system_prompt=first.get("prompt") if isinstance(first.get("prompt"), dict) else None,
        decoding=first.get("decoding") if isinstance(first.get("decoding"), dict) else {},
        seed=requested_seed if requested_seed is not None else (answer.seed if answer else None),
        seed_drawn=requested_seed is None and answer is not None and answer.seed is not None,
        pin=first.get("pin") if isinstance(first.get("pin"), dict) else {},
        route=first.get("route"),
        other_request={k: v for k, v in request.items() if k not in SHOWN_REQUEST_KEYS},
        answer=answer,
        status=record.status,
        error=closed.get("error"),
        upstream_fingerprint=first.get("upstream_fingerprint") or closed.get("upstream_fingerprint"),
        timings=_timings(first, closed),
        # A replayed stream's outcome is in its closed entry, written once its events were compared.
        replay=next((e["replay"] for e in (first, closed) if isinstance(e.get("replay"), dict)), None),
    )


def _message(message: dict[str, Any]) -> Message:
    content = message.get("content")
    return Message(
        role=str(message.get("role", "?")),
        content=content if isinstance(content, str) else None,
        content_parts=content if isinstance(content, list) else None,
        other={k: v for k, v in message.items() if k not in ("role", "content")},
    )


def _timings(first: dict[str, Any], closed: dict[str, Any]) -> list[Timing]:
    received = _moment(first.get("received_at"))
    marks = [
        ("received", first.get("received_at")),
        ("answered", first.get("answered_at")),
        ("stream opened", first.get("opened_at")),
        ("stream closed", closed.get("closed_at")),
    ]
    timings = []
    for label, value in marks:
        if value is None:
            continue
        moment = _moment(value)
        after = (moment - received).total_seconds() if moment and received else None
        timings.append(Timing(label, value, after if label != "received" else None))
    return timings


def _moment(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None
