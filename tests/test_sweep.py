"""Streams that a proxy opened and never closed, because it was killed, are closed as interrupted at the next
start, by an appended entry, and `stackpin verify` counts them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from proxy.audit import AuditStore
from proxy.commands.cli import main as stackpin
from proxy.process.sweep import mark_interrupted_streams
from tests.support.audit_databases import T0, entry
from tests.support.fake_replica import FakeReplica

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_proxy(config: Path, port: int, log: Path) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.commands.cli", "serve", "--config", str(config), "--port", str(port),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log.open("a"),
    )  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            assert process.returncode is None, log.read_text()
            try:
                async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                    if response.status == 200:
                        return process
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    process.kill()
    pytest.fail("the proxy did not become ready:\n" + log.read_text())


async def test_a_stream_cut_by_kill_9_is_marked_interrupted_at_the_next_start(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replica.chunk_delay_s = 0.2
    db = tmp_path / "audit.db"
    config = tmp_path / "stackpin.toml"
    config.write_text(
        f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n[local_backend]\nenabled = "off"\n'
        f'[[replicas]]\nname = "fake"\nurl = "{replica.url}"\n'
    )
    port, log = free_port(), tmp_path / "serve.log"
    proxy = await start_proxy(config, port, log)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "stream": True}
            ) as response,
        ):
            record_id = response.headers["Stackpin-Record"]
            await response.content.readline()
            proxy.send_signal(signal.SIGKILL)
            await proxy.wait()
    finally:
        if proxy.returncode is None:
            proxy.kill()
            await proxy.wait()
    store = await AuditStore.open(f"sqlite+aiosqlite:///{db}")
    try:
        assert [s.record_id for s in await store.open_streams()] == [record_id], "kill -9 left it open"
    finally:
        await store.close()

    proxy = await start_proxy(config, port, log)
    proxy.send_signal(signal.SIGTERM)
    assert await proxy.wait() == 0

    store = await AuditStore.open(f"sqlite+aiosqlite:///{db}")
    try:
        record = await store.get_record(record_id, None)
    finally:
        await store.close()
    assert record is not None and [e.part for e in record.entries] == ["opened", "closed"]
    assert record.status == "interrupted" and record.entries[1].content["marked_at_start"] is True
    assert await asyncio.to_thread(stackpin, ["verify", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "streams: 1 marked interrupted at a proxy's start" in out and "0 open now" in out


async def test_in_fleet_mode_only_streams_older_than_any_stream_lasts_are_marked(tmp_path: Path) -> None:
    store = await AuditStore.open(f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}", create_if_empty=True)
    try:
        await store.append(entry("rec_old", part="opened", status="streaming"))
        await store.append(entry("rec_recent", part="opened", status="streaming", seconds=600))
        await store.append(entry("rec_done", part="opened", status="streaming"))
        await store.append(entry("rec_done", part="closed"))
        now = T0 + timedelta(seconds=650)
        assert await mark_interrupted_streams(store, now, fleet=True, replica_timeout_s=300) == 1
        assert [s.record_id for s in await store.open_streams()] == ["rec_recent"]
        assert await mark_interrupted_streams(store, now, fleet=False, replica_timeout_s=300) == 1
        assert await mark_interrupted_streams(store, now, fleet=False, replica_timeout_s=300) == 0
        counts = await store.stream_counts()
        assert (counts.marked_at_start, counts.open) == (2, 0)
        record = await store.get_record("rec_old", None)
        assert record is not None and record.status == "interrupted"
        assert [e.part for e in record.entries] == ["opened", "closed"], "appended, never an edit"
        assert (await store.verify()).ok
    finally:
        await store.close()


@pytest.fixture(autouse=True)
def _no_inherited_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("STACKPIN_"):
            monkeypatch.delenv(name)
