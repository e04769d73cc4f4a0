"""HTTP handlers: parse, call the core, answer. Errors become OpenAI-style bodies in proxy/serving/middleware.py only.

The OpenAI routes (chat, completions, embeddings, responses) share one handler and one serving path
(proxy/serving/serve.py, under `PROXY`), but a background response, which is queued as a job (proxy/state/background.py);
the stored-state routes are proxy/state/'s. `GET /v1/models` and `GET /v1/models/{id}` name what a client can ask for. Each
handler takes the resources it needs from the application's typed keys (proxy/app_keys.py), and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.app_keys import FLEET, METRICS, PROXY, REGISTRY, SECRETS, SETTINGS, STORE
from proxy.audit import AuditRecord, NoSuchCheckpoint, ProofError
from proxy.endpoints import ENDPOINTS, RESPONSES
from proxy.errors import BadRequest, NotFound, RequestTimeout
from proxy.evidence.compare import Comparison
from proxy.pins import Pin, parse_pin_body
from proxy.serving.auth import authenticate
from proxy.serving.prepare import answered, model_objects, observe, prepared
from proxy.serving.request import TAG_HEADER, parse_body
from proxy.serving.router import live_stacks
from proxy.serving.serve import Proxy
from proxy.serving.sinks import HttpSink
from proxy.state.background import queued_response

log = structlog.get_logger("stackpin.http")


async def read_body(request: web.Request) -> bytes:
    """The whole body, within `server.body_timeout_s`; an undecodable one is the client's to fix."""
    limit = request.config_dict[SETTINGS].server.body_timeout_s
    try:
        if request.content.is_eof():
            # All of it has arrived (most bodies come with their headers): no timer to arm and cancel.
            return await request.read()
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {limit:g} s (server.body_timeout_s)"
        ) from None
    except web.RequestPayloadError as e:
        reason = getattr(e.__cause__, "message", None) or " ".join(str(e).split())
        raise BadRequest(
            f"the request body cannot be read ({reason}); send JSON, uncompressed or as gzip or deflate"
        ) from None


async def openai_route(request: web.Request) -> web.StreamResponse:
    tenant = authenticate(request.headers, request.app[SECRETS])
    body = parse_body(await read_body(request))
    pin_header = request.headers.get("Stackpin-Pin")
    tag = request.headers.get(TAG_HEADER)
    if request.path == RESPONSES and body.get("background") is True:
        return await queued_response(request, tenant, body, pin_header)  # any proxy of the fleet runs it
    return await serve_completion(
        request.config_dict, tenant, request.path, body, pin_header, request, tag=tag
    )


async def serve_completion(
    config: Mapping[Any, Any],
    tenant: str,
    endpoint: str,
    body: dict[str, Any],
    pin_header: str | None,
    http_request: web.Request | None,
    *,
    tag: str | None = None,
) -> web.StreamResponse:
    """The path every answer takes once its tenant is known: the API's, and the audit page's probe (which
    never streams, so it passes no `http_request`). `config` is the application's, or a sub-application's view."""
    proxy = config[PROXY]
    started = time.perf_counter()
    received_at = proxy.clock()
    client_request = await prepared(config, tenant, endpoint, body, pin_header, tag=tag)
    await proxy.limiter.admit(tenant)
    response: web.StreamResponse
    if client_request.stream:
        if http_request is None:
            raise BadRequest("this caller cannot stream; send 'stream': false", param="stream")
        sink = HttpSink(http_request)
        served, status = await proxy.stream(client_request, tenant, received_at, sink)
        if status == "complete":
            await answered(config, client_request, served, None)
        assert sink.response is not None
        response = sink.response
    else:
        served, answer, receipt = await proxy.complete(client_request, tenant, received_at)
        await answered(config, client_request, served, answer)
        response = proxy.answer_response(served, answer, receipt)
    observe(proxy, endpoint, served, response.status, time.perf_counter() - started)
    return response


async def models(request: web.Request) -> web.Response:
    authenticate(request.headers, request.app[SECRETS])
    data = model_objects(request.app)
    return web.json_response({"object": "list", "data": [data[name] for name in sorted(data)]})


async def model(request: web.Request) -> web.Response:
    authenticate(request.headers, request.app[SECRETS])
    data = model_objects(request.app)
    model_id = request.match_info["model_id"]
    if model_id not in data:
        raise NotFound(
            f"no model {model_id!r} is live; the models are {', '.join(sorted(data)) or '(none is live)'}",
            param="model",
        )
    return web.json_response(data[model_id])


async def stacks(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    authenticate(request.headers, request.app[SECRETS])
    replicas = [
        {
            "name": r.name,
            "fingerprint": r.fingerprint,
            "kind": r.kind.name,
            "declared": r.stack_source == "declared",
            "stack_source": r.stack_source.value,
            "leased": r.leased,
            "in_rotation": r.in_rotation,
            "reachable": r.reachable,
            "quarantined": r.quarantined,
            "outstanding": r.outstanding,
        }
        for r in registry.all()
    ]
    return web.json_response({"stacks": live_stacks(registry.all()), "replicas": replicas})


async def get_record(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    record = await _record_of(request, tenant)
    return web.json_response(record.model_dump(mode="json"))


async def replay_record(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    record = await _record_of(request, tenant)
    raw = await read_body(request)
    options = parse_body(raw) if raw.strip() else {}
    on = parse_pin_body(options["on"]) if options.get("on") is not None else None
    replay_id, comparison, fingerprint = await counted_replay(request.app[PROXY], record, tenant, on)
    return web.json_response(_replay_json(record.id, replay_id, comparison, fingerprint))


async def counted_replay(
    proxy: Proxy, record: AuditRecord, tenant: str, on: Pin | None
) -> tuple[str, Comparison, str]:
    """A replay, a failed one counted; the API and the audit page replay through it."""
    try:
        return await proxy.replay(record, tenant, on)
    except Exception:  # every failure to replay is counted, whatever refused it
        proxy.metrics.replays.labels("error").inc()
        raise


def _replay_json(original: str, replay_id: str, comparison: Comparison, fingerprint: str) -> dict[str, Any]:
    return {"record": original, "replay_record": replay_id, "stack": fingerprint, **comparison.as_json()}


async def _record_of(request: web.Request, tenant: str) -> Any:
    record_id = request.match_info["record_id"]
    record = await request.app[STORE].get_record(record_id, tenant)
    if record is None:
        raise _no_record(record_id)
    return record


def _no_record(record_id: str) -> NotFound:
    """Also for another tenant's record: whether it exists is not theirs to know."""
    return NotFound(
        f"no record {record_id!r} (record ids look like rec_<32 hex>; list yours with stackpin records)"
    )


def _size(request: web.Request, name: str) -> int | None:
    """A tree size from the query string: a decimal number, or absent."""
    value = request.query.get(name)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise BadRequest(
            f"{name} must be a tree size (a whole number of leaves), got {value[:40]!r}", param=name
        )
    return int(value)


async def _log_read(read: Any) -> Any:
    """A read of the log; what cannot exist is a 400, what the log never signed a 404."""
    try:
        return await read
    except ProofError as e:
        raise BadRequest(str(e)) from e
    except NoSuchCheckpoint as e:
        raise NotFound(str(e)) from e


async def log_checkpoint(request: web.Request) -> web.Response:
    """The latest signed checkpoint (or the one of `?size=`), as the signed note itself."""
    authenticate(request.headers, request.app[SECRETS])
    checkpoint = await _log_read(request.app[STORE].checkpoint(_size(request, "size")))
    return web.Response(text=checkpoint.note, content_type="text/plain", charset="utf-8")


async def log_consistency(request: web.Request) -> web.Response:
    authenticate(request.headers, request.app[SECRETS])
    old = _size(request, "from")
    if old is None:
        raise BadRequest("from is required: the tree size you hold a checkpoint of", param="from")
    proof = await _log_read(request.app[STORE].consistency(old, _size(request, "to")))
    return web.json_response(proof.model_dump(mode="json", by_alias=True))


async def record_proof(request: web.Request) -> web.Response:
    """Inclusion proofs of each entry of the record, tenant-scoped like the record itself."""
    tenant = authenticate(request.headers, request.app[SECRETS])
    record_id = request.match_info["record_id"]
    proof = await _log_read(request.app[STORE].record_proof(record_id, tenant, _size(request, "size")))
    if proof is None:
        raise _no_record(record_id)
    return web.json_response(proof.model_dump(mode="json"))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    problems = []
    try:
        await request.app[STORE].ping()
    except Exception as e:
        problems.append(f"audit store unreachable: {type(e).__name__}")
    diverged = request.app[STORE].diverged
    if diverged is not None:
        # Answers are still committed (docs/audit.md says why they are still given), but none can be proven
        # until the database is put right: an orchestrator and whoever watches it must know.
        problems.append(f"audit log diverged, new answers cannot be proven: {diverged}")
    if not request.app[REGISTRY].live():
        problems.append("no replica is in rotation")
    body: dict[str, Any] = {"problems": problems}
    sync = request.app[FLEET].sync
    if sync is not None:
        state = sync.status()
        body["fleet"] = {
            "state": "stale" if state.stale else "fresh",
            "stale_for_s": round(state.stale_for_s, 1),
            "max_stale_s": sync.max_stale_s,
            "error": sync.last_error,
        }
        # Stale within the bound is still ready: dropping every proxy from the load balancer because Redis
        # blinked would turn a degraded fleet into an outage. Past the bound the leased replicas are out anyway.
        if state.expired:
            problems.append(
                f"fleet state (Redis) unreachable for {state.stale_for_s:.0f} s, longer than fleet.max_stale_s"
            )
    status = 503 if problems else 200
    body["status"] = "ready" if not problems else "not ready"
    return web.json_response(body, status=status)


async def metrics(request: web.Request) -> web.Response:
    metrics, sync = request.app[METRICS], request.app[FLEET].sync
    metrics.observe_replicas(request.app[REGISTRY].all())
    metrics.log_diverged.set(0 if request.app[STORE].diverged is None else 1)
    if sync is not None:
        metrics.fleet_stale.set(1 if sync.status().stale else 0)
    body = metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def routes() -> list[web.RouteDef]:
    return [
        *(web.post(endpoint, openai_route) for endpoint in ENDPOINTS),
        web.get("/v1/models", models),
        web.get("/v1/models/{model_id:.+}", model),
        web.get("/v1/stacks", stacks),
        web.get("/v1/records/{record_id}", get_record),
        web.post("/v1/records/{record_id}/replay", replay_record),
        web.get("/v1/records/{record_id}/proof", record_proof),
        web.get("/v1/log/checkpoint", log_checkpoint),
        web.get("/v1/log/consistency", log_consistency),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
    ]
