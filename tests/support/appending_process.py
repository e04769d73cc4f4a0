"""One process appending to an audit store, for tests of several processes on one database.

    python -m tests.support.appending_process URL SCHEMA NAME COUNT TASKS GO_FILE     (SCHEMA "-": none)

It opens the store (signing with the test log key, integrating often, so that the processes' integrators race
too), says `ready`, waits for GO_FILE to exist so that every process starts at once, appends COUNT entries named
NAME-0 ... from TASKS concurrent tasks, and prints one JSON object: record id -> the sequence number its commit
returned. Then it closes the store, which integrates what it queued.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.support.audit_databases import LOG_SIGNER, entry


async def main(url: str, schema: str | None, name: str, count: int, tasks: int, go_file: Path) -> None:
    from proxy.audit import AuditStore

    store = await AuditStore.open(
        url, schema=schema, signer=LOG_SIGNER, batch_wait_ms=0.0, checkpoint_interval_s=0.02
    )
    seqs: dict[str, int] = {}
    try:
        print("ready", flush=True)
        while not go_file.exists():
            await asyncio.sleep(0.01)
        names = iter(f"{name}-{i}" for i in range(count))

        async def append_some() -> None:
            for record_id in names:
                seqs[record_id] = (await store.append(entry(record_id))).seq

        await asyncio.gather(*(append_some() for _ in range(tasks)))
    finally:
        await store.close()
    print(json.dumps(seqs), flush=True)


if __name__ == "__main__":
    url, schema, name, count, tasks, go_file = sys.argv[1:]
    asyncio.run(main(url, None if schema == "-" else schema, name, int(count), int(tasks), Path(go_file)))
