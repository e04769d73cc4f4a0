"""A study's prompt set: the requests a study sends, read from a JSONL file of chat or completions requests, or
from a plain text file of prompts, one a line.

A JSONL line is a request body as a client would post it: `{"messages": [...]}` goes to /v1/chat/completions,
`{"prompt": "..."}` to /v1/completions; any other field (`max_tokens`, `seed`, `logprobs`, `tools`, ...) is sent
as written. A line of a text file becomes one user message. What a line leaves out is filled in: the model, the
most tokens to generate, and the temperature (0: a study measures what changes when nothing should). A study
compares whole answers, so a request may not stream. Lines that are blank, or that start with `#` in a text file,
are skipped. Pure functions; reading the file is the caller's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from proxy.canonical import canonical_json
from proxy.endpoints import CHAT, COMPLETIONS, check_request
from proxy.errors import BadRequest
from proxy.serving.recordable import Unrecordable, check_recordable

JSONL_SUFFIXES = (".jsonl", ".ndjson")
LABEL_CHARS = 80


class PromptSetError(ValueError):
    """What is wrong with a prompt set, naming the line."""


@dataclass(frozen=True)
class StudyPrompt:
    index: int  # its place in the set, from 0
    endpoint: str  # CHAT or COMPLETIONS
    body: dict[str, Any]  # the request as it is sent, defaults filled in
    label: str  # a line of its text, for reports


@dataclass(frozen=True)
class Defaults:
    model: str
    max_tokens: int
    temperature: float = 0.0


def read_prompt_set(text: str, *, name: str, defaults: Defaults) -> list[StudyPrompt]:
    """The prompts of a file called `name` holding `text`; a PromptSetError naming the line when one is wrong."""
    jsonl = name.lower().endswith(JSONL_SUFFIXES)
    prompts: list[StudyPrompt] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or (not jsonl and stripped.startswith("#")):
            continue
        if jsonl:
            endpoint, body = _request(stripped, number, name)
        else:
            endpoint, body = CHAT, {"messages": [{"role": "user", "content": stripped}]}
        body = _filled(body, defaults)
        prompts.append(StudyPrompt(len(prompts), endpoint, body, label_of(endpoint, body)))
    if not prompts:
        raise PromptSetError(f"{name} holds no prompt")
    return prompts


def _request(line: str, number: int, name: str) -> tuple[str, dict[str, Any]]:
    where = f"{name} line {number}"
    try:
        body = json.loads(line, parse_constant=_refuse_constant)
    except ValueError as e:
        raise PromptSetError(f"{where} is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise PromptSetError(f"{where} must be a JSON object: a chat or completions request")
    if ("messages" in body) == ("prompt" in body):
        raise PromptSetError(
            f"{where} must hold either 'messages' (a chat request) or 'prompt' (a completions request)"
        )
    if body.get("stream"):
        raise PromptSetError(f"{where} streams; a study compares whole answers, so leave 'stream' out")
    if "stackpin" in body:
        raise PromptSetError(f"{where} carries a pin; give pins with --pin and --compare")
    endpoint = CHAT if "messages" in body else COMPLETIONS
    try:
        check_request(endpoint, body, False)
        check_recordable(body)
    except BadRequest as e:
        raise PromptSetError(f"{where}: {e.message}") from e
    except Unrecordable as e:
        raise PromptSetError(f"{where}: '{e.path}' {e.reason}") from e
    return endpoint, body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or infinities)")


def _filled(body: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    filled = {"model": defaults.model, **body}
    if "max_tokens" not in filled and "max_completion_tokens" not in filled:
        filled["max_tokens"] = defaults.max_tokens
    filled.setdefault("temperature", defaults.temperature)
    return filled


def label_of(endpoint: str, body: dict[str, Any]) -> str:
    """The request's last user text (or its prompt), on one line and cut short."""
    text: Any = body.get("prompt")
    if endpoint == CHAT:
        users = [m for m in body.get("messages", []) if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1].get("content") if users else body["messages"][-1].get("content")
        if isinstance(text, list):  # content parts: their text
            text = " ".join(p.get("text", "") for p in text if isinstance(p, dict))
    if not isinstance(text, str):
        text = json.dumps(text)
    text = " ".join(text.split())
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def digest(prompts: list[StudyPrompt]) -> str:
    """The SHA-256 of the requests a study sends, in order: the same set, the same digest."""
    requests = [{"endpoint": p.endpoint, "body": p.body} for p in prompts]
    return hashlib.sha256(canonical_json(requests)).hexdigest()
