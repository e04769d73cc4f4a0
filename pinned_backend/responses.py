"""The JSON bodies the backend answers with: OpenAI chat and text completions, whole or as stream chunks.

Each body carries the OpenAI fields with their OpenAI meaning (`logprobs` in the chat shape or the legacy
completions shape), `system_fingerprint`, and the `stackpin` extension object of docs/protocol.md.
Everything here is a pure function of a finished or partial completion; how text becomes tokens is given as
a function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pinned_backend.engine import BatchStats, TokenOutput
from pinned_backend.tool_calls import CallReader

TokenText = Callable[[int], tuple[str, bytes]]  # a token id -> its text alone, and its exact bytes


@dataclass(frozen=True)
class Meta:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str
    fingerprint: str
    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass
class Completion:
    """A completion as its tokens arrive from the engine; `calls` reads a chat answer's tool calls, if it may
    hold any."""

    prompt_ids: list[int]
    seed: int | None
    outputs: list[TokenOutput] = field(default_factory=list)
    calls: CallReader | None = None

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None

    @property
    def batch(self) -> BatchStats:
        return self.outputs[-1].batch if self.outputs else BatchStats()


def stackpin_object(completion: Completion) -> dict[str, Any]:
    batch = completion.batch
    return {
        "prompt_token_ids": completion.prompt_ids,
        "token_ids": [o.token_id for o in completion.outputs],
        "token_logprobs": [o.logprob for o in completion.outputs],
        "batch": {
            "max": batch.max,
            "min": batch.min,
            "steps": batch.steps,
            "cached_tokens": batch.cached_tokens,
            "accepted_draft_tokens": batch.accepted_draft_tokens,
        },
        "seed": completion.seed,
    }


def usage(completion: Completion) -> dict[str, int]:
    prompt, generated = len(completion.prompt_ids), len(completion.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def chat_logprobs(outputs: list[TokenOutput], token_text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [
        {**entry(o.token_id, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top_logprobs]}
        for o in outputs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(outputs: list[TokenOutput], token_text: TokenText, offset: int) -> dict[str, Any]:
    """The legacy shape; `offset` is where this piece's text starts in the completion."""
    tokens = [token_text(o.token_id)[0] for o in outputs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    # OpenAI's top_logprobs holds the requested top entries plus the sampled token.
    top = [
        {**{token_text(t)[0]: lp for t, lp in o.top_logprobs}, tok: o.logprob}
        for o, tok in zip(outputs, tokens, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [o.logprob for o in outputs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def full_body(meta: Meta, completion: Completion, logprobs: bool, token_text: TokenText) -> dict[str, Any]:
    """The whole answer of a request that did not ask to stream."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": completion.finish_reason}
    if meta.chat:
        choice["message"], choice["finish_reason"] = _message(completion)
        choice["logprobs"] = chat_logprobs(completion.outputs, token_text) if logprobs else None
    else:
        choice["text"] = completion.text
        choice["logprobs"] = completion_logprobs(completion.outputs, token_text, 0) if logprobs else None
    return {
        "id": meta.id,
        "object": meta.object,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": [choice],
        "usage": usage(completion),
        "stackpin": stackpin_object(completion),
    }


def _message(completion: Completion) -> tuple[dict[str, Any], str | None]:
    """A whole chat answer's message and finish reason."""
    if completion.calls is None:
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    completion.calls.feed(completion.text, end=True)
    return completion.calls.message(), completion.calls.finish_reason(completion.finish_reason)


def _delta(completion: Completion, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """What a chat chunk's `text` adds to the message, and the finish reason if it is the last."""
    if completion.calls is None:
        return ({"content": text} if text or finish is None else {}), finish
    return completion.calls.feed(text, end=finish is not None), completion.calls.finish_reason(finish)


def _chunk(meta: Meta, choices: list[dict[str, Any]], extension: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": meta.chunk_object,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": choices,
        "stackpin": extension,
    }


def first_chunk(meta: Meta, calls: bool = False) -> dict[str, Any]:
    """A chat stream opens by naming the role, as OpenAI's does; an answer that may be only calls has no content
    until it writes some."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": None if calls else ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(meta, [choice], {"token_ids": [], "token_logprobs": []})


def token_chunk(
    meta: Meta, completion: Completion, start: int, logprobs: bool, token_text: TokenText
) -> dict[str, Any]:
    """The chunk for the tokens `completion.outputs[start:]`; the last one also finishes the stream."""
    new = completion.outputs[start:]
    text = "".join(o.text for o in new)
    finish = completion.finish_reason
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if meta.chat:
        choice["delta"], choice["finish_reason"] = _delta(completion, text, finish)
        choice["logprobs"] = chat_logprobs(new, token_text) if logprobs else None
    else:
        choice["text"] = text
        sent = sum(len(o.text) for o in completion.outputs[:start])
        choice["logprobs"] = completion_logprobs(new, token_text, sent) if logprobs else None
    extension: dict[str, Any] = {
        "token_ids": [o.token_id for o in new],
        "token_logprobs": [o.logprob for o in new],
    }
    if finish is not None:
        whole = stackpin_object(completion)
        extension.update(prompt_token_ids=whole["prompt_token_ids"], batch=whole["batch"], seed=whole["seed"])
    return _chunk(meta, [choice], extension)


def usage_chunk(meta: Meta, completion: Completion) -> dict[str, Any]:
    """Sent last when the client asked for `stream_options.include_usage`."""
    body = _chunk(meta, [], {"token_ids": [], "token_logprobs": []})
    body["usage"] = usage(completion)
    return body
