"""Serving a completion: dispatch to a pinned replica, commit the record, then answer (invariant 1).

Non-streamed: the replica's whole answer is read, its record committed, and only then sent. Streamed: the
`opened` record is committed before the first byte; chunks are relayed with the stack fingerprint stamped in;
the `closed` record (complete, or interrupted when either side breaks off) is committed before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from pydantic import ValidationError

from proxy.answers import StreamAssembly, Tokens
from proxy.audit import AuditStore, NewEntry
from proxy.config import Secrets, Settings
from proxy.dispatch import Dispatched, check_fingerprint, dispatch
from proxy.errors import ReplicaFailed
from proxy.fleet.runtime import Fleet
from proxy.forward import (
    Answer,
    ReplicaGarbage,
    ReplicaUnavailable,
    Stream,
    open_stream,
    post_json,
)
from proxy.health import HealthMonitor
from proxy.metrics import ProxyMetrics
from proxy.records import Served, answer_entry, closed_entry, opened_entry
from proxy.registry import Registry, Replica
from proxy.requests import ClientRequest

RECORD_HEADER = "Stackpin-Record"
STACK_HEADER = "Stackpin-Stack"
log = structlog.get_logger("stackpin.serving")


def new_record_id() -> str:
    return f"rec_{uuid.uuid4().hex}"


@dataclass
class Proxy:
    """Everything a request needs, built once by create_app."""

    settings: Settings
    secrets: Secrets
    registry: Registry
    store: AuditStore
    session: aiohttp.ClientSession
    metrics: ProxyMetrics
    health: HealthMonitor
    clock: Callable[[], datetime]
    fleet: Fleet | None = None  # rate limits, and the shared view in fleet mode

    async def send_json(self, replica: Replica, body: dict[str, Any], endpoint: str) -> Answer:
        """One non-streamed call, counted among the replica's outstanding requests while it runs."""
        self.registry.acquire(replica.name)
        try:
            answer = await self._post(replica, body, endpoint)
        finally:
            self.registry.release(replica.name)
        check_fingerprint(replica, answer.stack_header or _body_fingerprint(answer.body))
        return answer

    async def _post(self, replica: Replica, body: dict[str, Any], endpoint: str) -> Answer:
        return await post_json(
            self.session,
            replica.url + endpoint,
            {**body, "stream": False} if body.get("stream") else body,
            api_key=self.secrets.replica_keys.get(replica.name),
            timeout_s=self.settings.server.replica_timeout_s,
        )

    async def complete(
        self, request: ClientRequest, tenant: str, received_at: datetime
    ) -> tuple[Served, Answer]:
        """Dispatch a non-streamed request and commit its record; the caller sends the answer afterwards."""
        dispatched = await self._dispatch(
            request, lambda replica, body: self.send_json(replica, body, request.endpoint)
        )
        served = self._served(request, tenant, received_at, dispatched)
        answer = dispatched.result
        upstream_fp = _body_fingerprint(answer.body)
        await self.store.append(
            self._entry(answer_entry, served, answer.body, self.clock(), upstream_fingerprint=upstream_fp)
        )
        log.info("answered", tenant=tenant, endpoint=request.endpoint)
        return served, answer

    async def stream(
        self, request: ClientRequest, tenant: str, received_at: datetime, http_request: web.Request
    ) -> tuple[Served, web.StreamResponse]:
        async def send(replica: Replica, body: dict[str, Any]) -> Stream:
            stream = await open_stream(
                self.session,
                replica.url + request.endpoint,
                body,
                api_key=self.secrets.replica_keys.get(replica.name),
                timeout_s=self.settings.server.replica_timeout_s,
            )
            if not replica.declared and stream.stack_header != replica.fingerprint:
                stream.close()
                check_fingerprint(replica, stream.stack_header)
            return stream

        dispatched = await self._dispatch(request, send)
        served = self._served(request, tenant, received_at, dispatched)
        upstream = dispatched.result
        self.registry.acquire(served.replica.name)
        try:
            try:
                await self.store.append(opened_entry(served, self.clock()))
            except BaseException:
                upstream.close()
                raise
            return served, await self._relay(served, upstream, http_request)
        finally:
            self.registry.release(served.replica.name)

    async def _relay(self, served: Served, upstream: Stream, http_request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                RECORD_HEADER: served.record_id,
                STACK_HEADER: served.fingerprint,
            }
        )
        assembly = StreamAssembly()
        status, error = "complete", None
        try:
            await response.prepare(http_request)
            async for chunk in upstream.events():
                assembly.add(chunk)
                chunk["system_fingerprint"] = served.fingerprint
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        except (ReplicaUnavailable, ReplicaGarbage) as e:
            status, error = "interrupted", f"replica: {e}"
        except (ConnectionResetError, asyncio.CancelledError) as e:
            status, error = "interrupted", f"client went away: {type(e).__name__}"
        finally:
            upstream.close()
            try:
                closed = closed_entry(
                    served,
                    assembly.tokens(),
                    self.clock(),
                    status=status,
                    usage=assembly.usage,
                    upstream_fingerprint=assembly.upstream_fingerprint,
                    chunks=assembly.chunks,
                    error=error,
                )
            except ValidationError as e:
                # The stream's end must be recorded whatever the replica sent; say what could not be kept.
                status, error = "interrupted", f"the answer cannot be recorded: {e.errors()[0]['msg']}"
                closed = closed_entry(
                    served,
                    Tokens(text=""),
                    self.clock(),
                    status=status,
                    usage=None,
                    upstream_fingerprint=None,
                    chunks=assembly.chunks,
                    error=error,
                )
            # The closing record must land even when the client's disconnect cancels this task.
            await asyncio.shield(self.store.append(closed))
        log.info("stream_closed", status=status, chunks=assembly.chunks)
        if status == "complete":
            self._count_tokens(served, assembly.usage)
            await response.write(b"data: [DONE]\n\n")
        elif error and not error.startswith("client"):
            failure = ReplicaFailed(f"the stream is incomplete: {error}")
            await response.write(b"data: " + json.dumps(failure.body()).encode() + b"\n\n")
        await response.write_eof()
        return response

    async def _dispatch(self, request: ClientRequest, send: Callable[..., Any]) -> Dispatched[Any]:
        try:
            return await dispatch(
                self.registry,
                request.pin,
                request.body,
                send,
                deadline_s=self.settings.server.retry_deadline_s,
                on_mismatch=self.health.on_mismatch,
            )
        except ReplicaGarbage as e:
            raise ReplicaFailed(f"the replica answered something that is not an OpenAI response: {e}") from e

    @staticmethod
    def _entry(build: Callable[..., NewEntry], *args: Any, **kwargs: Any) -> NewEntry:
        """Builds an entry; an answer the audit log cannot hold is the replica's fault, and is not served."""
        try:
            return build(*args, **kwargs)
        except ValidationError as e:
            raise ReplicaFailed(
                f"the replica's answer cannot be recorded, so it is not served: {e.errors()[0]['msg']}"
            ) from e

    def _served(
        self, request: ClientRequest, tenant: str, received_at: datetime, dispatched: Dispatched[Any]
    ) -> Served:
        record_id = new_record_id()
        # Every log line from here to the end of this request's task carries the record id.
        structlog.contextvars.bind_contextvars(
            record_id=record_id, replica=dispatched.replica.name, fingerprint=dispatched.replica.fingerprint
        )
        return Served(
            record_id=record_id,
            tenant=tenant,
            endpoint=request.endpoint,
            pin=request.pin,
            route=request.route,
            prompt=request.prompt,
            replica=dispatched.replica,
            forwarded=dispatched.body,
            received_at=received_at,
        )

    def _count_tokens(self, served: Served, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        model = served.replica.stack.model if served.replica.stack else "unknown"
        total = 0
        for direction, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            if isinstance(usage.get(key), int):
                self.metrics.tokens.labels(served.fingerprint, model, direction).inc(usage[key])
                total += usage[key]
        if self.fleet is not None:
            self.fleet.limiter.charge(served.tenant, total)

    def answer_response(self, served: Served, answer: Answer) -> web.Response:
        self._count_tokens(served, answer.body.get("usage"))
        body = {**answer.body, "system_fingerprint": served.fingerprint}
        return web.json_response(
            body, headers={RECORD_HEADER: served.record_id, STACK_HEADER: served.fingerprint}
        )


def _body_fingerprint(body: dict[str, Any]) -> str | None:
    value = body.get("system_fingerprint")
    return value if isinstance(value, str) else None
