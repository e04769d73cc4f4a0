"""A batch survives the proxy that runs it: killed (kill -9) mid-batch and started again, or killed in a fleet of
two on PostgreSQL, the batch is finished with every line answered once, none lost, none answered twice; and
`stackpin replay --batch` replays it whole and reports its agreement.

Real `stackpin serve` processes on loopback, a fake replica that takes a while per answer, leases of a second."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.audit import AuditStore
from proxy.commands.cli import main as stackpin
from proxy.state.batches import batch_record_id, line_record_id
from tests.support.audit_databases import LOG_KEY_ENV, LOG_SIGNER, audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.fleet import Processes, free_port, wait_ready

LINES = 24
CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "temperature": 0,
}
FAST = '[jobs]\nlease_s = 1\npoll_interval_s = 0.1\n[batches]\nconcurrency = 2\n[local_backend]\nenabled = "off"\n'


def config_for(folder: Path, store_url: str, replica: FakeReplica, port: int) -> Path:
    path = folder / f"proxy-{port}.toml"
    path.write_text(
        f'log_level = "warning"\n[server]\nport = {port}\n[store]\nurl = "{store_url}"\n{FAST}'
        f'[[replicas]]\nname = "fake"\nurl = "{replica.url}"\n'
    )
    return path


async def start(processes: Processes, config: Path, port: int) -> tuple[asyncio.subprocess.Process, str]:
    started = len(processes.running)
    process = await processes.start("serve", "--config", str(config), log_name=f"proxy-{port}-{started}")
    url = f"http://127.0.0.1:{port}"
    # Only this process's readiness: one killed before it is not the point.
    await wait_ready([url], Processes(processes.folder, processes.env, processes.running[started:]))
    return process, url


async def create_batch(url: str) -> tuple[openai.AsyncOpenAI, str]:
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0)
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {**CHAT, "messages": [{"role": "user", "content": f"line {i}"}]}}
        for i in range(LINES)
    ]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return sdk, batch.id


async def until(sdk: openai.AsyncOpenAI, batch_id: str, done: int | None, timeout_s: float = 60.0) -> Any:
    """The batch once `done` lines are answered, or (None) once it has ended."""
    async with asyncio.timeout(timeout_s):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled"):
                return batch
            if done is not None and batch.request_counts.completed >= done:  # type: ignore[union-attr]
                return batch
            await asyncio.sleep(0.05)


async def kill(process: asyncio.subprocess.Process) -> None:
    process.send_signal(signal.SIGKILL)
    await process.wait()


async def check_every_line_once(
    sdk: openai.AsyncOpenAI, batch_id: str, store: AuditStore, replica: FakeReplica
) -> None:
    batch = await until(sdk, batch_id, None)
    assert batch.status == "completed" and batch.request_counts.completed == LINES  # type: ignore[union-attr]
    output = [json.loads(line) for line in (await sdk.files.content(batch.output_file_id)).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"c{i}" for i in range(LINES)), "none lost"
    records = [line["response"]["request_id"] for line in output]
    assert records == [line_record_id(batch_id, i) for i in range(LINES)], "each line's one record, in order"
    for record_id in records:
        record = await store.get_record(record_id, "local")
        assert record is not None and [e.part for e in record.entries] == ["answer"]
    own = await store.get_record(batch_record_id(batch_id), "local")
    assert own is not None and [line["record"] for line in own.entries[0].content["lines"]] == records
    assert (
        len(replica.requests) >= LINES
    )  # a line in flight at the kill may have been sent twice, never answered twice


async def test_a_proxy_killed_mid_batch_and_started_again_finishes_it_and_replay_batch_reports_it(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replica.answer_delay_s = 0.1
    db = tmp_path / "audit.db"
    url = f"sqlite+aiosqlite:///{db}"
    port = free_port()
    config = config_for(tmp_path, url, replica, port)
    processes = Processes(tmp_path, dict(os.environ))
    try:
        process, base = await start(processes, config, port)
        sdk, batch_id = await create_batch(base)
        await until(sdk, batch_id, 6)
        await kill(process)
        process, base = await start(processes, config, port)
        store = await AuditStore.open(url)
        try:
            await check_every_line_once(sdk, batch_id, store, replica)
        finally:
            await store.close()
        replica.answer_delay_s = 0

        def replay(batch: str) -> int:
            return stackpin(["replay", "--batch", batch, "--url", base, "--config", str(config)])

        assert await asyncio.to_thread(replay, batch_id) == 0
        assert f"{LINES} answered lines replayed, {LINES} identical, 0 diverged" in capsys.readouterr().out
        replica.diverge_from = 1
        assert await asyncio.to_thread(replay, batch_id) == 1
        assert f"0 identical, {LINES} diverged" in capsys.readouterr().out
        assert await asyncio.to_thread(replay, "batch_" + "0" * 32) == 2
        assert "no batch" in capsys.readouterr().err
    finally:
        await processes.stop_all()


@pytest.mark.postgres
async def test_in_a_fleet_on_postgres_another_proxy_finishes_the_batch_of_a_proxy_killed_mid_way(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.answer_delay_s = 0.1
    async with audit_database("postgres", tmp_path) as db:
        await db.migrate()
        env = {**os.environ, "STACKPIN_STORE__POSTGRES_SCHEMA": db.schema or "", "STACKPIN_LOG__SIGNING_KEY_ENV": LOG_KEY_ENV,
               LOG_KEY_ENV: LOG_SIGNER.text}  # fmt: skip
        processes = Processes(tmp_path, env)
        try:
            first_port, second_port = free_port(), free_port()
            first, first_url = await start(
                processes, config_for(tmp_path, db.url, replica, first_port), first_port
            )
            sdk, batch_id = await create_batch(first_url)  # the only proxy running: it takes the batch up
            await until(sdk, batch_id, 6)
            _, second_url = await start(
                processes, config_for(tmp_path, db.url, replica, second_port), second_port
            )
            await kill(first)
            other = openai.AsyncOpenAI(
                base_url=f"{second_url}/v1", api_key="unused-on-loopback", max_retries=0
            )
            store = await AuditStore.open(db.url, schema=db.schema)
            try:
                await check_every_line_once(other, batch_id, store, replica)
            finally:
                await store.close()
        finally:
            await processes.stop_all()
