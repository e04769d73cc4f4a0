"""The listener bounds what a connection may hold: a body must arrive in time, a silent connection is closed,
and past the connection cap the probes are still answered, even when file descriptors run short."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

CHAT = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def port_of(harness: Harness) -> int:
    return int(harness.url.rsplit(":", 1)[1])


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of one response on a connection the server closes after it."""
    raw = await reader.read()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, server={"body_timeout_s": 0.5}) as harness:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(harness))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + CHAT[:10]
        )
        async with asyncio.timeout(15):
            status, body = await read_response(reader)
        writer.close()
        assert status == 408
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "server.body_timeout_s" in error["message"]
        assert not replica.requests


async def test_a_connection_that_sends_no_whole_request_is_closed_after_the_idle_timeout(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, server={"idle_timeout_s": 0.5}) as harness:
        silent = await asyncio.open_connection("127.0.0.1", port_of(harness))
        half = await asyncio.open_connection("127.0.0.1", port_of(harness))
        half[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        async with asyncio.timeout(15):
            assert await silent[0].read() == b"", "closed by the proxy"
            assert await half[0].read() == b""
        for _, writer in (silent, half):
            writer.close()


@contextlib.asynccontextmanager
async def connections(port: int, count: int, first_bytes: bytes = b"") -> AsyncIterator[None]:
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
    for _, writer in opened:
        if first_bytes:
            writer.write(first_bytes)
    await asyncio.sleep(0.2)
    try:
        yield
    finally:
        for _, writer in opened:
            writer.close()
        await asyncio.sleep(0.2)  # for the proxy to see them go


async def get(url: str, body: bytes | None = None) -> tuple[int, dict[str, object], dict[str, str]]:
    async with aiohttp.ClientSession() as session:
        method = session.post if body is not None else session.get
        async with method(url, data=body) as response:
            return response.status, await response.json(content_type=None), dict(response.headers)


async def test_at_the_connection_cap_silent_connections_make_room_and_probes_are_answered(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, server={"max_connections": 8}) as harness:
        async with connections(port_of(harness), 20):
            status, _, _ = await get(f"{harness.v1}/chat/completions", CHAT)
            assert status == 200, "a silent connection made room for a working one"
        # Eight connections in the middle of a request each: nothing can make room.
        async with connections(port_of(harness), 8, b"POST /v1/chat/completions HTTP/1.1\r\n"):
            status, _, _ = await get(f"{harness.url}/healthz")
            assert status == 200, "the probes are answered past the cap"
            status, body, headers = await get(f"{harness.v1}/chat/completions", CHAT)
            assert status == 503 and headers["Retry-After"] == "1"
            assert body["error"]["code"] == "too_many_connections"  # type: ignore[index]
        status, _, _ = await get(f"{harness.v1}/chat/completions", CHAT)
        assert status == 200


def _few_file_descriptors() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


async def test_idle_sockets_beyond_the_file_descriptor_limit_leave_the_proxy_answering(
    tmp_path: Path,
) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text(
        f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path / "audit.db"}"\n[local_backend]\nenabled = "off"\n'
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy.commands.cli", "serve", "--config", str(config), "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_few_file_descriptors,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                if (await get(f"{url}/healthz"))[0] == 200:
                    break
            await asyncio.sleep(0.1)
        async with connections(port, 400):
            for _ in range(3):
                async with asyncio.timeout(5):
                    status, _, _ = await get(f"{url}/healthz")
                assert status == 200
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)


@pytest.fixture(autouse=True)
def _no_inherited_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STACKPIN_SERVER__PORT", raising=False)
