"""Running a batch: every line of its input file through the ordinary serving path, `[batches] concurrency` at a
time, each answer a record of the log; then its output and error files, and its own entry naming every line's
record.

A line is done once its answer's record is committed (or it got an error, which has no record); `batch_lines` keeps
it. A batch taken up again after its proxy stopped skips the lines kept there, and finds the lines answered just
before the stop by their records (a line's record id is derived from the batch's id and its place), so no line is
answered twice and none is lost; a line whose replica was called but whose record never committed was never
answered, and is served again. Cancelling stops it taking up lines; the lines done are its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import structlog

from proxy.app_keys import PROXY, REDACTOR
from proxy.audit import AuditStore, DuplicateEntry
from proxy.config import BatchSettings
from proxy.errors import RateLimited, StackpinError
from proxy.serving.prepare import answered, observe, prepared
from proxy.state.batch_lines import DoneLine
from proxy.state.batches import (
    BatchLine,
    batch_entry,
    line_record_id,
    output_contents,
    output_file_id,
    read_lines,
)
from proxy.state.files import StoredFile
from proxy.state.jobs import Job
from proxy.state.runner import Running
from proxy.state.store import StateStore

log = structlog.get_logger("stackpin.batches")


@dataclass(frozen=True)
class BatchKind:
    config: Mapping[Any, Any]  # the application's: the serving path and what reading a request needs
    state: StateStore
    audit: AuditStore
    settings: BatchSettings
    clock: Callable[[], datetime]

    async def run(self, running: Running) -> None:
        job = running.job
        input_file = await self.state.files.get(job.request["input_file_id"], job.tenant)
        content = await self.state.files.content(job.request["input_file_id"], job.tenant)
        if input_file is None or content is None:
            error = {
                "code": "input_file_missing",
                "message": f"the input file {job.request['input_file_id']} is gone",
            }
            await self.state.jobs.finish(job.id, running.owner, "failed", {"error": error}, self.clock())
            return
        lines = read_lines(content, job.request["endpoint"], max_lines=job.request["lines"])
        done = await self.state.lines.done(job.id)
        pending = iter([(i, line) for i, line in enumerate(lines) if i not in done])
        workers = [self._work(job, pending, running) for _ in range(self.settings.concurrency)]
        await asyncio.gather(*workers)
        outcome = "cancelled" if running.cancelled.is_set() else "completed"
        await self._finish(running, input_file, outcome)

    async def _work(self, job: Job, pending: Iterator[tuple[int, BatchLine]], running: Running) -> None:
        for index, line in pending:
            if running.cancelled.is_set():
                return
            answered = await self._recovered(job, index, line) if job.attempts > 1 else None
            await self.state.lines.put(job.id, answered or await self._serve(job, index, line))

    async def _recovered(self, job: Job, index: int, line: BatchLine) -> DoneLine | None:
        """A line answered by a proxy that stopped before it kept it: its record is in the log."""
        record = await self.audit.get_record(line_record_id(job.id, index), job.tenant)
        answer = next((e for e in record.entries if e.part == "answer"), None) if record is not None else None
        if record is None or answer is None:
            return None
        return DoneLine(index, line.custom_id, record.id, 200, answer.content["response"])

    async def _serve(self, job: Job, index: int, line: BatchLine) -> DoneLine:
        proxy, endpoint = self.config[PROXY], job.request["endpoint"]
        record_id = line_record_id(job.id, index)
        belongs_to = {"batch": job.id, "line": index, "custom_id": line.custom_id}
        for attempt in itertools.count():
            try:
                request = await prepared(self.config, job.tenant, endpoint, line.body, None)
                request = replace(
                    request, record_id=record_id, belongs_to={**(request.belongs_to or {}), **belongs_to}
                )
                await proxy.limiter.admit(job.tenant)
                started = asyncio.get_running_loop().time()
                served, body, _receipt = await proxy.complete(request, job.tenant, proxy.clock())
                observe(proxy, endpoint, served, 200, asyncio.get_running_loop().time() - started)
                await answered(self.config, request, served, body)
                return DoneLine(index, line.custom_id, served.record_id, 200, body)
            except (
                RateLimited
            ) as e:  # the tenant's limits hold for its batches too: wait, never fail the line
                log.info("batch_line_waits_for_its_rate_limit", line=index, attempt=attempt)
                await asyncio.sleep(e.retry_after_s)
            except DuplicateEntry:
                recovered = await self._recovered(job, index, line)  # answered meanwhile by another proxy
                if recovered is not None:
                    return recovered
                raise
            except StackpinError as e:
                body = self.config[REDACTOR].value(e.body())
                return DoneLine(index, line.custom_id, None, e.status, body)
        raise AssertionError("unreachable")

    async def _finish(self, running: Running, input_file: StoredFile, outcome: str) -> None:
        """Writes the output and error files, appends the batch's entry, and ends the job."""
        job, now = running.job, self.clock()
        await self.state.jobs.save_detail(
            job.id, running.owner, {**job.detail, "finalizing_at": int(now.timestamp())}
        )
        done = sorted((await self.state.lines.done(job.id)).values(), key=lambda d: d.line)
        answered, failed = output_contents(job.id, done)
        files: list[StoredFile] = []
        detail: dict[str, Any] = {"finalizing_at": int(now.timestamp())}
        for kind, content in (("output", answered), ("error", failed)):
            if content:
                name = f"{job.id}_{kind}.jsonl"
                stored = await self.state.files.put(output_file_id(job.id, kind), job.tenant, "batch_output", name,
                                                    content, now)  # fmt: skip
                files.append(stored)
                detail[f"{kind}_file_id"] = stored.id
        if job.cancel_requested or running.cancelled.is_set():
            detail["cancelling_at"] = int(now.timestamp())
        # Appended already by a proxy that ran it before and stopped before it could end the job: kept as it is.
        with contextlib.suppress(DuplicateEntry):
            await self.audit.append(batch_entry(job, outcome, input_file, files, done, now))
        await self.state.jobs.finish(job.id, running.owner, outcome, detail, self.clock())
        log.info("batch_ended", outcome=outcome, lines=len(done))
