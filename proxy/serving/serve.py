"""Serving a request: dispatch to a pinned replica, commit the record, then answer (invariant 1). Answers and
replays take this one path, so they are routed, checked, recorded and counted alike, and fail alike.

Non-streamed: the replica's whole answer is read, checked to be an answer of its route, its record committed, and
only then sent, with the log's receipt for its entry (header `Stackpin-Receipt`). Streamed: the `opened` record is
committed before the first byte, whose headers carry its receipt; events are relayed (relay.py); the `closed`
record (complete, or interrupted when either side breaks off) is committed before the event that ends the answer,
which follows its receipt as an SSE comment. A Responses request to a replica that serves chat only is translated
(responses_api.py) on the way there and back; `previous_response_id` is resolved from the audit store into the
input it stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar, cast

import aiohttp
import orjson
import structlog
from aiohttp import web
from pydantic import SecretStr, ValidationError

from proxy.audit import AuditError, AuditRecord, AuditStore, InvalidEntry, SealedEntry, StoreUnavailable
from proxy.config import ServerSettings
from proxy.endpoints import CHAT, RESPONSES, answer_problem
from proxy.errors import (
    AuditStoreUnavailable,
    BadRequest,
    ReplicaFailed,
    ReplicaGarbage,
    ReplicaRejected,
    ReplicaUnavailable,
    StackMismatch,
)
from proxy.evidence.compare import Comparison
from proxy.evidence.replay import Answered, Replaying, recorded, replay_request
from proxy.fleet.limits import RateLimiter
from proxy.metrics import ProxyMetrics
from proxy.pins import Pin
from proxy.replicas.forward import Answer, Event, Stream, open_stream, post_json
from proxy.replicas.health import HealthMonitor
from proxy.replicas.registry import Registry, ReplicaSnapshot
from proxy.serving.dispatch import Dispatched, dispatch
from proxy.serving.records import ClosedStatus, Served, answer_entry, closed_entry, opened_entry
from proxy.serving.redact import Redactor
from proxy.serving.relay import Relay
from proxy.serving.request import ClientRequest
from proxy.serving.responses_api import (
    Echo,
    expand,
    from_chat,
    record_of,
    response_id,
    responses_error,
    to_chat,
)
from proxy.serving.sinks import BufferSink, Sink
from proxy.serving.unclosed import Unclosed
from proxy.state.stored_responses import unreadable
from proxy.telemetry import NoTelemetry, Telemetry

RECORD_HEADER = "Stackpin-Record"
STACK_HEADER = "Stackpin-Stack"
RECEIPT_HEADER = "Stackpin-Receipt"
log = structlog.get_logger("stackpin.serving")


Reply = TypeVar("Reply", Answer, Stream)
# How a relayed stream ended: its `closed` entry committed as complete or interrupted, or its end not recorded.
StreamStatus = Literal[ClosedStatus, "unrecorded"]


@dataclass(frozen=True)
class Sent(Generic[Reply]):
    """What one call to a replica carried: where, what exactly, and what came back (a JSON answer, or a stream)."""

    endpoint: str
    body: dict[str, Any]
    reply: Reply


@dataclass(frozen=True)
class StreamEnd:
    """How a relayed stream ended, as its `closed` entry is built from it."""

    served: Served
    relay: Relay
    status: StreamStatus
    error: str | None
    client_left: bool
    replaying: Replaying | None


@dataclass(frozen=True)
class Proxy:
    """The serving path, built by create_app from the application's resources (proxy/app.py); it owns none of them."""

    store: AuditStore
    registry: Registry
    health: HealthMonitor  # told of an answer under another fingerprint (invariant 3)
    session: aiohttp.ClientSession  # to the replicas
    metrics: ProxyMetrics
    limiter: RateLimiter  # charged with the tokens each answer used
    server: ServerSettings  # the replicas' timeout and the retry deadline
    replica_keys: Mapping[str, SecretStr]  # replica name -> upstream key, sent only in headers
    # What comes from replicas, answers and events alike, is relayed and recorded without any configured key.
    redactor: Redactor
    # Where streams' closing entries are built, one at a time, off the event loop (see _close).
    closing: ThreadPoolExecutor
    unclosed: Unclosed  # streams' ends the store was away for, committed once it is back
    clock: Callable[[], datetime]
    record_ids: Callable[[], str]  # each call a new record id (proxy/serving/record_ids.py)
    telemetry: Telemetry = field(default_factory=NoTelemetry)  # a span per answer, when configured

    async def continued(self, request: ClientRequest, tenant: str) -> ClientRequest:
        """A Responses request with `previous_response_id` resolved into the input it stands for."""
        if request.previous_response_id is None:
            return request
        record_id = record_of(request.previous_response_id)
        record = await self.store.get_record(record_id, tenant)
        try:
            previous = recorded(record) if record is not None else None
        except BadRequest:
            previous = None
        unstored = unreadable(record)  # deleted, or never stored (store: false)
        if previous is None or previous.endpoint != RESPONSES or unstored is not None:
            why = f" ({unstored})" if unstored is not None and previous is not None else ""
            raise BadRequest(
                f"previous_response_id {request.previous_response_id!r} names no complete response of yours{why}",
                param="previous_response_id",
            )
        expanded = expand(request.body, previous.client_request, previous.answered.body)
        return request.continuing(record_id, expanded)

    async def complete(
        self, request: ClientRequest, tenant: str, received_at: datetime, replaying: Replaying | None = None
    ) -> tuple[Served, dict[str, Any], str | None]:
        """Dispatch a non-streamed request and commit its record; returns the body to send afterwards, and the log's
        receipt for its entry."""

        async def send(replica: ReplicaSnapshot, body: dict[str, Any]) -> Sent[Answer]:
            endpoint, sent = self._route(request, replica, body)
            return Sent(endpoint, sent, await self._send_json(replica, endpoint, sent))

        dispatched = await self._dispatch(request, send)
        served = self._served(request, tenant, received_at, dispatched, replaying)
        replica_body = dispatched.result.reply.body
        body, upstream = self._client_body(served, request, replica_body)
        translated = replica_body if served.translated_from is not None else None
        replay = replaying.judge(Answered(body, translated)) if replaying is not None else None
        entry = self._entry(
            answer_entry,
            served,
            body,
            self.clock(),
            replica_response=translated,
            upstream=upstream,
            replay=replay,
        )
        stored = await self.store.append(entry)
        self.telemetry.answered(served, lambda: body, stored, "complete")
        log.info("answered", tenant=tenant, endpoint=request.endpoint)
        self._count_tokens(served, body.get("usage"))
        return served, body, stored.receipt

    async def stream(
        self,
        request: ClientRequest,
        tenant: str,
        received_at: datetime,
        sink: Sink,
        replaying: Replaying | None = None,
    ) -> tuple[Served, StreamStatus]:
        """Dispatch a streamed request and relay it; returns how its record closed."""

        async def send(replica: ReplicaSnapshot, body: dict[str, Any]) -> Sent:
            endpoint, sent = self._route(request, replica, body)
            try:
                stream = await open_stream(
                    self.session,
                    replica.url + endpoint,
                    sent,
                    api_key=self.replica_keys.get(replica.name),
                    timeout_s=self.server.replica_timeout_s,
                )
            except ReplicaRejected as e:
                raise replica.kind.rejected(e) from e
            try:
                replica.kind.check_answer(replica, stream.stack_header, None)
            except StackMismatch:
                stream.close()
                raise
            return Sent(endpoint, sent, stream)

        dispatched = await self._dispatch(request, send)
        served = self._served(request, tenant, received_at, dispatched, replaying)
        upstream = dispatched.result.reply
        self.registry.acquire(served.replica.name)
        try:
            try:
                opened = await self.store.append(opened_entry(served, self.clock()))
            except BaseException:
                upstream.close()
                raise
            status = await self._relay(served, request, upstream, sink, replaying, opened.receipt)
            return served, status
        finally:
            self.registry.release(served.replica.name)

    async def replay(self, record: AuditRecord, tenant: str, on: Pin | None) -> tuple[str, Comparison, str]:
        """Replay and record; returns the replay's record id, the comparison, and the stack it ran on."""
        original = recorded(record)
        request = replay_request(original, on if on is not None else Pin(stack=original.fingerprint))
        replaying = Replaying(original)
        received_at = self.clock()
        if request.stream:
            served, status = await self.stream(request, tenant, received_at, BufferSink(), replaying)
            if status == "unrecorded":
                raise AuditStoreUnavailable(
                    f"the replayed stream's end could not be recorded ({served.record_id})"
                )
            if status != "complete" or replaying.comparison is None:
                raise ReplicaFailed(f"the replayed stream did not complete; its record is {served.record_id}")
        else:
            served, _, _ = await self.complete(request, tenant, received_at, replaying)
        assert replaying.comparison is not None
        self.metrics.replays.labels(replaying.comparison.outcome).inc()
        return served.record_id, replaying.comparison, served.fingerprint

    def _route(
        self, request: ClientRequest, replica: ReplicaSnapshot, body: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """Where a replica is sent a request, and what exactly: a Responses request it does not serve itself
        goes to its chat route, translated; its kind adds what it must be asked for (token ids, logprobs)."""
        endpoint = request.endpoint
        if request.endpoint == RESPONSES and not replica.natively(RESPONSES):
            endpoint = CHAT
            if request.translated is not None:
                body = {**request.translated, "model": body["model"]}
            else:
                body = to_chat(body)
        return endpoint, replica.kind.forwarded(endpoint, body)

    async def _send_json(self, replica: ReplicaSnapshot, endpoint: str, body: dict[str, Any]) -> Answer:
        """One non-streamed call, counted among the replica's outstanding requests while it runs."""
        self.registry.acquire(replica.name)
        try:
            answer = await post_json(
                self.session,
                replica.url + endpoint,
                {**body, "stream": False} if body.get("stream") else body,
                api_key=self.replica_keys.get(replica.name),
                timeout_s=self.server.replica_timeout_s,
            )
        except ReplicaRejected as e:
            raise replica.kind.rejected(e) from e
        finally:
            self.registry.release(replica.name)
        body = answer.body if not self.redactor else self.redactor.value(answer.body)
        answer = Answer(replica.kind.answered(endpoint, body), answer.stack_header)
        replica.kind.check_answer(replica, answer.stack_header, answer.body)
        problem = answer_problem(endpoint, answer.body)
        if problem is not None:
            raise ReplicaGarbage(problem)
        return answer

    def _client_body(
        self, served: Served, request: ClientRequest, replica_body: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The body the client gets, and what of the replica's own it replaced."""
        upstream: dict[str, Any] = {"system_fingerprint": _body_fingerprint(replica_body)}
        if served.endpoint != RESPONSES:
            return {**replica_body, "system_fingerprint": served.fingerprint}, upstream
        echo = self._echo(served, request)
        if served.translated_from is not None:
            body = from_chat(replica_body, echo)
        else:
            upstream["id"] = replica_body.get("id")
            body = {**replica_body, "id": echo.id}
        return {**body, "system_fingerprint": served.fingerprint}, upstream

    def _echo(self, served: Served, request: ClientRequest) -> Echo:
        created = int(served.received_at.timestamp())
        return Echo(response_id(served.record_id), created, served.translated_from or served.forwarded,
                    request.previous_response_id)  # fmt: skip

    async def _relay(
        self,
        served: Served,
        request: ClientRequest,
        upstream: Stream,
        sink: Sink,
        replaying: Replaying | None,
        receipt: str | None,
    ) -> StreamStatus:
        relay = self._relay_for(served, request)
        status: StreamStatus = "complete"
        error: str | None = None
        client_left = False
        headers = {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            RECORD_HEADER: served.record_id,
            STACK_HEADER: served.fingerprint,
        }
        if receipt is not None:  # the `opened` entry's
            headers[RECEIPT_HEADER] = receipt
        try:
            await sink.open(headers)
            async for event in upstream.events():
                for text in relay.feed(self._read(served, event)):
                    await sink.write(text.encode())
                # Events already buffered are relayed without waiting, so a fast stream would hold the event
                # loop to its end and every other client would wait: let them in between events.
                await asyncio.sleep(0)
            for text in relay.finish():
                await sink.write(text.encode())
        except (ReplicaUnavailable, ReplicaGarbage) as e:
            status, error = "interrupted", self.redactor.text(f"replica: {e}")
        except (ConnectionResetError, asyncio.CancelledError) as e:
            status, error, client_left = "interrupted", f"client went away: {type(e).__name__}", True
        except Exception as e:
            # Once the response has started nothing may escape to the middleware: its error response would land
            # inside this one's body.
            log.exception("stream_relay_failed")
            status, error = "interrupted", f"the proxy failed: {type(e).__name__}"
        finally:
            upstream.close()
            # The closing record must land even when the client's disconnect cancels this task.
            status, terminal = await asyncio.shield(
                self._close(StreamEnd(served, relay, status, error, client_left, replaying))
            )
        log.info("stream_closed", status=status, chunks=len(relay.events))
        if status == "complete":
            self._count_tokens(served, relay.answer().get("usage"))
        if terminal is not None:
            with contextlib.suppress(ConnectionResetError):
                await sink.write(terminal.encode())
        await sink.close()
        return status

    async def _close(self, end: StreamEnd) -> tuple[StreamStatus, str | None]:
        """Commits a stream's `closed` entry; returns how it closed and the event to send after it."""
        # Off the event loop: a long stream's entry holds its every event in canonical JSON, which takes a while
        # to build (about a second for 80,000 events), and every other client would wait for it. One at a time:
        # each more thread building at once would take a share of the interpreter from the event loop.
        served, relay, error = end.served, end.relay, end.error
        build = functools.partial(self._closed, end)
        closed, terminal = await asyncio.get_running_loop().run_in_executor(self.closing, build)
        try:
            stored = await self.store.append(closed)
        except AuditError as e:
            # Never the answer's end: the client must not take for recorded what is not.
            log.error("stream_close_not_recorded", error=str(e))
            unconfirmed = AuditStoreUnavailable(
                "the end of this stream could not be recorded; it is not confirmed"
            )
            sent = None if end.client_left else relay.failure(unconfirmed)
            if isinstance(e, StoreUnavailable):  # its end, as the client saw it, waits for the store
                build = functools.partial(self._unconfirmed, served, relay, error, sent)
                self.unclosed.hold(await asyncio.get_running_loop().run_in_executor(self.closing, build))
            return "unrecorded", sent
        self.telemetry.answered(served, relay.answer, stored, closed.status)
        if terminal is not None:
            terminal = receipt_comment(stored.receipt) + terminal
        return cast(ClosedStatus, closed.status), terminal

    def _read(self, served: Served, event: Event) -> Event:
        """An event as relayed and recorded: redacted, its tokens where its replica's kind puts them read."""
        data = self.redactor.value(event.data) if self.redactor else event.data
        endpoint = served.replica_endpoint or served.endpoint
        return Event(event.name, served.replica.kind.answered(endpoint, data))

    def _relay_for(self, served: Served, request: ClientRequest) -> Relay:
        if served.endpoint != RESPONSES:
            return Relay(served.endpoint, served.fingerprint)
        echo = self._echo(served, request)
        if served.translated_from is not None:
            return Relay.translating(served.fingerprint, echo)
        return Relay(RESPONSES, served.fingerprint, echo)

    def _closed(self, end: StreamEnd) -> tuple[SealedEntry, str | None]:
        """The `closed` entry, and the event to send once it is committed."""
        served, relay, status, error, client_left = (
            end.served,
            end.relay,
            end.status,
            end.error,
            end.client_left,
        )
        replaying = end.replaying
        answer, replica_answer = relay.answer(), relay.replica_answer()
        replay = None
        if replaying is not None and status == "complete":
            replay = replaying.judge(Answered(answer, replica_answer, relay.events))
        terminal = relay.terminal(error, client_left=client_left)
        try:
            entry = closed_entry(
                served,
                self.clock(),
                status=status,
                events=relay.events,
                terminal=terminal,
                answer=answer,
                replica_answer=replica_answer,
                upstream_fingerprint=relay.upstream_fingerprint,
                error=error,
                replay=replay,
            )
            return entry, terminal
        except (ValidationError, InvalidEntry) as e:
            # The stream's end must be recorded whatever the replica sent: its events always can be, as text.
            reason = f"the answer cannot be recorded: {_why(e)}"
            terminal = relay.terminal(reason, client_left=client_left)
            entry = closed_entry(
                served,
                self.clock(),
                status="interrupted",
                events=relay.events,
                terminal=terminal,
                answer=None,
                replica_answer=None,
                upstream_fingerprint=None,
                error=reason,
            )
            return entry, terminal

    def _unconfirmed(self, served: Served, relay: Relay, error: str | None, sent: str | None) -> SealedEntry:
        """The `closed` entry of a stream whose end the store was away for: interrupted, with every event the client
        was sent and, as its terminal, the failure event it got instead of the end (`sent`; None if it had left)."""
        late = "the audit store was away when the stream ended; its end was recorded once the store was back"
        error = late if error is None else f"{error}; {late}"

        def entry(answer: Any, replica_answer: Any, upstream: str | None, error: str) -> SealedEntry:
            return closed_entry(
                served,
                self.clock(),
                status="interrupted",
                events=relay.events,
                terminal=sent,
                answer=answer,
                replica_answer=replica_answer,
                upstream_fingerprint=upstream,
                error=error,
            )

        try:
            return entry(relay.answer(), relay.replica_answer(), relay.upstream_fingerprint, error)
        except (ValidationError, InvalidEntry) as e:
            return entry(None, None, None, f"{error}; the answer cannot be recorded: {_why(e)}")

    async def _dispatch(
        self,
        request: ClientRequest,
        send: Callable[[ReplicaSnapshot, dict[str, Any]], Awaitable[Sent[Reply]]],
    ) -> Dispatched[Sent[Reply]]:
        try:
            return await dispatch(
                self.registry,
                request.pin,
                request.body,
                send,
                endpoint=request.endpoint,
                deadline_s=self.server.retry_deadline_s,
                on_mismatch=self.health.on_mismatch,
            )
        except ReplicaRejected as e:
            if request.endpoint != RESPONSES:
                raise
            # A refusal of the chat request a Responses request became names the client's fields.
            raise ReplicaRejected(e.status, responses_error(e.replica_body)) from e

    @staticmethod
    def _entry(build: Callable[..., SealedEntry], *args: Any, **kwargs: Any) -> SealedEntry:
        """Builds an entry; an answer the audit log cannot hold is the replica's fault, and is not served."""
        try:
            return build(*args, **kwargs)
        except (ValidationError, InvalidEntry) as e:
            raise ReplicaFailed(
                f"the replica's answer cannot be recorded, so it is not served: {_why(e)}"
            ) from e

    def _served(
        self,
        request: ClientRequest,
        tenant: str,
        received_at: datetime,
        dispatched: Dispatched[Sent[Answer]] | Dispatched[Sent[Stream]],
        replaying: Replaying | None,
    ) -> Served:
        record_id = request.record_id or self.record_ids()
        # Every log line from here to the end of this request's task carries the record id.
        structlog.contextvars.bind_contextvars(
            record_id=record_id, replica=dispatched.replica.name, fingerprint=dispatched.replica.fingerprint
        )
        sent = dispatched.result
        translated = sent.endpoint != request.endpoint
        return Served(
            record_id=record_id,
            tenant=tenant,
            endpoint=request.endpoint,
            pin=request.pin,
            route=request.route,
            prompt=request.prompt,
            replica=dispatched.replica,
            forwarded=sent.body,
            received_at=received_at,
            replica_endpoint=sent.endpoint if translated else None,
            translated_from=dispatched.body if translated else None,
            continues=request.continues,
            replay_of=replaying.original.record_id if replaying is not None else None,
            tag=request.tag,
            belongs_to=request.belongs_to,
        )

    def _count_tokens(self, served: Served, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        model = served.replica.stack.model
        total = 0
        for direction, keys in (
            ("prompt", ("prompt_tokens", "input_tokens")),
            ("completion", ("completion_tokens", "output_tokens")),
        ):
            count = next((usage[k] for k in keys if isinstance(usage.get(k), int)), None)
            if count is not None:
                self.metrics.counted_tokens(served.fingerprint, model, direction, count)
                total += count
        self.limiter.charge(served.tenant, total)

    @staticmethod
    def answer_response(served: Served, body: dict[str, Any], receipt: str | None) -> web.Response:
        # orjson writes what json.dumps would mean: the body was recorded, so it has a canonical form (no NaN, no
        # integer past 2**53, string keys), which orjson writes as JSON of the same value.
        headers = {RECORD_HEADER: served.record_id, STACK_HEADER: served.fingerprint}
        if receipt is not None:
            headers[RECEIPT_HEADER] = receipt
        return web.Response(
            body=orjson.dumps(body), content_type="application/json", charset="utf-8", headers=headers
        )


def receipt_comment(receipt: str | None) -> str:
    """A stream's `closed` entry's receipt, sent before the event that ends the stream: as an SSE comment, which
    every SSE reader (the OpenAI SDKs' among them) skips. It is not in the entry's events, which it signs."""
    return "" if receipt is None else f": {RECEIPT_HEADER} {receipt}\n\n"


def _why(error: ValidationError | InvalidEntry) -> str:
    """What an entry that could not be built says is wrong with it."""
    return str(error.errors()[0]["msg"]) if isinstance(error, ValidationError) else str(error)


def _body_fingerprint(body: dict[str, Any]) -> str | None:
    value = body.get("system_fingerprint")
    return value if isinstance(value, str) else None
