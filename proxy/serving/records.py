"""Building records: the pure step from a served request to the audit entries that the store commits.

A non-streamed answer is one `answer` entry holding the whole body the client got (every choice, usage,
`system_fingerprint`; the replica's own body beside it where the proxy translated it). A stream is an `opened`
entry committed before its first byte and a `closed` entry at its end (complete or interrupted) holding every event
the client read, byte for byte, the one sent after the record (`data: [DONE]`, or the response's terminal event),
and the answer those events assemble into. A replay is recorded as its original was, linked to it, with its outcome.
A stream whose end the store was away for is closed as interrupted once it is back (proxy/serving/unclosed.py);
one left open by a proxy that stopped without closing it is closed as interrupted at the next start
(`marked_at_start`). A request's tag, when it carries one, is kept beside its request. A `flag` entry marks an
earlier record, e.g. because the stack that served it was later found
changed. Entries carry the exact forwarded request; never a client or upstream key (those travel only in headers).

What a client said and was answered (`PAYLOAD_KEYS`: the requests, the answers, the events, a replay's comparison
that quotes them) is an entry's payload, kept beside the log under a salted hash so that it can be erased
(proxy/audit/erasure.py) while the rest of its content (route, pin, prompt version, decoding settings, timings,
usage, status) stays in the log's hashed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from proxy.audit import OpenStream, SealedEntry, seal
from proxy.pins import Pin
from proxy.replicas.registry import ReplicaSnapshot
from proxy.serving.prompts import PromptVersion

DECODING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "logprobs",
    "top_logprobs",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
)
PAYLOAD_KEYS = frozenset(
    {
        "request",
        "translated_from",
        "response",
        "replica_response",
        "upstream",
        "events",
        "terminal",
        "answer",
        "replica_answer",
        "replay",
    }
)


# How a stream's record ends: its `closed` entry's status.
ClosedStatus = Literal["complete", "interrupted"]


@dataclass(frozen=True)
class Served:
    """One request as the proxy served it: who asked, under which pin, to which replica, with what body."""

    record_id: str
    tenant: str
    endpoint: str
    pin: Pin
    route: str | None
    prompt: PromptVersion | None
    replica: ReplicaSnapshot  # as it was at dispatch: a later quarantine or lift does not change the record
    forwarded: dict[str, Any]  # exactly what the replica was sent
    received_at: datetime
    replica_endpoint: str | None = None  # where the replica was sent it, when not at `endpoint` (translated)
    translated_from: dict[str, Any] | None = None  # the client's request the forwarded one translates
    continues: str | None = None  # the record whose response this request continues (previous_response_id)
    replay_of: str | None = None
    tag: str | None = None  # the client's label for the request (proxy/serving/request.py)
    belongs_to: dict[str, Any] | None = (
        None  # the stored state it was served for: a batch's line, a background run
    )

    @property
    def fingerprint(self) -> str:
        return self.replica.fingerprint


def decoding_settings(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in DECODING_KEYS if key in body}


def _base(served: Served, part: str, status: str, now: datetime, content: dict[str, Any]) -> SealedEntry:
    replica = served.replica
    prompt = served.prompt
    payload = {key: content[key] for key in PAYLOAD_KEYS & content.keys()}
    return seal(
        record_id=served.record_id,
        part=part,  # type: ignore[arg-type]
        tenant=served.tenant,
        created_at=now,
        replica=replica.name,
        model=replica.stack.model,
        fingerprint=served.fingerprint,
        stack=replica.stack.canonical,
        stack_declared=replica.stack_source == "declared",
        prompt_text=prompt.text if prompt else None,
        prompt_sha256=prompt.sha256 if prompt else None,
        replay_of=served.replay_of,
        status=status,
        content={key: value for key, value in content.items() if key not in payload},
        payload=payload,
    )


def _request_content(served: Served) -> dict[str, Any]:
    content: dict[str, Any] = {
        "endpoint": served.endpoint,
        "request": served.forwarded,
        "pin": served.pin.model_dump(exclude_none=True),
        "route": served.route,
        "prompt": (
            {"name": served.prompt.name, "version": served.prompt.version, "sha256": served.prompt.sha256}
            if served.prompt
            else None
        ),
        "decoding": decoding_settings(served.forwarded),
        "stack_declared": served.replica.stack_source == "declared",
        "stack_source": served.replica.stack_source.value,  # proven, reported or declared
        "received_at": served.received_at.isoformat(),
    }
    if served.replica_endpoint is not None:
        content["replica_endpoint"] = served.replica_endpoint
    if served.translated_from is not None:
        content["translated_from"] = served.translated_from
    if served.continues is not None:
        content["continues"] = served.continues
    if served.tag is not None:
        content["tag"] = served.tag
    if served.belongs_to is not None:
        content["belongs_to"] = served.belongs_to
    return content


def answer_entry(
    served: Served,
    response: dict[str, Any],
    now: datetime,
    *,
    replica_response: dict[str, Any] | None = None,
    upstream: dict[str, Any] | None = None,
    replay: dict[str, Any] | None = None,
) -> SealedEntry:
    """`response` is the body the client got; `replica_response` the replica's own when it was translated;
    `upstream` what the proxy replaced in the replica's body (its own `system_fingerprint`, a response id)."""
    # The tokens are in the response (its `stackpin` extension); they are not stored twice.
    content = {
        **_request_content(served),
        "stream": False,
        "response": response,
        "upstream_fingerprint": (upstream or {}).get("system_fingerprint"),
        "answered_at": now.isoformat(),
    }
    if replica_response is not None:
        content["replica_response"] = replica_response
    if upstream and set(upstream) - {"system_fingerprint"}:
        content["upstream"] = upstream
    if replay is not None:
        content["replay"] = replay
    return _base(served, "answer", "complete", now, content)


def opened_entry(served: Served, now: datetime) -> SealedEntry:
    content = {**_request_content(served), "stream": True, "opened_at": now.isoformat()}
    return _base(served, "opened", "streaming", now, content)


def closed_entry(
    served: Served,
    now: datetime,
    *,
    status: ClosedStatus,
    events: list[str],
    terminal: str | None,
    answer: dict[str, Any] | None,
    replica_answer: dict[str, Any] | None,
    upstream_fingerprint: str | None,
    error: str | None,
    replay: dict[str, Any] | None = None,
) -> SealedEntry:
    """`events` are the exact bytes of every event the client was sent before this entry, in order; `terminal`
    the one sent after it commits; `answer` what they assemble into (None when it cannot be recorded)."""
    content: dict[str, Any] = {
        "events": events,
        "terminal": terminal,
        "answer": answer,
        "usage": answer.get("usage") if answer else None,
        "chunks": len(events),
        "upstream_fingerprint": upstream_fingerprint,
        "error": error,
        "closed_at": now.isoformat(),
    }
    if replica_answer is not None:
        content["replica_answer"] = replica_answer
    if replay is not None:
        content["replay"] = replay
    return _base(served, "closed", status, now, content)


def interrupted_at_start_entry(stream: OpenStream, now: datetime) -> SealedEntry:
    """The end of a stream that a proxy opened and never closed (it stopped: a crash, kill -9, a lost machine)."""
    # What the client was sent before the proxy stopped is not known: no events, no answer.
    content = {
        "events": None,
        "terminal": None,
        "answer": None,
        "usage": None,
        "chunks": None,
        "upstream_fingerprint": None,
        "error": "the proxy stopped before the stream ended; marked interrupted at a proxy's start",
        "marked_at_start": True,
        "closed_at": now.isoformat(),
    }
    return seal(
        record_id=stream.record_id,
        part="closed",
        tenant=stream.tenant,
        created_at=now,
        replica=stream.replica,
        model=stream.model,
        fingerprint=stream.fingerprint,
        status="interrupted",
        content=content,
    )


def flag_entry(
    record_id: str, tenant: str, now: datetime, *, reason: str, replica: str, detail: dict[str, Any]
) -> SealedEntry:
    return seal(
        record_id=record_id,
        part="flag",
        tenant=tenant,
        created_at=now,
        replica=replica,
        model=None,
        fingerprint=None,
        status=reason,
        content={"reason": reason, **detail},
    )
