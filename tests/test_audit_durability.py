"""Durability: "disk" (the default) syncs every commit to disk; "process" only commits, which survives the
proxy's crash but not the machine's. Both keep one intact log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.audit_databases import KINDS, audit_database, entry


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("durability", ["disk", "process"])
async def test_both_durabilities_append_one_intact_log(kind: str, durability: str, tmp_path: Path) -> None:
    async with audit_database(kind, tmp_path) as database:
        await database.migrate()
        store = await database.open(durability=durability)
        try:
            for i in range(5):
                await store.append(entry(f"rec_{i}", seconds=i))
            await store.integrate()
            report = await store.verify()
            assert report.ok and report.entries_checked == 5 and report.pending == 0
            setting = await store._committer._writer.scalar(  # the writer's own connection
                "PRAGMA synchronous" if kind == "sqlite" else "SHOW synchronous_commit"
            )
        finally:
            await store.close()
    expected = {
        ("sqlite", "disk"): 2,
        ("sqlite", "process"): 1,
        ("postgres", "disk"): "on",
        ("postgres", "process"): "off",
    }
    assert setting == expected[(kind, durability)]
