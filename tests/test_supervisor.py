"""`stackpin serve --workers N`: several processes serve one port, every answer has its one record in the one
log, and the whole stops as one proxy does.

Real processes: `stackpin serve --workers 2` on a loopback port, a fake replica, an SQLite file or a PostgreSQL
schema. Which worker answered is read from the `Stackpin-Worker` header, and their pids from the supervisor's
`workers_serving` line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.commands.cli import main as stackpin
from tests.support.audit_databases import KINDS, LOG_KEY_ENV, LOG_SIGNER, AuditDatabase, audit_database
from tests.support.fake_replica import FakeReplica

WORKERS = 2
# Bounds that only a hang reaches: a loaded machine takes seconds to start a worker, never minutes.
START_S, STOP_S = 180.0, 120.0
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    process: asyncio.subprocess.Process
    url: str
    pids: list[int]
    log: Path


def config_for(db: AuditDatabase, replica: FakeReplica, folder: Path) -> Path:
    store = f'[store]\nurl = "{db.url}"\n'
    if db.schema is not None:
        # A shared PostgreSQL is migrated beforehand and signs with a key from the environment.
        store += f'postgres_schema = "{db.schema}"\n[log]\nsigning_key_env = "{LOG_KEY_ENV}"\n'
        store += f'public_keys = ["{LOG_SIGNER.verifier.vkey}"]\n'
    path = folder / "stackpin.toml"
    path.write_text(
        store + f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "fake"\nurl = "{replica.url}"\n'
    )
    return path


@asynccontextmanager
async def serving(config: Path, port: int, log: Path) -> AsyncIterator[Served]:
    """`stackpin serve --workers 2`, once every worker serves; killed at the end if a test left it running."""
    env = {**os.environ, LOG_KEY_ENV: LOG_SIGNER.text}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.commands.cli", "serve", "--config", str(config), "--port", str(port),
        "--workers", str(WORKERS), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=log.open("a"), env=env,
    )  # fmt: skip
    try:
        pids = await _serving_pids(process, log)
        yield Served(process, f"http://127.0.0.1:{port}", pids, log)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _serving_pids(process: asyncio.subprocess.Process, log: Path) -> list[int]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_S
    while loop.time() < deadline:
        assert process.returncode is None, log.read_text()
        for line in log.read_text().splitlines():
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "workers_serving":
                return list(event["pids"])
        await asyncio.sleep(0.1)
    pytest.fail("the workers did not start:\n" + log.read_text())


async def send(url: str, i: int) -> tuple[str, str, bool]:
    """One request on a connection of its own; the record id, the worker that answered, whether streamed."""
    stream = i % 3 == 0
    body = {**CHAT, "messages": [{"role": "user", "content": f"request {i}"}], "stream": stream}
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        payload = await response.read()
        if stream:
            assert payload.endswith(b"data: [DONE]\n\n")
        return response.headers["Stackpin-Record"], response.headers["Stackpin-Worker"], stream


async def answered_requests(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "stackpin_requests"
        for sample in family.samples
        if sample.name == "stackpin_requests_total" and sample.labels.get("code") == "200"
    )


async def stopped(process: asyncio.subprocess.Process) -> int:
    process.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(process.wait(), STOP_S)


def gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie that no one reaped yet has exited too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("kind", KINDS)
async def test_two_workers_answer_and_every_answer_has_one_record_in_the_one_log(
    kind: str, replica: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database(kind, tmp_path) as db:
        if db.schema is not None:
            await db.migrate()
        config = config_for(db, replica, tmp_path)
        answered: list[tuple[str, str, bool]] = []
        async with serving(config, free_port(), tmp_path / "serve.log") as served:
            assert len(set(served.pids)) == WORKERS
            # Concurrent requests on fresh connections, until both workers have answered some.
            for round_ in range(40):
                answered += await asyncio.gather(*(send(served.url, 16 * round_ + i) for i in range(16)))
                if len({worker for _, worker, _ in answered}) == WORKERS:
                    break
            assert {worker for _, worker, _ in answered} == {"0", "1"}, "both workers answered"
            assert await answered_requests(served.url) == len(answered), "/metrics counts every worker's"
            assert await stopped(served.process) == 0
        assert all(gone(pid) for pid in served.pids), "SIGTERM stopped every worker"
        store = await db.open(signer=None)
        try:
            for record_id, _, stream in answered:
                record = await store.get_record(record_id, None)
                assert record is not None, f"{record_id} was answered without its record"
                assert [e.part for e in record.entries] == (["opened", "closed"] if stream else ["answer"])
                assert record.status == "complete"
        finally:
            await store.close()
        streams = sum(stream for _, _, stream in answered)
        assert await db.scalar("SELECT count(*) FROM entries") == len(answered) + streams, "one record each"
        assert await db.scalar("SELECT count(DISTINCT record_id) FROM entries") == len(answered)
        assert await asyncio.to_thread(stackpin, ["verify", "--config", str(config)]) == 0


async def test_sigterm_lets_every_worker_finish_its_streams_with_their_records(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.chunk_delay_s = 0.1
    async with audit_database("sqlite", tmp_path) as db:
        config = config_for(db, replica, tmp_path)
        async with serving(config, free_port(), tmp_path / "serve.log") as served:
            async with aiohttp.ClientSession() as session:
                body = {**CHAT, "stream": True}
                async with session.post(f"{served.url}/v1/chat/completions", json=body) as response:
                    record_id = response.headers["Stackpin-Record"]
                    await response.content.readline()
                    served.process.send_signal(signal.SIGTERM)
                    rest = await response.read()
            assert rest.endswith(b"data: [DONE]\n\n"), "the stream in flight ran to its end"
            assert await asyncio.wait_for(served.process.wait(), STOP_S) == 0
        store = await db.open(signer=None)
        try:
            record = await store.get_record(record_id, None)
            assert record is not None and record.status == "complete"
            assert await store.open_streams() == []
        finally:
            await store.close()


async def test_a_worker_that_dies_ends_the_serve_and_the_next_start_marks_its_stream(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.chunk_delay_s = 0.5
    async with audit_database("sqlite", tmp_path) as db:
        config, port, log = config_for(db, replica, tmp_path), free_port(), tmp_path / "serve.log"
        async with serving(config, port, log) as served:
            async with aiohttp.ClientSession() as session:
                body = {**CHAT, "stream": True, "max_tokens": 50}
                async with session.post(f"{served.url}/v1/chat/completions", json=body) as response:
                    record_id = response.headers["Stackpin-Record"]
                    victim = served.pids[int(response.headers["Stackpin-Worker"])]
                    await response.content.readline()
                    os.kill(victim, signal.SIGKILL)
                    with pytest.raises(aiohttp.ClientError):
                        await response.read()
            assert await asyncio.wait_for(served.process.wait(), STOP_S) == 1, "a dead worker fails the serve"
        assert all(gone(pid) for pid in served.pids), "the other worker was stopped too"
        ended = [json.loads(line) for line in log.read_text().splitlines() if '"worker_ended"' in line]
        assert [(e["pid"], e["meaning"]) for e in ended] == [(victim, "killed by SIGKILL")]

        async with serving(config, port, tmp_path / "restart.log") as served:
            assert await stopped(served.process) == 0
        store = await db.open(signer=None)
        try:
            record = await store.get_record(record_id, None)
            assert record is not None and record.status == "interrupted"
            assert record.entries[-1].content["marked_at_start"] is True
        finally:
            await store.close()
        assert await asyncio.to_thread(stackpin, ["verify", "--config", str(config)]) == 0


async def test_workers_stop_when_their_supervisor_is_killed(replica: FakeReplica, tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        config = config_for(db, replica, tmp_path)
        async with serving(config, free_port(), tmp_path / "serve.log") as served:
            served.process.send_signal(signal.SIGKILL)
            await served.process.wait()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STOP_S
            while not all(gone(pid) for pid in served.pids) and loop.time() < deadline:
                await asyncio.sleep(0.1)
        assert all(gone(pid) for pid in served.pids), "no worker outlives its supervisor"
        stops = [line for line in (tmp_path / "serve.log").read_text().splitlines() if '"stopped"' in line]
        assert len(stops) == WORKERS, "each stopped as on SIGTERM"


def children(pid: int) -> dict[int, str]:
    """`pid`'s child processes and their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
    return found


async def test_the_embedded_backend_is_one_process_that_every_worker_serves_from(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text(
        f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path / "audit.db"}"\n'
        f'[local_backend]\nenabled = "on"\nmodel = "{tiny_model}"\n'
    )
    async with serving(config, free_port(), tmp_path / "serve.log") as served:
        backends = [pid for pid, line in children(served.process.pid).items() if "pinned_backend.cli" in line]
        assert len(backends) == 1, "one backend for every worker"
        async with aiohttp.ClientSession() as session, session.get(f"{served.url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        workers: set[str] = set()
        for _ in range(40):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                body = {**CHAT, "model": model, "max_tokens": 2}
                replies = [session.post(f"{served.url}/v1/chat/completions", json=body) for _ in range(8)]
                for response in await asyncio.gather(*replies):
                    assert response.status == 200, await response.text()
                    workers.add(response.headers["Stackpin-Worker"])
                    response.release()
            if len(workers) == WORKERS:
                break
        assert workers == {"0", "1"}
        assert await stopped(served.process) == 0
    assert gone(backends[0]), "the backend stopped with the proxy"


def test_workers_refuse_a_port_in_use_at_once_and_limits_they_cannot_share(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text(
        f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path / "audit.db"}"\n[local_backend]\nenabled = "off"\n'
        f'[[replicas]]\nname = "fake"\nurl = "{replica.url}"\n'
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert stackpin(["serve", "--config", str(config), "--port", str(port), "--workers", "2"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "audit.db").exists(), "refused before anything started"

    config.write_text(
        config.read_text()
        + '[[tenants]]\nname = "acme"\napi_key_sha256 = ["'
        + "ab" * 32
        + '"]\nrequests_per_minute = 60\n'
    )
    assert stackpin(["serve", "--config", str(config), "--port", str(free_port()), "--workers", "2"]) == 2
    assert "redis_url" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_inherited_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("STACKPIN_") and name != "STACKPIN_TEST_POSTGRES_URL":
            monkeypatch.delenv(name)
