"""The error middleware: the one place where a failure becomes an OpenAI-style error body.

Every refusal and failure of a request passes here: the proxy's own errors (proxy/errors.py), the audit store's
unavailability (503 with Retry-After), aiohttp's HTTP refusals, the replicas' failures and relayed 4xx bodies
(in OpenAI's shape; all of them in the one tree), and anything unexpected (500, logged with its traceback). Every body leaves with the configured secrets
redacted (proxy/serving/redact.py), and is counted in `stackpin_request_errors_total` under its route's template. What
aiohttp refuses before any handler runs is answered in proxy/process/listener.py, with the same bodies.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from proxy.app_keys import METRICS, REDACTOR, SETTINGS
from proxy.audit import StoreUnavailable
from proxy.errors import AtCapacity, AuditStoreUnavailable, HttpError, PayloadTooLarge, StackpinError

log = structlog.get_logger("stackpin.http")

# Answered even on a connection past `server.max_connections` (proxy/process/listener.py), so that a load balancer and
# a kubelet can still tell a busy proxy from a dead one.
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    structlog.contextvars.clear_contextvars()
    over_cap = bool(getattr(request.protocol, "over_cap", False))
    try:
        if over_cap and request.path not in PROBES:
            raise AtCapacity(
                "the proxy holds as many connections as it takes (server.max_connections); retry shortly"
            )
        response = await handler(request)
    except Exception as e:
        return _error_response(request, e)
    if over_cap:
        response.force_close()
    return response


def _error_response(request: web.Request, exc: Exception) -> web.Response:
    """The one place where a failure becomes an OpenAI-style error body, with every secret redacted."""
    if isinstance(exc, web.HTTPException) and exc.status < 400:
        raise exc
    error = _as_stackpin_error(request, exc)
    _count_error(request, error.type)
    if not isinstance(exc, StackpinError | StoreUnavailable | web.HTTPException):
        log.exception("unhandled_error", path=request.path)
    else:
        log.info("request_refused", path=request.path, status=error.status, error=error.message)
    return error.response(request.config_dict[REDACTOR].value(error.body()))


def _as_stackpin_error(request: web.Request, exc: Exception) -> StackpinError:
    if isinstance(exc, StackpinError):
        return exc
    if isinstance(exc, StoreUnavailable):
        return AuditStoreUnavailable(
            "the audit store is unavailable, and no answer is served without its record; retry shortly"
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.config_dict[SETTINGS].server.max_body_bytes
        return PayloadTooLarge(
            f"the request body is larger than the proxy accepts ({limit} bytes; server.max_body_bytes)"
        )
    if isinstance(exc, web.HTTPException):
        return HttpError(exc.status, f"{request.method} {request.path}: {exc.reason}")
    return StackpinError("the proxy failed unexpectedly; the error is in its log")


def _count_error(request: web.Request, error: str) -> None:
    request.config_dict[METRICS].errors.labels(route_label(request), "none", error).inc()


def route_label(request: web.Request) -> str:
    """The route's template (`/v1/records/{record_id}`), never the path: ids stay out of /metrics, and the
    number of label values stays the number of routes."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"
