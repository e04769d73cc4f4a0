"""The fake replica's embeddings and Responses API answers (tests/support/fake_replica.py): pure functions of the request.

Embeddings are unit vectors drawn from a hash of each input, in float32 so that base64 carries them exactly. A
response, whole or as OpenAI's events, says the text the fake's completion would.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

DIMENSIONS = 8


def _vector(text: str, altered: bool) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(b - 127.5) / 127.5 for b in digest[:DIMENSIONS]]
    norm = sum(x * x for x in raw) ** 0.5
    vector = list(struct.unpack(f"<{DIMENSIONS}f", struct.pack(f"<{DIMENSIONS}f", *(x / norm for x in raw))))
    if altered:  # one component's last bit
        (bits,) = struct.unpack("<I", struct.pack("<f", vector[5]))
        vector[5] = struct.unpack("<f", struct.pack("<I", bits ^ 1))[0]
    return vector


def embeddings_body(body: dict[str, Any], model: str, fingerprint: str, *, altered: bool) -> dict[str, Any]:
    given = body.get("input")
    inputs = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given or [])
    data = []
    for i, item in enumerate(inputs):
        vector = _vector(str(item), altered and i == len(inputs) - 1)
        encoded: Any = vector
        if body.get("encoding_format") == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = sum(len(str(item)) for item in inputs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "system_fingerprint": fingerprint,
    }


def response_body(body: dict[str, Any], model: str, text: str) -> dict[str, Any]:
    return {
        "id": f"resp_upstream{hashlib.sha256(text.encode()).hexdigest()[:8]}",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": model,
        "output": [
            {
                "id": "msg_upstream",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 3,
            "output_tokens": len(text.split()),
            "total_tokens": 3 + len(text.split()),
        },
    }


def response_events(answer: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events OpenAI streams for a one-message response."""
    item = answer["output"][0]
    text = item["content"][0]["text"]
    pending = {**answer, "status": "in_progress", "output": [], "usage": None}
    opened = {**item, "status": "in_progress", "content": []}
    where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": pending}),
        ("response.in_progress", {"response": pending}),
        ("response.output_item.added", {"output_index": 0, "item": opened}),
        (
            "response.content_part.added",
            {**where, "part": {"type": "output_text", "text": "", "annotations": []}},
        ),
    ]
    words = text.split(" ")
    events += [
        ("response.output_text.delta", {**where, "delta": w if k == 0 else " " + w, "logprobs": []})
        for k, w in enumerate(words)
    ]
    events += [
        ("response.output_text.done", {**where, "text": text, "logprobs": []}),
        ("response.content_part.done", {**where, "part": item["content"][0]}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": answer}),
    ]
    return [(name, {"type": name, "sequence_number": k, **fields}) for k, (name, fields) in enumerate(events)]
