"""One worker of `stackpin serve --workers N` (`python -m proxy.process.worker`, started by proxy/process/supervisor.py).

It reads its `WorkerOrders` from stdin and serves the inherited listening socket with a whole application, as a
single proxy does, except for what its supervisor did once for all: the sweep of streams left open, the embedded
backends (reached at the URLs it is given), the log's key. Its metrics go to the supervisor's shared folder, so that
each worker's /metrics answers for all of them, and every response it sends says which worker sent it
(`Stackpin-Worker`, its index). It stops on SIGTERM or SIGINT, or when stdin ends (the supervisor is gone).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.logs import configure_logging
from proxy.metrics import ProxyMetrics
from proxy.process.launch import run_app, serve_on, serving_line
from proxy.process.supervisor import WorkerOrders
from proxy.replicas.local_backend import RunningBackend

WORKER_HEADER = "Stackpin-Worker"


def main() -> int:
    orders: WorkerOrders = pickle.load(sys.stdin.buffer)
    settings = orders.settings
    configure_logging(settings.log_level)
    _say_which_worker_in_logs(orders.index)
    backends = [RunningBackend(name, url) for name, url in orders.backend_urls.items()]
    metrics = ProxyMetrics(CollectorRegistry(), shared_folder=orders.metrics_folder)
    app = create_app(
        settings,
        orders.secrets,
        local_backends=backends,
        shared_metrics=metrics,
        sweep_at_start=False,
    )
    worker = str(orders.index)

    async def say_which_worker(_: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = worker

    app.on_response_prepare.append(say_which_worker)

    def ready() -> None:
        os.write(orders.ready_fd, b"1")
        os.close(orders.ready_fd)

    sock = socket.socket(fileno=orders.listen_fd)
    return serve_on(
        sock,
        run_app(
            app,
            sock,
            settings,
            serving_line(settings, orders.secrets),
            on_serving=ready,
            stop_when=_stdin_ends,
        ),
    )


def _say_which_worker_in_logs(index: int) -> None:
    """Every line this process logs says which worker wrote it (a processor, since every request starts with its
    context variables cleared)."""

    def add_worker(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event["worker"] = index
        return event

    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[add_worker, *processors])


async def _stdin_ends() -> None:
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    await reader.read()


if __name__ == "__main__":
    sys.exit(main())
