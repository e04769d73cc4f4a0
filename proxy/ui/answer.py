"""A record's answer as the page shows it, read generically from what the record holds.

A non-streamed record holds the response body the client got; a stream's record holds what its `closed` entry's
events assemble into. Both are read here as a response body (`answer_body`), and everything shown comes from that body:
every choice in it (content, refusal, tool calls, any other field), usage, and the token ids and logprobs of the
`stackpin` extension with the token strings that `logprobs` gives where the client asked for them. Pure functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proxy.audit import AuditRecord
from proxy.evidence.answers import Tokens, tokens_of

CHOICE_KEYS = ("index", "finish_reason", "message", "delta", "text", "logprobs")
MESSAGE_KEYS = ("role", "content", "refusal", "tool_calls")


@dataclass(frozen=True)
class ToolCall:
    id: str | None
    name: str
    arguments: str  # exactly as the replica sent them: an auditor reads the string, not a reformatting


@dataclass(frozen=True)
class Choice:
    index: int
    finish_reason: str | None
    content: str | None
    refusal: str | None
    tool_calls: list[ToolCall]
    other: dict[str, Any]  # every other field of the choice and its message (function_call, audio, ...)


@dataclass(frozen=True)
class TokenRow:
    position: int
    token_id: int | None
    piece: str | None  # the token's text, where the answer carries it (logprobs requested)
    logprob: float | None
    bits: str | None  # the logprob's float64 in hex: what a replay compares


@dataclass(frozen=True)
class AnswerView:
    choices: list[Choice]
    usage: dict[str, Any] | None
    tokens: list[TokenRow]
    prompt_tokens: int | None
    batch: dict[str, Any] | None
    seed: int | None
    extension: dict[str, Any] = field(default_factory=dict)  # the rest of the `stackpin` extension


def parts(record: AuditRecord) -> dict[str, dict[str, Any]]:
    return {entry.part: entry.content for entry in record.entries}


def answer_body(record: AuditRecord) -> dict[str, Any] | None:
    """The record's answer as a response body; None while a stream has not closed, or once it is erased."""
    if record.erased:
        return None
    held = parts(record)
    if "answer" in held:
        response = held["answer"].get("response")
        return response if isinstance(response, dict) else None
    closed = held.get("closed")
    if closed is None:
        return None
    for key in ("answer", "response"):
        if isinstance(closed.get(key), dict):
            return closed[key]
    # A stream recorded before records kept every event and choice: choice 0's text and tokens.
    tokens = Tokens.from_json(closed.get("tokens") or {"text": ""})
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": tokens.finish_reason,
                "message": {"role": "assistant", "content": tokens.text},
            }
        ],
        "usage": closed.get("usage"),
        "stackpin": {
            "token_ids": tokens.token_ids,
            "token_logprobs": tokens.token_logprobs,
            "prompt_token_ids": tokens.prompt_token_ids,
            "batch": tokens.batch,
            "seed": tokens.seed,
        },
    }


def answer_view(body: dict[str, Any]) -> AnswerView:
    raw_choices = body.get("choices") if isinstance(body.get("choices"), list) else []
    choices = [_choice(i, c) for i, c in enumerate(raw_choices) if isinstance(c, dict)]
    extension = body.get("stackpin") if isinstance(body.get("stackpin"), dict) else {}
    tokens = tokens_of(body) if choices else Tokens(text="")
    pieces = token_pieces(raw_choices[0]) if raw_choices and isinstance(raw_choices[0], dict) else []
    return AnswerView(
        choices=choices,
        usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
        tokens=token_rows(tokens, pieces),
        prompt_tokens=len(tokens.prompt_token_ids) if tokens.prompt_token_ids is not None else None,
        batch=tokens.batch,
        seed=tokens.seed,
        extension={
            k: v
            for k, v in extension.items()
            if k not in ("token_ids", "token_logprobs", "prompt_token_ids", "batch", "seed")
        },
    )


def token_rows(tokens: Tokens, pieces: list[str | None]) -> list[TokenRow]:
    ids = tokens.token_ids or []
    logprobs = tokens.token_logprobs or []
    rows = []
    for k in range(max(len(ids), len(logprobs))):
        logprob = logprobs[k] if k < len(logprobs) else None
        rows.append(
            TokenRow(
                position=k,
                token_id=ids[k] if k < len(ids) else None,
                piece=pieces[k] if k < len(pieces) else None,
                logprob=logprob,
                bits=None if logprob is None else bits(logprob),
            )
        )
    return rows


def bits(logprob: float) -> str:
    """The float64 in hex, as the replay comparison reads it (-0.0 as 0.0, as the log's canonical JSON does)."""
    return (float(logprob) + 0.0).hex()


def token_pieces(choice: dict[str, Any]) -> list[str | None]:
    """Each token's text from the choice's `logprobs`, chat shape or legacy completions shape."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if isinstance(content, list):
        return [item.get("token") if isinstance(item, dict) else None for item in content]
    legacy = logprobs.get("tokens")
    if isinstance(legacy, list):
        return [piece if isinstance(piece, str) else None for piece in legacy]
    return []


def _choice(position: int, choice: dict[str, Any]) -> Choice:
    message = choice.get("message")
    if not isinstance(message, dict):
        message = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    content = message.get("content")
    if content is None and isinstance(choice.get("text"), str):
        content = choice["text"]
    other = {k: v for k, v in choice.items() if k not in CHOICE_KEYS}
    other.update({k: v for k, v in message.items() if k not in MESSAGE_KEYS})
    index = choice.get("index")
    return Choice(
        index=index if isinstance(index, int) else position,
        finish_reason=choice.get("finish_reason"),
        content=content if isinstance(content, str) else (None if content is None else _json(content)),
        refusal=message.get("refusal") if isinstance(message.get("refusal"), str) else None,
        tool_calls=[_tool_call(call) for call in message.get("tool_calls") or [] if isinstance(call, dict)],
        other=other,
    )


def _tool_call(call: dict[str, Any]) -> ToolCall:
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments")
    return ToolCall(
        id=call.get("id") if isinstance(call.get("id"), str) else None,
        name=str(function.get("name") or call.get("type") or "?"),
        arguments=arguments if isinstance(arguments, str) else _json(arguments),
    )


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
