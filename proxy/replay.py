"""Replay: resend a record's exact request to a replica of the identical stack (or a named one) and compare.

The replayed request is the forwarded body the record holds, made non-streaming, with the seed the backend
reported when the original drew its own. The replay is itself recorded, linked to its original, and its outcome is
`reproduced` (tokens and logprob bits identical) or `diverged` (with the first divergent position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from proxy.answers import Tokens, tokens_of
from proxy.audit import AuditRecord
from proxy.compare import Comparison, compare
from proxy.dispatch import dispatch
from proxy.errors import BadRequest
from proxy.pins import Pin
from proxy.prompts import PromptVersion
from proxy.records import Served, answer_entry
from proxy.serving import Proxy, new_record_id


@dataclass(frozen=True)
class Original:
    """What a replay needs from a committed record."""

    record_id: str
    endpoint: str
    request: dict[str, Any]
    tokens: Tokens
    fingerprint: str
    prompt: PromptVersion | None


def original_of(record: AuditRecord) -> Original:
    parts = {entry.part: entry for entry in record.entries}
    first = parts.get("answer") or parts.get("opened")
    if first is None or record.fingerprint is None:
        raise BadRequest(f"record {record.id} holds no answer to replay")
    if "answer" in parts:
        tokens = tokens_of(first.content["response"])
    else:
        closed = parts.get("closed")
        if closed is None or closed.status != "complete":
            status = closed.status if closed else "still streaming or lost"
            raise BadRequest(f"record {record.id}'s stream did not complete ({status}); nothing to compare")
        tokens = Tokens.from_json(closed.content["tokens"])
    prompt_meta = first.content.get("prompt")
    prompt = (
        PromptVersion(prompt_meta["name"], prompt_meta["version"], record.prompt_text)
        if prompt_meta and record.prompt_text is not None
        else None
    )
    return Original(
        record_id=record.id,
        endpoint=first.content["endpoint"],
        request=first.content["request"],
        tokens=tokens,
        fingerprint=record.fingerprint,
        prompt=prompt,
    )


def replay_body(original: Original) -> dict[str, Any]:
    body = {key: value for key, value in original.request.items() if key not in ("stream", "stream_options")}
    if "seed" not in body and original.tokens.seed is not None:
        body["seed"] = original.tokens.seed
    return body


async def replay(
    proxy: Proxy, record: AuditRecord, tenant: str, on: Pin | None
) -> tuple[str, Comparison, str]:
    """Replay and record; returns the replay's record id, the comparison, and the stack it ran on."""
    original = original_of(record)
    pin = on if on is not None else Pin(stack=original.fingerprint)
    received_at = proxy.clock()

    dispatched = await dispatch(
        proxy.registry,
        pin,
        replay_body(original),
        lambda replica, body: proxy.send_json(replica, body, original.endpoint),
        deadline_s=proxy.settings.server.retry_deadline_s,
        on_mismatch=proxy.health.on_mismatch,
    )
    answer = dispatched.result
    replayed = tokens_of(answer.body)
    comparison = compare(original.tokens, replayed)
    record_id = new_record_id()
    structlog.contextvars.bind_contextvars(record_id=record_id, replay_of=original.record_id)
    served = Served(
        record_id=record_id,
        tenant=tenant,
        endpoint=original.endpoint,
        pin=pin,
        route=None,
        prompt=original.prompt,
        replica=dispatched.replica,
        forwarded=dispatched.body,
        received_at=received_at,
    )
    replay_info = {
        "of": original.record_id,
        "outcome": comparison.outcome,
        "comparison": comparison.as_json(),
    }
    upstream = answer.body.get("system_fingerprint")
    await proxy.store.append(
        answer_entry(
            served,
            answer.body,
            proxy.clock(),
            upstream_fingerprint=upstream if isinstance(upstream, str) else None,
            replay=replay_info,
        )
    )
    proxy.metrics.replays.labels(comparison.outcome).inc()
    return served.record_id, comparison, served.fingerprint
