"""Reading answers: a stream folded into the body one whole answer would have been, and any answer reduced to the
parts a replay compares.

A chat or completions stream assembles choice by choice (`index`), each delta merged into its choice as OpenAI's
SDKs merge them: strings concatenated, objects merged key by key, tool-call deltas merged by their own `index`,
logprob lists extended. A Responses stream's answer is the response its last `response.*` event carries.
pinned_backend replicas add token ids and raw logprobs in the `stackpin` extension (docs/protocol.md), for
choice 0; upstream APIs do not. Pure functions; what is compared, and how, is compare.py's.
"""

from __future__ import annotations

import base64
import copy
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES

# Keys whose values differ between two runs of one request by design: handles, clocks, the stack's own name,
# and the random padding OpenAI adds to stream events. They are never compared.
VOLATILE = frozenset({"id", "call_id", "item_id", "created", "created_at", "completed_at", "obfuscation"})
VOLATILE_TOP = frozenset({"system_fingerprint"})
# Keys replaced, never concatenated, when a later delta repeats them (as OpenAI's SDKs treat them).
_REPLACED = frozenset({"index", "type"})


@dataclass
class Tokens:
    """Choice 0's text and what the replica's `stackpin` extension reports of it: token ids and logprobs (None
    where the replica gives none), the prompt's ids, the batch it ran in and the seed it drew."""

    text: str
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    batch: dict[str, Any] | None = None
    seed: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tokens:
        return cls(
            **{key: data.get(key) for key in cls.__dataclass_fields__ if key != "text"}, text=data["text"]
        )


def tokens_of(body: dict[str, Any]) -> Tokens:
    """Choice 0 of a chat or completions answer; KeyError or IndexError when it has none."""
    choice = body["choices"][0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return _tokens(
        _extension(body), text if isinstance(text, str) else "", choice.get("finish_reason"), always=True
    )


@dataclass(frozen=True)
class Part:
    """One comparable unit of an answer: a choice, an embedding, an output item."""

    label: str  # "choice 1", "data[3]", "output[0]"
    index: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class View:
    """An answer as a replay compares it."""

    parts: list[Part]
    fields: dict[str, Any]  # answer-level: usage, status, prompt token ids
    tokens: Tokens | None
    kind: str  # what a part is: "choice", "embedding" or "output item"


def view_of(endpoint: str, body: dict[str, Any], replica_body: dict[str, Any] | None = None) -> View:
    """`body` is the answer the client got; `replica_body` the replica's own, when the proxy translated it."""
    extension = _extension(replica_body if replica_body is not None else body)
    if endpoint == EMBEDDINGS:
        items = _by_index(body.get("data"))
        parts = [Part(f"data[{i}]", i, {"embedding": _vector(item.get("embedding"))}) for i, item in items]
        fields = {"usage": body.get("usage"), "input_token_ids": extension.get("input_token_ids")}
        return View(parts, fields, None, "embedding")
    if endpoint == RESPONSES:
        output = body.get("output") if isinstance(body.get("output"), list) else []
        parts = [Part(f"output[{i}]", i, _steady(item)) for i, item in enumerate(output)]
        keys = ("status", "incomplete_details", "error", "usage")
        fields = {key: _steady(body.get(key)) for key in keys} | {
            "prompt_token_ids": extension.get("prompt_token_ids")
        }
        text = "".join(_output_text(item) for item in output)
        return View(parts, fields, _tokens(extension, text), "output item")
    parts = [Part(f"choice {i}", i, _choice_fields(choice)) for i, choice in _by_index(body.get("choices"))]
    fields = {"usage": body.get("usage"), "prompt_token_ids": extension.get("prompt_token_ids")}
    first = parts[0].fields if parts else {}
    text = first.get("text") or (first.get("message") or {}).get("content") or ""
    return View(parts, fields, _tokens(extension, text if isinstance(text, str) else ""), "choice")


def _choice_fields(choice: dict[str, Any]) -> dict[str, Any]:
    fields = {key: _steady(value) for key, value in choice.items() if key != "index"}
    message = fields.get("message")
    if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
        # A streamed tool call keeps the delta's `index`; a whole answer's lists them in that order.
        message["tool_calls"] = [
            {k: v for k, v in call.items() if k != "index"} if isinstance(call, dict) else call
            for call in message["tool_calls"]
        ]
    return fields


def _steady(value: Any) -> Any:
    """`value` without its volatile keys, at any depth."""
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    return value


def steady_event(text: str) -> tuple[str | None, Any]:
    """One recorded event (`event: NAME\\ndata: JSON\\n\\n`) as a replay compares it: its name, and its data
    without volatile keys, the stack's fingerprint or the batch it ran in."""
    name: str | None = None
    data_lines = []
    for line in text.split("\n"):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data_lines.append(line[5:].lstrip(" "))
    data = json.loads("\n".join(data_lines))
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in VOLATILE_TOP}
        if isinstance(data.get("stackpin"), dict):
            data["stackpin"] = {k: v for k, v in data["stackpin"].items() if k != "batch"}
        if isinstance(data.get("response"), dict):
            data["response"] = {k: v for k, v in data["response"].items() if k not in VOLATILE_TOP}
    return name, _steady(data)


def _by_index(items: Any) -> list[tuple[int, dict[str, Any]]]:
    if not isinstance(items, list):
        return []
    indexed = [
        (item["index"] if isinstance(item.get("index"), int) else k, item)
        for k, item in enumerate(items)
        if isinstance(item, dict)
    ]
    return sorted(indexed, key=lambda pair: pair[0])


def _vector(value: Any) -> Any:
    """An embedding as its components: base64 is float32 little-endian (OpenAI's encoding)."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            return value
        if len(raw) % 4 == 0:
            return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return value


def _output_text(item: Any) -> str:
    if not isinstance(item, dict) or not isinstance(item.get("content"), list):
        return ""
    return "".join(
        p.get("text", "") for p in item["content"] if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


def _extension(body: dict[str, Any]) -> dict[str, Any]:
    extension = body.get("stackpin")
    return extension if isinstance(extension, dict) else {}


def _tokens(
    extension: dict[str, Any], text: str, finish_reason: str | None = None, *, always: bool = False
) -> Tokens | None:
    """The extension's tokens with their text; None without token ids, unless `always`."""
    ids, logprobs = _int_list(extension.get("token_ids")), _float_list(extension.get("token_logprobs"))
    if ids is None and not always:
        return None
    batch, seed = extension.get("batch"), extension.get("seed")
    return Tokens(
        text=text,
        finish_reason=finish_reason,
        token_ids=ids,
        token_logprobs=logprobs if ids is not None else None,
        prompt_token_ids=_int_list(extension.get("prompt_token_ids")),
        batch=batch if isinstance(batch, dict) else None,
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
    )


def seed_of(body: dict[str, Any]) -> int | None:
    seed = _extension(body).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


@dataclass
class ChunkAssembly:
    """Folds chat or completions stream chunks into the body a non-streamed answer would have been."""

    endpoint: str = CHAT
    top: dict[str, Any] = field(default_factory=dict)
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    extension: dict[str, Any] = field(default_factory=dict)
    has_tokens: bool = False
    chunks: int = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if chunk.get(key) is not None:
                self.top[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            self.top["usage"] = chunk["usage"]
        choices = chunk.get("choices")
        for k, choice in enumerate(choices if isinstance(choices, list) else []):
            if isinstance(choice, dict):
                self._add_choice(choice["index"] if isinstance(choice.get("index"), int) else k, choice)
        extension = chunk.get("stackpin")
        if isinstance(extension, dict):
            self._add_extension(extension)

    def _add_choice(self, index: int, choice: dict[str, Any]) -> None:
        built = self.choices.setdefault(index, {"index": index})
        if self.endpoint == CHAT:
            delta = choice.get("delta")
            message = built.setdefault("message", {})
            if isinstance(delta, dict):
                merge(message, delta)
        elif isinstance(choice.get("text"), str):
            built["text"] = built.get("text", "") + choice["text"]
        if isinstance(choice.get("logprobs"), dict):
            # A first chunk that carries only the role says `logprobs: null` (OpenAI's and vLLM's do).
            if not isinstance(built.get("logprobs"), dict):
                built["logprobs"] = {}
            merge(built["logprobs"], choice["logprobs"])
        else:
            built.setdefault("logprobs", None)
        if choice.get("finish_reason") is not None:
            built["finish_reason"] = choice["finish_reason"]
        built.setdefault("finish_reason", None)

    def _add_extension(self, extension: dict[str, Any]) -> None:
        ids, logprobs = _int_list(extension.get("token_ids")), _float_list(extension.get("token_logprobs"))
        if ids is not None:
            self.has_tokens = True
            self.extension.setdefault("token_ids", []).extend(ids)
            self.extension.setdefault("token_logprobs", []).extend(logprobs or [])
        for key, value in extension.items():
            if key not in ("token_ids", "token_logprobs") and value is not None:
                self.extension[key] = value

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            **{k: v for k, v in self.top.items() if k != "usage"},
            "object": "chat.completion" if self.endpoint == CHAT else "text_completion",
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": self.top.get("usage"),
        }
        for choice in body["choices"]:
            if isinstance(choice.get("message"), dict):
                calls = choice["message"].get("tool_calls")
                if isinstance(calls, list):
                    calls.sort(key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        if self.extension:
            body["stackpin"] = self.extension
        return body


@dataclass
class ResponseAssembly:
    """A Responses stream's answer: the response object its latest `response.*` event carries."""

    response: dict[str, Any] | None = None
    chunks: int = 0

    def add(self, event: dict[str, Any]) -> None:
        self.chunks += 1
        if isinstance(event.get("response"), dict):
            self.response = event["response"]

    def body(self) -> dict[str, Any]:
        return self.response if self.response is not None else {"object": "response", "output": []}


def assembly_for(endpoint: str) -> ChunkAssembly | ResponseAssembly:
    return (
        ResponseAssembly()
        if endpoint == RESPONSES
        else ChunkAssembly(CHAT if endpoint == CHAT else COMPLETIONS)
    )


def merge(acc: dict[str, Any], delta: dict[str, Any]) -> None:
    """Merges a stream delta into what has been assembled, in place, as OpenAI's SDKs accumulate deltas."""
    for key, value in delta.items():
        current = acc.get(key)
        if current is None and _indexed(value):
            # Even the first list of tool-call fragments is merged: one chunk may hold two of one call.
            acc[key] = current = []
        if current is None or key in _REPLACED:
            if value is not None or key not in acc:
                acc[key] = copy.deepcopy(value)
        elif isinstance(current, str) and isinstance(value, str):
            acc[key] = current + value
        elif isinstance(current, dict) and isinstance(value, dict):
            merge(current, value)
        elif isinstance(current, list) and isinstance(value, list):
            _merge_list(current, value)
        elif value is not None:
            acc[key] = copy.deepcopy(value)


def _indexed(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, dict) and isinstance(item.get("index"), int) for item in value)
    )


def _merge_list(current: list[Any], delta: list[Any]) -> None:
    if not _indexed(delta) or not all(isinstance(c, dict) and "index" in c for c in current):
        current.extend(copy.deepcopy(delta))
        return
    for item in delta:  # tool calls: each fragment names the call it continues by its index
        same = next((c for c in current if c["index"] == item["index"]), None)
        if same is None:
            current.append(copy.deepcopy(item))
        else:
            merge(same, item)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _float_list(value: Any) -> list[float] | None:
    if isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    return None
