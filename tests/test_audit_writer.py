"""Where group commits run (proxy/audit/writer.py): several processes appending to one database at once, as
`stackpin serve --workers N` does on one SQLite file and several proxies do on one PostgreSQL, keep one log: every
caller is told its own number, SQLite's numbers have no gap, and the log verifies with every checkpoint signed.
The SQLite writer's one thread runs what it is handed in order and settles each caller alone."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import proxy
from proxy.audit.errors import StoreClosed
from proxy.audit.writer import WriterThread
from tests.support.audit_databases import KINDS, LOG_SIGNER, audit_database

TREE = Path(proxy.__file__).resolve().parent.parent
PROCESSES = 3
APPENDS = 60
TASKS = 8
# Only a hang reaches these: a busy machine makes processes slow, never this slow.
START_TIMEOUT_S = 120
RUN_TIMEOUT_S = 300


@pytest.mark.parametrize("kind", KINDS)
async def test_several_processes_appending_to_one_database_keep_one_log(kind: str, tmp_path: Path) -> None:
    async with audit_database(kind, tmp_path) as database:
        await database.migrate()
        go_file = tmp_path / "go"
        environment = {**os.environ, "PYTHONPATH": str(TREE)}
        processes = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.support.appending_process",
                database.url,
                database.schema or "-",
                f"p{n}",
                str(APPENDS),
                str(TASKS),
                str(go_file),
                cwd=str(TREE),
                env=environment,
                stdout=asyncio.subprocess.PIPE,
            )
            for n in range(PROCESSES)
        ]
        try:
            for process in processes:
                assert process.stdout is not None
                line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
                assert line.strip() == b"ready", line
            go_file.touch()
            outputs = await asyncio.wait_for(
                asyncio.gather(*(process.communicate() for process in processes)), RUN_TIMEOUT_S
            )
        finally:
            for process in processes:
                if process.returncode is None:
                    process.kill()
        assert [process.returncode for process in processes] == [0] * PROCESSES
        told: dict[str, int] = {}
        for out, _ in outputs:
            told.update(json.loads(out.decode().strip().splitlines()[-1]))
        total = PROCESSES * APPENDS
        assert len(told) == total and len(set(told.values())) == total, "no number given twice"
        if kind == "sqlite":
            assert sorted(told.values()) == list(range(1, total + 1)), "one writer at a time: no gap"

        store = await database.open(checkpoint_interval_s=3600)
        try:
            await store.integrate()
            report = await store.verify(verifiers=[LOG_SIGNER.verifier])
            for record_id, seq in told.items():
                record = await store.get_record(record_id, None)
                assert record is not None and record.entries[0].seq == seq, (
                    "each caller was told its own number"
                )
        finally:
            await store.close()
        assert report.ok, report.problem
        assert report.entries_checked == total and report.pending == 0
        assert report.signatures_checked and report.checkpoints_checked >= 1
        assert await database.scalar("SELECT count(*) FROM log_queue") == 0


# The writer's thread: every SQLite batch and round crosses it.


async def test_the_writer_thread_runs_calls_in_order_on_one_thread_and_returns_their_results() -> None:
    thread = WriterThread("test-writer")
    ran: list[tuple[int, str]] = []

    def work(i: int) -> int:
        ran.append((i, threading.current_thread().name))
        return i * i

    try:
        results = await asyncio.gather(*(thread.call(functools.partial(work, i)) for i in range(50)))
    finally:
        await thread.stop()
    assert results == [i * i for i in range(50)]
    assert [i for i, _ in ran] == list(range(50)), "in the order they were handed over"
    assert {name for _, name in ran} == {"test-writer"}


async def test_a_call_that_raises_fails_its_caller_only_and_the_thread_goes_on() -> None:
    thread = WriterThread("test-writer")

    def refuse() -> None:
        raise sqlite3.IntegrityError("UNIQUE constraint failed")

    try:
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
            await thread.call(refuse)
        assert await thread.call(lambda: "still serving") == "still serving"
    finally:
        await thread.stop()


async def test_a_caller_that_gives_up_leaves_its_call_to_finish_and_the_next_one_served() -> None:
    thread = WriterThread("test-writer")
    release = threading.Event()
    finished = threading.Event()
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))

    def slow() -> None:
        release.wait(timeout=30)
        finished.set()

    try:
        waiting = asyncio.ensure_future(thread.call(slow))
        await asyncio.sleep(0.01)
        waiting.cancel()
        release.set()
        assert await thread.call(lambda: 7) == 7
        assert finished.is_set(), "a call once handed over runs to its end"
    finally:
        await thread.stop()
    assert loop_errors == [], "settling a future nobody waits for any more is not an error"


async def test_stopping_lets_every_call_handed_over_finish_first() -> None:
    thread = WriterThread("test-writer")
    done: list[int] = []
    pending = [asyncio.ensure_future(thread.call(functools.partial(done.append, i))) for i in range(20)]
    await asyncio.sleep(0)  # each call is handed over when its task first runs
    await thread.stop()
    await asyncio.gather(*pending)
    assert done == list(range(20))


async def test_a_call_after_stopping_is_refused_rather_than_left_waiting() -> None:
    thread = WriterThread("test-writer")
    await thread.stop()
    with pytest.raises(StoreClosed, match="stopped"):
        await asyncio.wait_for(thread.call(lambda: 1), timeout=5)
    await thread.stop()  # stopping again is harmless
