"""Where group commits run (proxy/audit/writer.py): several processes appending to one database at once, as
`stackpin serve --workers N` does on one SQLite file and several proxies do on one PostgreSQL, keep one log: every
caller is told its own number, SQLite's numbers have no gap, and the log verifies with every checkpoint signed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

import proxy
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
