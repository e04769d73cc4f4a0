"""The OpenAI routes the proxy serves and records: what each asks of a request, and what its answer must look like.

    /v1/chat/completions, /v1/completions   `choices`; streamed as `data:` events ending in `data: [DONE]`
    /v1/embeddings                          `data` (one vector per input); never streamed
    /v1/responses                           `output` (the Responses API); streamed as named events (`event:
                                            response.created` ...), ending with the response's terminal event

Which of them a replica answers itself, and which through the proxy's translation of the Responses API to chat
(proxy/serving/responses_api.py), its kind says (proxy/replicas/kinds/): a pinned_backend the first three itself and
the Responses API translated, an engine chat and completions, an upstream API what its configuration declares (chat
and completions unless it says more). The proxy checks only what it acts on; every other field is the replica's to judge. Pure.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
BACKEND_ENDPOINTS = frozenset({CHAT, COMPLETIONS, EMBEDDINGS})  # what a pinned_backend answers itself
DECLARED_DEFAULT = (CHAT, COMPLETIONS)  # what an upstream serves unless its configuration says more
# The events after which a Responses stream is over; it ends without `data: [DONE]`.
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


def check_request(endpoint: str, body: dict[str, Any], stream: bool) -> None:
    """A 400 naming the field, for what the proxy must read to serve the request."""
    if endpoint == CHAT:
        _check_messages(body.get("messages"))
    elif endpoint == COMPLETIONS:
        _check_prompt(body.get("prompt"))
    elif endpoint == EMBEDDINGS:
        _check_embedding_input(body.get("input"))
        if stream:
            raise BadRequest("embeddings are not streamed; leave 'stream' out", param="stream")
    elif endpoint == RESPONSES:
        _check_response_input(body.get("input"))
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise BadRequest("'previous_response_id' must be a string", param="previous_response_id")


def answer_problem(endpoint: str, body: dict[str, Any]) -> str | None:
    """What makes `body` no answer of `endpoint`'s kind, or None when it is one."""
    key = {EMBEDDINGS: "data", RESPONSES: "output"}.get(endpoint, "choices")
    items = body.get(key)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return f"answer has no {key!r} list of objects"
    if key == "choices" and not items:
        return "answer has an empty 'choices' list"
    return None


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


def _check_embedding_input(value: Any) -> None:
    if isinstance(value, str):
        return
    if (
        isinstance(value, list)
        and value
        and (all(isinstance(v, str) for v in value) or all(_token_ids(v) for v in value) or _token_ids(value))
    ):
        return
    raise BadRequest(
        "'input' must be a string, a non-empty list of strings, or token ids (a list, or a list of lists)",
        param="input",
    )


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _check_response_input(value: Any) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return
    raise BadRequest("'input' must be a string or a list of input items (objects)", param="input")
