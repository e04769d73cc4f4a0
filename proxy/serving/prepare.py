"""What every answer goes through before and after the serving path, whoever asks: a request read (its pin, route
and prompt) with `conversation` and `previous_response_id` resolved, the models a client can name, what an answer
changes of stored state (a conversation's turn), and an answer counted in the metrics. The API's handlers
(handlers.py), the audit page's probe and the work the proxy runs itself (background responses and batches,
proxy/state/) share them. `config` is the application's mapping (or a sub-application's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.app_keys import PROMPTS, PROXY, REGISTRY, ROUTES, SETTINGS, STATE, STORE
from proxy.serving.records import Served
from proxy.serving.request import ClientRequest, read_request
from proxy.serving.router import live_stacks
from proxy.serving.serve import Proxy
from proxy.state.conversations import in_conversation, keep_turn


async def prepared(
    config: Mapping[Any, Any],
    tenant: str,
    endpoint: str,
    body: dict[str, Any],
    pin_header: str | None,
    *,
    tag: str | None = None,
) -> ClientRequest:
    """A request read (its pin, route and prompt), `conversation` and `previous_response_id` resolved into the input
    they stand for: what the serving path takes, from a client or from work the proxy runs itself (proxy/state/)."""
    client_request = read_request(
        endpoint,
        body,
        pin_header=pin_header,
        routes=config[ROUTES],
        prompts=config[PROMPTS],
        default_route=config[SETTINGS].server.default_route,
        live_models=lambda: sorted(model_objects(config)),
        tag=tag,
    )
    client_request = await in_conversation(config[STATE].conversations, client_request, tenant)
    return await config[PROXY].continued(client_request, tenant)


async def answered(
    config: Mapping[Any, Any], request: ClientRequest, served: Served, body: dict[str, Any] | None
) -> None:
    """What a recorded answer changes of stored state: a response in a conversation joins it, with its input and
    output (a stream's output read back from its record). Before the answer is sent: a turn the conversation could
    not keep is a 503 like any store failure, never a conversation that silently lacks it."""
    if (request.belongs_to or {}).get("conversation") is None:
        return
    if body is None:
        record = await config[STORE].get_record(served.record_id, served.tenant)
        closed = next((e for e in record.entries if e.part == "closed"), None) if record is not None else None
        answer = closed.content.get("answer") if closed is not None else None
        body = answer if isinstance(answer, dict) else {}
    output = body.get("output") if isinstance(body.get("output"), list) else []
    await keep_turn(
        config[STATE].conversations, request, served.record_id, served.tenant, output, config[PROXY].clock()
    )


def observe(proxy: Proxy, endpoint: str, served: Served, status: int, seconds: float) -> None:
    stack = served.replica.stack
    labels = (endpoint, served.fingerprint, stack.model, stack.kernel_mode, stack.hardware)
    proxy.metrics.answered(labels, status, seconds)


def model_objects(config: Mapping[Any, Any]) -> dict[str, dict[str, Any]]:
    """What a client can name as `model`: each live stack's model, and each route."""
    data: dict[str, dict[str, Any]] = {}
    for stack in live_stacks(config[REGISTRY].all()):
        name = stack["stack"]["model"]
        entry = data.setdefault(
            name, {"id": name, "object": "model", "created": 0, "owned_by": "stackpin", "stacks": []}
        )
        entry["stacks"].append(stack["fingerprint"])
    for route in config[ROUTES]:
        data.setdefault(
            route, {"id": route, "object": "model", "created": 0, "owned_by": "stackpin", "route": True}
        )
    return data
