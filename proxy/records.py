"""Building records: the pure step from a served request to the audit entries that the store commits.

A non-streamed answer is one `answer` entry. A stream is an `opened` entry committed before its first byte and a
`closed` entry at its end (complete or interrupted). A replay is an `answer` entry linked to its original. A
`flag` entry marks an earlier record, e.g. because the stack that served it was later found changed. Entries
carry the exact forwarded request; never a client or upstream key (those travel only in headers).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proxy.answers import Tokens
from proxy.audit import NewEntry
from proxy.pins import Pin
from proxy.prompts import PromptVersion
from proxy.registry import Replica

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


@dataclass(frozen=True)
class Served:
    """One request as the proxy served it: who asked, under which pin, to which replica, with what body."""

    record_id: str
    tenant: str
    endpoint: str
    pin: Pin
    route: str | None
    prompt: PromptVersion | None
    replica: Replica
    forwarded: dict[str, Any]
    received_at: datetime

    @property
    def fingerprint(self) -> str:
        assert self.replica.fingerprint is not None
        return self.replica.fingerprint


def decoding_settings(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in DECODING_KEYS if key in body}


def _base(
    served: Served, part: str, status: str, now: datetime, content: dict[str, Any], replay_of: str | None
) -> NewEntry:
    replica = served.replica
    assert replica.stack is not None
    return NewEntry(
        record_id=served.record_id,
        part=part,  # type: ignore[arg-type]
        tenant=served.tenant,
        created_at=now,
        replica=replica.name,
        model=replica.stack.model,
        fingerprint=served.fingerprint,
        stack=replica.stack.document(),
        stack_declared=replica.declared,
        prompt_text=served.prompt.text if served.prompt else None,
        replay_of=replay_of,
        status=status,
        content=content,
    )


def _request_content(served: Served) -> dict[str, Any]:
    return {
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
        "stack_declared": served.replica.declared,
        "received_at": served.received_at.isoformat(),
    }


def answer_entry(
    served: Served,
    response: dict[str, Any],
    now: datetime,
    *,
    upstream_fingerprint: str | None,
    replay: dict[str, Any] | None = None,
) -> NewEntry:
    # The tokens are in the response (its `stackpin` extension); they are not stored twice.
    content = {
        **_request_content(served),
        "stream": False,
        "response": response,
        "upstream_fingerprint": upstream_fingerprint,
        "answered_at": now.isoformat(),
    }
    if replay is not None:
        content["replay"] = replay
    return _base(served, "answer", "complete", now, content, replay["of"] if replay else None)


def opened_entry(served: Served, now: datetime) -> NewEntry:
    content = {**_request_content(served), "stream": True, "opened_at": now.isoformat()}
    return _base(served, "opened", "streaming", now, content, None)


def closed_entry(
    served: Served,
    tokens: Tokens,
    now: datetime,
    *,
    status: str,
    usage: dict[str, Any] | None,
    upstream_fingerprint: str | None,
    chunks: int,
    error: str | None,
) -> NewEntry:
    content = {
        "tokens": tokens.as_json(),
        "usage": usage,
        "chunks": chunks,
        "upstream_fingerprint": upstream_fingerprint,
        "error": error,
        "closed_at": now.isoformat(),
    }
    return _base(served, "closed", status, now, content, None)


def flag_entry(
    record_id: str, tenant: str, now: datetime, *, reason: str, replica: str, detail: dict[str, Any]
) -> NewEntry:
    return NewEntry(
        record_id=record_id,
        part="flag",
        tenant=tenant,
        created_at=now,
        replica=replica,
        model=None,
        fingerprint=None,
        stack=None,
        status=reason,
        content={"reason": reason, **detail},
    )
