"""Reading a client's request: the checks the proxy owns, and the body it will forward.

The proxy checks only what it acts on (`model`, `stream`, what each route must read: proxy/endpoints.py, the
`stackpin` pin); every other field passes through untouched for the replica to judge. The `stackpin` field is the
proxy's and is never forwarded. A request must say which model it is for, as OpenAI's API demands: by `model`, or
by a pin that names a model or a stack, unless the configuration names a default route. A request may carry a tag
(the `Stackpin-Tag` header: a study's or a client's label), which its record keeps and the replica never sees.
Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, check_request
from proxy.errors import BadRequest
from proxy.json_reader import read_json
from proxy.pins import Pin, resolve_request_pin
from proxy.serving.prompts import PromptBook, PromptVersion, inject
from proxy.serving.recordable import MAX_DEPTH, Unrecordable, check_recordable

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "RESPONSES",
    "TAG_HEADER",
    "ClientRequest",
    "parse_body",
    "read_request",
]

TAG_HEADER = "Stackpin-Tag"
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/=+-]{0,199}$")


@dataclass(frozen=True)
class ClientRequest:
    endpoint: str
    body: dict[str, Any]  # as it will be forwarded, but for `model`, which the chosen replica's stack sets
    stream: bool
    pin: Pin
    route: str | None
    prompt: PromptVersion | None
    previous_response_id: str | None = None  # the client's, which a response repeats
    continues: str | None = None  # the record that id names, once `body` holds its expanded input
    translated: dict[str, Any] | None = (
        None  # a replay's exact chat request, sent instead of translating `body`
    )
    tag: str | None = None  # the client's label for the request (TAG_HEADER), kept in its record
    # Set for work the proxy runs itself (a background response, a batch's line): the record id its answer
    # must have, and what stored state it belongs to, which its record says.
    record_id: str | None = None
    belongs_to: dict[str, Any] | None = None

    def continuing(self, record_id: str, expanded: dict[str, Any]) -> ClientRequest:
        return replace(self, body=expanded, continues=record_id)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or BadRequest saying why not; whether the log can hold it is `read_request`'s."""
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        body = read_json(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadRequest(
            f"the request body is nested too deeply; the proxy reads at most {MAX_DEPTH} levels"
        ) from None
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or infinities)")


def read_request(
    endpoint: str,
    body: dict[str, Any],
    *,
    pin_header: str | None,
    routes: dict[str, Pin],
    prompts: PromptBook,
    default_route: str | None = None,
    live_models: Callable[[], list[str]] = list,
    tag: str | None = None,
) -> ClientRequest:
    """`live_models` names the models a client could ask for, for the error that a request without one gets.

    Every body that may reach a replica passes here, whoever built it (the API, the audit page's probe), so the
    check that the audit log can hold it (proxy/serving/recordable.py) is made here, before any replica is called."""
    try:
        check_recordable(body)
    except Unrecordable as e:
        where = f"'{e.path}'" if e.path else "the request body"
        raise BadRequest(f"{where} {e.reason}", param=e.path or None) from e
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    check_request(endpoint, body, stream)
    pin, route = resolve_request_pin(
        model=model if model is not None else default_route,
        header=pin_header,
        body_pin=body.get("stackpin"),
        routes=routes,
    )
    if model is None and default_route is None and pin.model is None and pin.stack is None:
        known = live_models()
        raise BadRequest(
            "the request names no model: set 'model' to one of "
            + (", ".join(repr(m) for m in known) if known else "the live models (none is live now)")
            + " (GET /v1/models lists them), or pin a stack",
            param="model",
        )
    forwarded = {key: value for key, value in body.items() if key != "stackpin"}
    prompt = prompts.resolve(pin.prompt) if pin.prompt else None
    if prompt is not None:
        forwarded = inject(forwarded, endpoint, prompt)
    previous = body.get("previous_response_id") if endpoint == RESPONSES else None
    return ClientRequest(
        endpoint, forwarded, stream, pin, route, prompt, previous_response_id=previous, tag=_checked_tag(tag)
    )


def _checked_tag(tag: str | None) -> str | None:
    if tag is not None and not _TAG.match(tag):
        raise BadRequest(
            f"{TAG_HEADER} must be 1 to 200 letters, digits or . _ : / = + -, starting with a letter or digit; "
            f"got {tag[:60]!r}",
            param=TAG_HEADER,
        )
    return tag
