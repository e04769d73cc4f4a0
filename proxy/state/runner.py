"""The job runner: each proxy's loop that takes up queued jobs (background responses, batches), runs them, and keeps
their leases while it does (proxy/state/jobs.py says what a lease promises).

It claims jobs while it runs fewer than `[jobs] concurrency`: at once when this proxy queued one (`wake`), else every
`poll_interval_s`, when it also looks for cancels of the jobs it runs. Every third of `lease_s` it renews the leases of the jobs it runs; a job it no longer holds (its
lease ran out while the database was away, and another proxy took it up) is stopped here. A job taken up more than `max_attempts` times is finished as failed rather than run
again. At a graceful stop the jobs running here are stopped and their leases let go at once, so another proxy (or
the next start) takes them up without waiting for them to run out. What a job does is its kind's (`JobKind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import structlog

from proxy.audit import AuditError
from proxy.config import JobsSettings
from proxy.state.jobs import Job, Jobs

log = structlog.get_logger("stackpin.jobs")


@dataclass
class Running:
    """A job as its kind runs it: `cancelled` is set once its client asked to cancel it."""

    job: Job
    owner: str
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class JobKind(Protocol):
    async def run(self, running: Running) -> None:
        """Runs the job and finishes it (Jobs.finish) with its outcome; returns early once `cancelled` is set.
        Raising leaves it to the runner: an audit store that is away leaves the job to be taken up again."""
        ...


class JobRunner:
    def __init__(
        self,
        jobs: Jobs,
        kinds: Mapping[str, JobKind],
        settings: JobsSettings,
        clock: Callable[[], datetime],
    ) -> None:
        self.jobs = jobs
        self.kinds = kinds
        self.settings = settings
        self.clock = clock
        self.owner = "proxy-" + secrets.token_hex(8)
        self._running: dict[str, tuple[Running, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A job was queued here: look for it now rather than at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        renewing = asyncio.create_task(self._renew_forever(), name="job-leases")
        try:
            while True:
                self._wake.clear()
                try:
                    await self._claim_what_fits()
                    if self._running:
                        for job_id in await self.jobs.cancels(self.owner):
                            self.cancel(job_id)
                except AuditError as e:
                    log.warning("jobs_unreachable", error=str(e))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval_s)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing

    def cancel(self, job_id: str) -> None:
        """Tells a job running here that its client asked to cancel it (others' runners see it when they poll)."""
        entry = self._running.get(job_id)
        if entry is not None:
            entry[0].cancelled.set()

    async def _claim_what_fits(self) -> None:
        while len(self._running) < self.settings.concurrency:
            job = await self.jobs.claim(self.owner, self.clock(), self.settings.lease_s)
            if job is None:
                return
            if job.attempts > self.settings.max_attempts:
                error = {"code": "job_abandoned", "message": f"taken up {job.attempts - 1} times and never "
                         "finished: the proxies that ran it stopped while they did"}  # fmt: skip
                await self.jobs.finish(
                    job.id, self.owner, "failed", {**job.detail, "error": error}, self.clock()
                )
                log.error("job_abandoned", job=job.id, attempts=job.attempts - 1)
                continue
            running = Running(job, self.owner)
            if job.cancel_requested:  # asked of the proxy that ran it before and stopped
                running.cancelled.set()
            task = asyncio.create_task(self._run(running), name=f"job-{job.id}")
            self._running[job.id] = (running, task)

    async def _run(self, running: Running) -> None:
        job = running.job
        structlog.contextvars.bind_contextvars(job=job.id)
        log.info("job_started", kind=job.kind, attempt=job.attempts)
        try:
            await self.kinds[job.kind].run(running)
            log.info("job_ended")
        except asyncio.CancelledError:
            log.info("job_stopped_here")
        except AuditError as e:
            log.warning("job_left_for_later", error=str(e))  # the lease runs out; it is taken up again
        except Exception:
            log.exception("job_failed")
            error = {"code": "job_failed", "message": "the proxy failed running it; the error is in its log"}
            with contextlib.suppress(AuditError):
                await self.jobs.finish(
                    job.id, self.owner, "failed", {**job.detail, "error": error}, self.clock()
                )
        finally:
            self._running.pop(job.id, None)
            self._wake.set()  # room for another

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_s / 3)
            try:
                await self.renew()
            except AuditError as e:
                log.warning("job_leases_not_renewed", error=str(e))

    async def renew(self) -> None:
        """Renews the leases held here; stops the jobs no longer held, and tells those asked to cancel."""
        ids = list(self._running)
        held = await self.jobs.renew(self.owner, ids, self.clock(), self.settings.lease_s)
        for job_id in ids:
            entry = self._running.get(job_id)
            if entry is None:
                continue
            running, task = entry
            if job_id not in held:
                log.warning("job_lease_lost", job=job_id)
                task.cancel()
            elif held[job_id]:
                running.cancelled.set()

    async def stop(self) -> None:
        """Stops the jobs running here and lets their leases go, so that they are taken up again at once."""
        tasks = [task for _, task in self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(AuditError):
            await self.jobs.release(self.owner)
