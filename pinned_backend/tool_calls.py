"""Reading tool calls out of an answer's text as it arrives, into OpenAI's message and stream deltas.

The text is in the generic format's spelling (tool_format.py), which the grammar imposed: free text (the message's
content) up to the first `<tool_call>`, then calls. `CallReader.feed` takes each new piece of text and returns the
delta it adds, in OpenAI's stream shape: `content` for text, and for a call first its `index`, `id`, `type` and
`function.name` (with `arguments` empty), then the arguments in fragments as they are written. Text that may still
turn out to be part of the framing is held back until it cannot: a trailing prefix of `<tool_call>` or of the
`}\\n</tool_call>` that ends the arguments, and whitespace before a call (the content ends where the call begins);
an answer cut inside that framing keeps the arguments without it.
So the stream's pieces join into exactly what `message()` holds, whatever the pieces' sizes. With the legacy
`functions`, the one call goes back as `function_call` (name, then arguments) instead.

A call's id is `call_` and 24 hex digits of SHA-256 over the prompt's token ids, the request's seed and the call's
index: inputs every record keeps, so a replay reproduces it bit for bit (docs/tools.md).

This module knows nothing of tokens, grammars or HTTP.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pinned_backend.tool_format import AFTER_NAME, HEAD_START, OPEN, SEPARATOR, TAIL


def call_id(prompt_ids: Sequence[int], seed: int | None, index: int) -> str:
    material = json.dumps([list(prompt_ids), seed, index], separators=(",", ":"))
    return "call_" + hashlib.sha256(f"stackpin-tool-call:{material}".encode()).hexdigest()[:24]


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""
    closed: bool = False  # its TAIL was read


def _held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class CallReader:
    def __init__(self, prompt_ids: Sequence[int], seed: int | None, legacy: bool) -> None:
        self._prompt_ids, self._seed, self._legacy = list(prompt_ids), seed, legacy
        self.content = ""
        self.calls: list[Call] = []
        self._state = "text"  # "text", "head" (after OPEN), "arguments", "between" (after a call's TAIL)
        self._pending = ""  # read but not yet released

    def feed(self, text: str, end: bool = False) -> dict[str, Any]:
        """The delta that `text`, the answer's next piece, adds (empty while it is held back); with `end`, the
        answer is over and what was held back is released too (a cut call keeps the arguments it has)."""
        self._pending += text
        delta: dict[str, Any] = {}
        while self._step(delta):
            pass
        if end:
            if self._state == "text" or (self._state == "between" and self._pending.strip()):
                self._content(delta, self._pending)
            elif self._state == "arguments":
                self._arguments(delta, self._cut_arguments(self._pending))
            self._pending, self._state = "", "done"
        return delta

    def _cut_arguments(self, held: str) -> str:
        """What of the text held back at a cut call's end is its arguments' rather than the framing after them:
        past a newline it is framing (the arguments hold none), and a lone `}` is theirs only if they need it."""
        if held != "}":
            return ""
        try:
            json.loads(self.calls[-1].arguments)
        except ValueError:
            return held
        return ""

    def message(self) -> dict[str, Any]:
        """The whole message: content (null when the answer is only calls) and the calls."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.calls else None,
        }
        if self._legacy and self.calls:
            message["function_call"] = {"name": self.calls[0].name, "arguments": self.calls[0].arguments}
        elif self.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` (legacy: `function_call`) for an answer that stopped after its calls; else the engine's."""
        if engine_reason == "stop" and self.calls:
            return "function_call" if self._legacy else "tool_calls"
        return engine_reason

    def _step(self, delta: dict[str, Any]) -> bool:
        """Read as far as the pending text allows; True if the state moved on and there may be more to read."""
        pending = self._pending
        if self._state == "text":
            at = pending.find(OPEN)
            if at >= 0:
                self._content(delta, pending[:at].rstrip())
                self._pending, self._state = pending[at + len(OPEN) :], "head"
                return True
            opening = _held(pending, OPEN)
            before = pending[: len(pending) - opening]
            keep = opening + len(before) - len(before.rstrip())
            self._content(delta, pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep :]
            return False
        if self._state == "head":
            start = len(HEAD_START)
            end = pending.find(AFTER_NAME, start)
            if not pending.startswith(HEAD_START) or end < 0:
                return False
            self._open(delta, pending[start:end])
            self._pending, self._state = pending[end + len(AFTER_NAME) :], "arguments"
            return True
        if self._state == "arguments":
            at = pending.find(TAIL)
            if at >= 0:
                self._arguments(delta, pending[:at])
                self.calls[-1].closed = True
                self._pending, self._state = pending[at + len(TAIL) :], "between"
                return True
            keep = _held(pending, TAIL)
            self._arguments(delta, pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep :]
            return False
        if self._state == "between" and pending.startswith(SEPARATOR + OPEN):
            self._pending, self._state = pending[len(SEPARATOR + OPEN) :], "head"
            return True
        return False

    def _content(self, delta: dict[str, Any], text: str) -> None:
        if text:
            self.content += text
            delta["content"] = delta.get("content", "") + text

    def _open(self, delta: dict[str, Any], name: str) -> None:
        index = len(self.calls)
        call = Call(call_id(self._prompt_ids, self._seed, index), name)
        self.calls.append(call)
        if self._legacy:
            delta["function_call"] = {"name": name, "arguments": ""}
        else:
            delta.setdefault("tool_calls", []).append(
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )

    def _arguments(self, delta: dict[str, Any], text: str) -> None:
        if not text:
            return
        call, index = self.calls[-1], len(self.calls) - 1
        call.arguments += text
        if self._legacy:
            entry = delta.setdefault("function_call", {"arguments": ""})
            entry["arguments"] += text
            return
        calls = delta.setdefault("tool_calls", [])
        if not calls or calls[-1]["index"] != index:
            calls.append({"index": index, "function": {"arguments": ""}})
        calls[-1]["function"]["arguments"] += text
