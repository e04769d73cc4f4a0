"""Replay, the pure parts: what a committed record asked and answered, the request that replays it, and the
judgement of a replayed answer against it.

A replay resends the exact request the replica was sent (for a translated Responses request, the exact chat
request), streamed if the original was, with the seed the backend reported when the original drew its own, to a
replica of the identical stack (or the one a pin names). It goes through the serving path like any request
(proxy/serving/serve.py) and is recorded, linked to its original, with its outcome: `reproduced` when every part of the
answer came back identical, else `diverged` with the first place it differs (proxy/evidence/compare.py), and either way how far the two agree
(proxy/evidence/agreement.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from proxy.audit import AuditRecord
from proxy.endpoints import CHAT
from proxy.errors import BadRequest, PayloadErased
from proxy.evidence.agreement import agreement
from proxy.evidence.answers import View, seed_of, view_of
from proxy.evidence.compare import Comparison, compare
from proxy.pins import Pin
from proxy.serving.prompts import PromptVersion
from proxy.serving.request import ClientRequest


@dataclass(frozen=True)
class Answered:
    """What a client got: the body (a stream's: what its events assemble into), the replica's own body when the
    proxy translated it, and a stream's exact events."""

    body: dict[str, Any]
    replica_body: dict[str, Any] | None = None
    events: list[str] | None = None


@dataclass(frozen=True)
class Recorded:
    """What a committed record says was asked and answered."""

    record_id: str
    endpoint: str
    request: dict[str, Any]  # exactly what the replica was sent
    translated_from: dict[str, Any] | None  # the client's request, when `request` is its translation
    stream: bool
    answered: Answered
    fingerprint: str
    prompt: PromptVersion | None
    continues: str | None
    legacy: bool = False  # a stream recorded before records kept every event and choice

    @property
    def client_request(self) -> dict[str, Any]:
        """The request in the client's own terms (for the Responses API: its fully expanded input)."""
        return self.translated_from if self.translated_from is not None else self.request

    def view(self) -> View:
        return view_of(self.endpoint, self.answered.body, self.answered.replica_body)


def recorded(record: AuditRecord) -> Recorded:
    """A BadRequest when the record holds no complete answer; PayloadErased when it held one that was erased."""
    parts = {entry.part: entry for entry in record.entries}
    first = parts.get("answer") or parts.get("opened")
    if first is None or record.fingerprint is None:
        raise BadRequest(f"record {record.id} holds no answer to replay")
    if record.erased:
        raise PayloadErased(f"record {record.id}'s {record.erasure()}: nothing is left to replay")
    legacy = False
    if "answer" in parts:
        content = first.content
        answered = Answered(content["response"], content.get("replica_response"))
    else:
        closed = parts.get("closed")
        if closed is None or closed.status != "complete":
            status = closed.status if closed else "still streaming or lost"
            raise BadRequest(f"record {record.id}'s stream did not complete ({status}); nothing to compare")
        content = closed.content
        if "events" in content:
            answered = Answered(content["answer"], content.get("replica_answer"), content["events"])
        else:
            answered, legacy = _legacy_stream(first.content["endpoint"], content["tokens"]), True
    opened = first.content
    prompt_meta = opened.get("prompt")
    prompt = (
        PromptVersion(prompt_meta["name"], prompt_meta["version"], record.prompt_text)
        if prompt_meta and record.prompt_text is not None
        else None
    )
    return Recorded(
        record_id=record.id,
        endpoint=opened["endpoint"],
        request=opened["request"],
        translated_from=opened.get("translated_from"),
        stream=opened.get("stream", False),
        answered=answered,
        fingerprint=record.fingerprint,
        prompt=prompt,
        continues=opened.get("continues"),
        legacy=legacy,
    )


def replay_request(original: Recorded, pin: Pin) -> ClientRequest:
    """The request that replays `original` on the stack `pin` names."""
    seed = seed_of(original.answered.replica_body or original.answered.body)
    request, client = original.request, original.client_request
    if "seed" not in request and seed is not None:
        request = {**request, "seed": seed}
        client = {**client, "seed": seed}
    return ClientRequest(
        endpoint=original.endpoint,
        body=client,
        stream=original.stream,
        pin=pin,
        route=None,
        prompt=original.prompt,
        previous_response_id=original.answered.body.get("previous_response_id"),
        continues=original.continues,
        translated=request if original.translated_from is not None else None,
    )


def judge(original: Recorded, replayed: Answered) -> Comparison:
    """Where the replayed answer first differs, and how far it agrees all the same."""
    theirs = view_of(original.endpoint, replayed.body, replayed.replica_body)
    ours = original.view()
    if original.legacy:
        ours, theirs = _legacy_view(ours), _legacy_view(theirs)
    comparison = compare(ours, theirs, original.answered.events, replayed.events)
    return replace(comparison, agreement=agreement(ours, theirs, comparison))


def _legacy_stream(endpoint: str, tokens: dict[str, Any]) -> Answered:
    """A stream recorded as the text and tokens of choice 0: the answer it stands for."""
    text = tokens.get("text", "")
    choice: dict[str, Any] = {"index": 0, "finish_reason": tokens.get("finish_reason")}
    if endpoint == CHAT:
        choice["message"] = {"content": text}
    else:
        choice["text"] = text
    extension = {k: tokens.get(k) for k in ("token_ids", "token_logprobs", "prompt_token_ids", "seed")}
    return Answered({"choices": [choice], "stackpin": extension})


def _legacy_view(view: View) -> View:
    """Only what a legacy stream record kept: each choice's text and finish reason, and the tokens."""
    parts = []
    for part in view.parts:
        message = part.fields.get("message")
        kept = {"finish_reason": part.fields.get("finish_reason")}
        if isinstance(message, dict):
            kept["message"] = {"content": message.get("content")}
        else:
            kept["text"] = part.fields.get("text")
        parts.append(type(part)(part.label, part.index, kept))
    return View(parts, {"prompt_token_ids": view.fields.get("prompt_token_ids")}, view.tokens, view.kind)


@dataclass
class Replaying:
    """A replay under way: its original, and the judgement of its answer, made before its record is written."""

    original: Recorded
    comparison: Comparison | None = None

    def judge(self, answered: Answered) -> dict[str, Any]:
        self.comparison = judge(self.original, answered)
        return {
            "of": self.original.record_id,
            "outcome": self.comparison.outcome,
            "comparison": self.comparison.as_json(),
        }
