"""Relaying a stream: each event the replica sends, as the client reads it, byte for byte, and what the record
keeps of them.

Chat and completions chunks pass through with the stack's fingerprint stamped in; Responses events from an
upstream that serves them pass through with the response's id made the record's; a chat stream for a Responses
request is translated (responses_api.ResponsesStream). The event that tells the client the answer is over
(`data: [DONE]`, or a response's terminal event) is held back, to be sent only once the record is closed
(invariant 1). Pure: the serving path writes what this returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proxy.endpoints import RESPONSES, TERMINAL_EVENTS
from proxy.errors import ReplicaFailed, StackpinError
from proxy.evidence.answers import ChunkAssembly, ResponseAssembly, assembly_for
from proxy.replicas.forward import Event
from proxy.serving.responses_api import Echo, ResponsesStream

DONE = "data: [DONE]\n\n"


def sse(name: str | None, data: dict[str, Any]) -> str:
    """One event as the proxy writes it."""
    payload = f"data: {json.dumps(data)}\n\n"
    return f"event: {name}\n{payload}" if name is not None else payload


@dataclass
class Relay:
    endpoint: str
    fingerprint: str
    echo: Echo | None = None  # a Responses stream: the response's id and what it repeats of its request
    translator: ResponsesStream | None = None  # set when a chat stream answers a Responses request
    events: list[str] = field(default_factory=list)  # every event sent so far, exactly
    held: str | None = None  # the terminal event of a Responses stream, sent after the record
    upstream_fingerprint: str | None = None
    sequence: int = -1  # the last sequence number of a Responses stream
    assembly: ChunkAssembly | ResponseAssembly = field(init=False)

    def __post_init__(self) -> None:
        self.assembly = assembly_for(self.endpoint)

    @classmethod
    def translating(cls, fingerprint: str, echo: Echo) -> Relay:
        return cls(RESPONSES, fingerprint, echo, ResponsesStream(echo))

    def feed(self, event: Event) -> list[str]:
        """The texts to send the client for one event of the replica's stream."""
        data = event.data
        if isinstance(data.get("system_fingerprint"), str):
            self.upstream_fingerprint = data["system_fingerprint"]
        if self.translator is not None:
            return self._emit(self.translator.feed(data))
        if self.endpoint == RESPONSES:
            if isinstance(data.get("response"), dict) and self.echo is not None:
                data["response"] = {
                    **data["response"],
                    "id": self.echo.id,
                    "system_fingerprint": self.fingerprint,
                }
            return self._emit([(event.name or data.get("type"), data)])
        data["system_fingerprint"] = self.fingerprint
        return self._emit([(None, data)])

    def finish(self) -> list[str]:
        """The texts to send once the replica's stream has ended as it should."""
        return self._emit(self.translator.finish()) if self.translator is not None else []

    def terminal(self, error: str | None, *, client_left: bool) -> str | None:
        """The event sent after the record is closed: the end of a complete answer, or the failure of a broken
        one (None when the client has left)."""
        if error is None:
            return self.held if self.endpoint == RESPONSES else DONE
        if client_left:
            return None
        return self.failure(ReplicaFailed(f"the stream is incomplete: {error}"))

    def failure(self, message: StackpinError) -> str:
        """An error event in the stream's own shape: what ends a stream that cannot end with its answer."""
        if self.endpoint != RESPONSES:
            return sse(None, message.body())
        failure = {"type": "error", "sequence_number": self.sequence + 1, "code": message.code,
                   "message": message.message, "param": None}  # fmt: skip
        return sse("error", failure)

    def answer(self) -> dict[str, Any]:
        """What the events sent assemble into: the body a non-streamed answer would have been."""
        return self.assembly.body()

    def replica_answer(self) -> dict[str, Any] | None:
        return self.translator.chat.body() if self.translator is not None else None

    def _emit(self, events: list[tuple[str | None, dict[str, Any]]]) -> list[str]:
        texts = []
        for name, data in events:
            self.assembly.add(data)
            if isinstance(data.get("sequence_number"), int):
                self.sequence = data["sequence_number"]
            text = sse(name, data)
            if self.endpoint == RESPONSES and data.get("type") in TERMINAL_EVENTS:
                self.held = text
                continue
            self.events.append(text)
            texts.append(text)
        return texts
