"""`stackpin serve --workers N`: N processes serve one port, each a whole proxy, all appending to the one log.

The listening socket is bound once, by `stackpin serve` before anything slow starts, and every worker accepts on
that same socket, inherited. So a port in use is refused at once exactly as for one process; no other process
can join the port, as a same-user process can join an SO_REUSEPORT group; and connections waiting in the backlog
when a worker ends are accepted by the others rather than reset. The kernel wakes every idle worker for a new
connection and the first to accept it serves it, so a worker busy on its event loop takes fewer
(docs/workers.md has the measured split).

What must happen once happens here, before any worker starts: the store's schema on a first run (SQLite), the
log's signing key (made beside an SQLite database on a first run), the sweep of the streams a stopped proxy left
open (proxy/process/sweep.py; a worker never sweeps, since the open streams it would find may be a sibling's, live), the
audit page's session key when none is configured (a cookie one worker sets must open on every other), and the
embedded backend: one process, reached by every worker over HTTP.

A worker is `python -m proxy.process.worker` in a session of its own, given its `WorkerOrders` on stdin, which stays
open: its end tells the worker that this process is gone, and the worker stops as on SIGTERM. SIGTERM or SIGINT
here sends every worker SIGTERM, and each stops as a single proxy does (requests in flight finish, streams close
with their records); then the backend stops, and serve exits 0. A worker that ends unasked (killed, crashed) is
logged with its pid and exit status, the others are stopped the same way, and serve exits 1, so that what runs it
(systemd, Kubernetes) restarts the whole proxy, whose start marks the dead worker's open streams interrupted
(invariant 1). A worker restarted alone could not mark them: its sweep would find its siblings' live streams too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import secrets as random_secrets
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import structlog
from pydantic import SecretStr

from proxy.audit import AuditStore, SchemaError
from proxy.audit.keys import serving_signer
from proxy.config import Secrets, Settings
from proxy.errors import ConfigError
from proxy.process.stopping import Stopping
from proxy.process.sweep import mark_interrupted_streams
from proxy.replicas.local_backend import local_backends_for

log = structlog.get_logger("stackpin.supervisor")
EXIT_OK, EXIT_WORKER_ENDED, EXIT_ERROR = 0, 1, 2
# How prometheus_client is told, before it is imported, to keep a process's metrics in files (proxy/metrics.py).
MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class WorkerOrders:
    """What a worker needs to serve: the settings and secrets (never on a command line, where `ps` shows them),
    the inherited descriptors of the listening socket and of the pipe it says `ready` on, and the shared parts."""

    settings: Settings
    secrets: Secrets
    index: int
    listen_fd: int
    ready_fd: int
    backend_urls: dict[str, str]  # the embedded backends' replica names and URLs
    metrics_folder: Path


def workers_refused(settings: Settings) -> str | None:
    """Why these settings cannot be served by several workers, or None."""
    count = settings.server.workers
    if count == 1 or settings.fleet.redis_url is not None:
        return None
    limited = [t.name for t in settings.tenants if t.requests_per_minute or t.tokens_per_minute]
    if not limited:
        return None
    return (
        f"server.workers is {count} and tenants {limited} have rate limits, which {count} workers keep only with "
        "counters they share: set [fleet] redis_url, or serve with one worker"
    )


def supervise(settings: Settings, secrets: Secrets, sock: socket.socket) -> int:
    """Serves `sock` with `settings.server.workers` workers until SIGTERM or SIGINT; the exit status."""
    try:
        return asyncio.run(_supervise(settings, secrets, sock))
    except (SchemaError, ConfigError) as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR


async def prepare(settings: Settings, secrets: Secrets, now: datetime) -> Secrets:
    """Does what must be done once before any worker serves; the secrets every worker shares."""
    signer = serving_signer(settings, secrets)
    store = await AuditStore.open(
        settings.store.url,
        create_if_empty=settings.store.url.startswith("sqlite"),
        schema=settings.store.postgres_schema,
        durability=settings.store.durability,
    )
    try:
        await mark_interrupted_streams(
            store,
            now,
            fleet=settings.fleet.redis_url is not None,
            replica_timeout_s=settings.server.replica_timeout_s,
        )
    finally:
        await store.close()
    session_key = secrets.ui_session_key or SecretStr(random_secrets.token_hex(32))
    return secrets.model_copy(
        update={"log_signing_key": SecretStr(signer.text), "ui_session_key": session_key}
    )


class Worker:
    """One serving process, as its supervisor sees it."""

    def __init__(self, index: int, process: asyncio.subprocess.Process, ready: asyncio.StreamReader) -> None:
        self.index = index
        self.process = process
        self._ready = ready

    @classmethod
    async def spawn(cls, orders: WorkerOrders, ready_read_fd: int) -> Worker:
        env = {**os.environ, MULTIPROCESS_VARIABLE: str(orders.metrics_folder)}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.process.worker",
            stdin=asyncio.subprocess.PIPE,
            pass_fds=(orders.listen_fd, orders.ready_fd),
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only, which stops the workers
        )
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(orders))
        await process.stdin.drain()
        ready = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(ready), os.fdopen(ready_read_fd, "rb")
        )
        return cls(orders.index, process, ready)

    async def ready(self) -> bool:
        """True once the worker serves; False when it ended first."""
        return bool(await self._ready.read(1))

    def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    async def ended(self) -> int:
        status = await self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        return status


async def _supervise(settings: Settings, secrets: Secrets, sock: socket.socket) -> int:
    stop = Stopping()
    local = local_backends_for(settings)
    folder = Path(tempfile.mkdtemp(prefix="stackpin-metrics-"))
    workers: list[Worker] = []
    try:
        shared = await prepare(settings, secrets, datetime.now(UTC))
        backend_urls = {backend.name: await backend.start() for backend in local}
        stop.serving()
        for index in range(settings.server.workers):
            ready_read, ready_write = os.pipe()
            orders = WorkerOrders(settings, shared, index, sock.fileno(), ready_write, backend_urls, folder)
            try:
                workers.append(await Worker.spawn(orders, ready_read))
            finally:
                os.close(ready_write)
        return await _watch(workers, stop, sock)
    except asyncio.CancelledError:
        log.info("stopped_while_starting")
        return EXIT_OK
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*(worker.ended() for worker in workers))
        for backend in local:
            await backend.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def _watch(workers: list[Worker], stop: asyncio.Event, sock: socket.socket) -> int:
    """Waits for a stop signal or for a worker to end; the exit status."""
    announcing = asyncio.create_task(_announce(workers, sock))
    endings = {asyncio.create_task(worker.ended()): worker for worker in workers}
    stopping = asyncio.create_task(stop.requested.wait())
    try:
        done, _ = await asyncio.wait([stopping, *endings], return_when=asyncio.FIRST_COMPLETED)
    finally:
        announcing.cancel()
        stopping.cancel()
    ended = [endings[t] for t in done if t in endings]
    if ended:
        first = ended[0]
        log.error(
            "worker_ended",
            worker=first.index,
            pid=first.process.pid,
            status=first.process.returncode,
            meaning=_meaning(first.process.returncode),
            then="stopping the other workers; restart the proxy, whose start marks this worker's open streams",
        )
    for worker in workers:
        worker.stop()
    statuses = await asyncio.gather(*endings)
    log.info("stopped", workers=len(workers))
    if ended:
        # A worker that refused to start (its reason is on stderr already) is a configuration error, as for one
        # proxy; any other end of a worker fails the serve.
        return EXIT_ERROR if ended[0].process.returncode == EXIT_ERROR else EXIT_WORKER_ENDED
    # A worker still importing when SIGTERM came ends by it: asked to stop, it did.
    clean = all(status in (0, -signal.SIGTERM) for status in statuses)
    return EXIT_OK if clean else EXIT_WORKER_ENDED


async def _announce(workers: list[Worker], sock: socket.socket) -> None:
    if all(await asyncio.gather(*(worker.ready() for worker in workers))):
        host, port = sock.getsockname()[:2]
        pids = [worker.process.pid for worker in workers]
        log.info("workers_serving", url=f"http://{host}:{port}/v1", workers=len(workers), pids=pids)


def _meaning(status: int | None) -> str:
    if status is None:
        return "still running"
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exited with status {status}"
