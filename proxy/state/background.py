"""Background responses: `POST /v1/responses` with `background: true` answers at once with the response `queued`,
and any proxy of the fleet runs it as a job (proxy/state/runner.py) through the ordinary serving path, under the
response's own record id, so that its record is its stored copy like any other response's.

A streamed one keeps every event it sends (proxy/state/job_events.py): the client that queued it, and any client
later (`GET /v1/responses/{id}?stream=true&starting_after=N`, on any proxy), reads them as they come and from where
it left off. Until its record is complete, `GET` shows the job's state (`queued`, `in_progress`, `cancelled`,
`failed`); `POST /v1/responses/{id}/cancel` cancels it (at once while queued; a running one stops at the runner's
next look, its stream recorded as interrupted). A proxy killed mid-way leaves it to another once its lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from aiohttp import web

from proxy.app_keys import JOBS, PROXY, STATE, STORE
from proxy.endpoints import RESPONSES, TERMINAL_EVENTS
from proxy.errors import BadRequest, StackpinError
from proxy.serving.prepare import answered, observe, prepared
from proxy.serving.responses_api import Echo, record_of, response_id
from proxy.serving.serve import RECORD_HEADER
from proxy.state.job_events import EventSink
from proxy.state.jobs import Job
from proxy.state.runner import Running
from proxy.state.store import StateStore

FOLLOW_POLL_S = 0.05


def background_body(body: dict[str, Any]) -> dict[str, Any]:
    """What runs in the background: the request without `background`, which no replica is asked for."""
    if body.get("store") is False:
        raise BadRequest("a background response is stored; leave 'store' out or set it true", param="store")
    return {k: v for k, v in body.items() if k != "background"}


def job_view(job: Job) -> dict[str, Any]:
    """The response as its job shows it before its record does: queued, in progress, cancelled or failed."""
    body = job.request["body"]
    echo = Echo(job.id, int(job.created_at.timestamp()), body, body.get("previous_response_id"))
    status = {"queued": "queued", "running": "in_progress"}.get(job.state) or job.outcome or "failed"
    view = {
        **echo.skeleton(body.get("model"), "cancelled" if job.cancel_requested else status),
        "background": True,
    }
    if job.outcome == "failed":
        view["error"] = job.detail.get("error")
    return view


async def queue(config: Mapping[Any, Any], tenant: str, body: dict[str, Any], pin_header: str | None) -> Job:
    """Checks the request as the serving path will read it (a 400 now, not a failed job later), and queues it."""
    run = background_body(body)
    await prepared(config, tenant, RESPONSES, run, pin_header)
    job_id = response_id(config[PROXY].record_ids())
    request = {"body": run, "pin_header": pin_header}
    job = await config[STATE].jobs.create(job_id, "response", tenant, request, config[PROXY].clock())
    config[JOBS].wake()
    return job


async def queued_response(
    http: web.Request, tenant: str, body: dict[str, Any], pin_header: str | None
) -> web.StreamResponse:
    """`POST /v1/responses` with `background: true`: the queued response, or its stream followed from the start."""
    job = await queue(http.app, tenant, body, pin_header)
    headers = {RECORD_HEADER: record_of(job.id)}
    if body.get("stream"):
        return await follow(http, http.app[STATE], job, -1, headers)
    return web.json_response(job_view(job), headers=headers)


async def follow(
    http: web.Request, state: StateStore, job: Job, after: int, headers: dict[str, str]
) -> web.StreamResponse:
    """A background stream's events after sequence number `after`, as they are kept, until its end."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await response.prepare(http)
    with contextlib.suppress(ConnectionResetError):  # a reader that leaves stops nothing: the job runs on
        async for text in _events(state, job.id, after):
            await response.write(text.encode())
        await response.write_eof()
    return response


async def _events(state: StateStore, job_id: str, after: int) -> AsyncIterator[str]:
    """The job's kept events after `after`, waiting for more until its end event, or until the job has ended and
    no more came (then an error event in place of the end it never sent)."""
    while True:
        events = await state.events.after(job_id, after)
        for n, text in events:
            yield text
            if _terminal(text):
                return
            after = n
        if events:
            continue
        current = await state.jobs.get(job_id, None)
        ended = current is None or current.state == "finished"
        if ended and not await state.events.after(job_id, after):  # nothing came between the two reads
            if current is not None:
                yield _failure(current, after)
            return
        await asyncio.sleep(FOLLOW_POLL_S)


def _terminal(text: str) -> bool:
    # The terminal write may start with SSE comments (the closed entry's receipt, `: Stackpin-Receipt ...`).
    while text.startswith(":"):
        text = text.partition("\n\n")[2]
    return any(text.startswith(f"event: {name}\n") for name in TERMINAL_EVENTS)


def _failure(job: Job, after: int) -> str:
    """The event that ends a background stream that ended without its own end (failed before it began, or
    cancelled)."""
    error = job.detail.get("error") or {
        "code": job.outcome or "failed",
        "message": f"the response was {job.outcome}",
    }
    event = {"type": "error", "sequence_number": after + 1, "code": error.get("code"), "message": error.get("message"),
             "param": None}  # fmt: skip
    return f"event: error\ndata: {json.dumps(event)}\n\n"


@dataclass(frozen=True)
class BackgroundKind:
    """Runs a background response as its client would have been served, under the response's own record id."""

    config: Mapping[Any, Any]
    state: StateStore
    clock: Callable[[], datetime]

    async def run(self, running: Running) -> None:
        job, proxy = running.job, self.config[PROXY]
        body = job.request["body"]
        if job.attempts > 1 and await self._settled(running):
            return
        try:
            request = await prepared(self.config, job.tenant, RESPONSES, body, job.request.get("pin_header"))
            request = replace(
                request,
                record_id=record_of(job.id),
                belongs_to={**(request.belongs_to or {}), "background": True},
            )
            await proxy.limiter.admit(job.tenant)
        except StackpinError as e:
            await self._fail(running, e)
            return
        started = time.perf_counter()
        if request.stream:
            sink = EventSink(self.state.events, job.id)
            work = asyncio.ensure_future(proxy.stream(request, job.tenant, proxy.clock(), sink))
        else:
            work = asyncio.ensure_future(proxy.complete(request, job.tenant, proxy.clock()))
        stopping = asyncio.ensure_future(running.cancelled.wait())
        try:
            await asyncio.wait([work, stopping], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # this proxy stops, or lost the job's lease: the work stops with it
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise
        finally:
            stopping.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await self.state.jobs.finish(job.id, running.owner, "cancelled", {}, self.clock())
            return
        try:
            served, result = work.result()[:2]  # a non-streamed answer comes with its receipt too
        except StackpinError as e:
            await self._fail(running, e)
            return
        observe(proxy, RESPONSES, served, 200, time.perf_counter() - started)
        if not request.stream or result == "complete":
            await answered(self.config, request, served, None if request.stream else result)
        outcome = "completed" if not request.stream or result == "complete" else "failed"
        detail = (
            {}
            if outcome == "completed"
            else {"error": {"code": "stream_" + str(result), "message": f"the stream ended {result}"}}
        )
        await self.state.jobs.finish(job.id, running.owner, outcome, detail, self.clock())

    async def _settled(self, running: Running) -> bool:
        """Taken up again: whether the proxy that ran it before got as far as its record, and the job is ended
        by what the record says (a stream it left open is not run again: its client read part of it)."""
        job = running.job
        record = await self.config[STORE].get_record(record_of(job.id), job.tenant)
        if record is None:
            return False
        if record.status == "complete":
            await self.state.jobs.finish(job.id, running.owner, "completed", {}, self.clock())
            return True
        message = f"the proxy running it stopped mid-way; its record {record.id} holds what it sent"
        await self.state.jobs.finish(job.id, running.owner, "failed", {"error": {"code": "interrupted",
                                     "message": message}}, self.clock())  # fmt: skip
        return True

    async def _fail(self, running: Running, error: StackpinError) -> None:
        detail = {"error": {"code": error.code, "message": error.message}}
        await self.state.jobs.finish(running.job.id, running.owner, "failed", detail, self.clock())
