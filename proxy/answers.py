"""Reading answers: the text, token ids, logprobs and batch context of a replica's response, whole or streamed.

pinned_backend replicas carry token ids and raw token logprobs in the `stackpin` extension object
(docs/protocol.md); upstream APIs do not, and their answers can be compared only as text. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tokens:
    """What a replay compares: token ids and logprobs where the replica gives them, else only the text."""

    text: str
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    batch: dict[str, Any] | None = None
    seed: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "token_ids": self.token_ids,
            "token_logprobs": self.token_logprobs,
            "prompt_token_ids": self.prompt_token_ids,
            "batch": self.batch,
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tokens:
        return cls(
            **{key: data.get(key) for key in cls.__dataclass_fields__ if key != "text"}, text=data["text"]
        )


def choice_text(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    if isinstance(message, dict):
        content = message.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def tokens_of(body: dict[str, Any]) -> Tokens:
    choice = body["choices"][0]
    extension = body.get("stackpin") if isinstance(body.get("stackpin"), dict) else {}
    return Tokens(
        text=choice_text(choice),
        finish_reason=choice.get("finish_reason"),
        token_ids=_int_list(extension.get("token_ids")),
        token_logprobs=_float_list(extension.get("token_logprobs")),
        prompt_token_ids=_int_list(extension.get("prompt_token_ids")),
        batch=extension.get("batch") if isinstance(extension.get("batch"), dict) else None,
        seed=extension.get("seed") if isinstance(extension.get("seed"), int) else None,
    )


@dataclass
class StreamAssembly:
    """Folds a stream's chunks into what one non-streamed answer would have said."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    has_tokens: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    batch: dict[str, Any] | None = None
    seed: int | None = None
    upstream_fingerprint: str | None = None
    chunks: int = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        if isinstance(chunk.get("system_fingerprint"), str):
            self.upstream_fingerprint = chunk["system_fingerprint"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str):
                self.text_parts.append(piece)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        extension = chunk.get("stackpin")
        if isinstance(extension, dict):
            ids, logprobs = (
                _int_list(extension.get("token_ids")),
                _float_list(extension.get("token_logprobs")),
            )
            if ids is not None:
                self.has_tokens = True
                self.token_ids.extend(ids)
            if logprobs is not None:
                self.token_logprobs.extend(logprobs)
            self.prompt_token_ids = _int_list(extension.get("prompt_token_ids")) or self.prompt_token_ids
            if isinstance(extension.get("batch"), dict):
                self.batch = extension["batch"]
            if isinstance(extension.get("seed"), int):
                self.seed = extension["seed"]

    def tokens(self) -> Tokens:
        return Tokens(
            text="".join(self.text_parts),
            finish_reason=self.finish_reason,
            token_ids=self.token_ids if self.has_tokens else None,
            token_logprobs=self.token_logprobs if self.has_tokens else None,
            prompt_token_ids=self.prompt_token_ids,
            batch=self.batch,
            seed=self.seed,
        )


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _float_list(value: Any) -> list[float] | None:
    if isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    return None
