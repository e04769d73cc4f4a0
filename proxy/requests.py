"""Reading a client's request: the checks the proxy owns, and the body it will forward.

The proxy checks only what it acts on (`model`, `stream`, `messages`/`prompt`, the `stackpin` pin); every other
field passes through untouched for the replica to judge. The `stackpin` field is the proxy's and is never
forwarded. Pure functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.errors import BadRequest
from proxy.pins import Pin, resolve_request_pin
from proxy.prompts import PromptBook, PromptVersion, inject

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class ClientRequest:
    endpoint: str
    body: dict[str, Any]  # as it will be forwarded, but for `model`, which the chosen replica's stack sets
    stream: bool
    pin: Pin
    route: str | None
    prompt: PromptVersion | None


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def read_request(
    endpoint: str,
    body: dict[str, Any],
    *,
    pin_header: str | None,
    routes: dict[str, Pin],
    prompts: PromptBook,
) -> ClientRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    if endpoint == CHAT:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    pin, route = resolve_request_pin(
        model=model, header=pin_header, body_pin=body.get("stackpin"), routes=routes
    )
    forwarded = {key: value for key, value in body.items() if key != "stackpin"}
    prompt = prompts.resolve(pin.prompt) if pin.prompt else None
    if prompt is not None:
        forwarded = inject(forwarded, endpoint, prompt)
    return ClientRequest(endpoint, forwarded, stream, pin, route, prompt)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | int) for p in prompt):
        return
    raise BadRequest("'prompt' must be a string (or a list of strings or token ids)", param="prompt")
