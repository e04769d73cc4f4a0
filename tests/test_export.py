"""`stackpin export` (proxy/audit/export.py, proxy/commands/export.py): the entries of a time window, each with what
an auditor's own tools need to check it against a signed checkpoint without stackpin, as JSON lines or Parquet,
page by page."""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from proxy.audit import AuditStore
from proxy.audit.entries import payload_sha256
from proxy.audit.erasure import Policy
from proxy.audit.export import Window
from proxy.audit.merkle import leaf_hash, verify_inclusion
from proxy.audit.note import open_checkpoint
from proxy.commands.cli import main as stackpin
from tests.support.audit_databases import KINDS, LOG_SIGNER, T0, AuditDatabase, audit_database, entry
from tests.test_audit_erasure import paid


async def _log(database: AuditDatabase) -> AuditStore:
    """Entries a second apart (r0 to r5, r3 of another tenant, r1 erased, r4 written before payloads were kept
    apart), integrated, then r6, which the checkpoint does not hold: the store returned holds no key."""
    store = await database.open(checkpoint_interval_s=3600)
    try:
        for i in range(6):
            tenant = "beta" if i == 3 else "acme"
            await store.append(entry("r4", seconds=4) if i == 4 else paid(f"r{i}", seconds=i, tenant=tenant))
        await store.erase("r1", Policy("request", "asked"), T0 + timedelta(seconds=10))
        await store.integrate()
    finally:
        await store.close()
    keyless = await database.open(signer=None)
    await keyless.append(paid("r6", seconds=6))
    return keyless


def _checked(row: dict[str, Any], root: bytes) -> str:
    """What an auditor's tool finds of one exported entry, with nothing but the row and the checkpoint."""
    leaf = leaf_hash(row["entry"].encode())
    assert base64.b64encode(leaf).decode() == row["leaf_hash"]
    if row["proof"] is None:
        return "pending"
    verify_inclusion(
        row["leaf_index"], row["tree_size"], leaf, [base64.b64decode(h) for h in row["proof"]], root
    )
    committed = json.loads(row["entry"]).get("payload_sha256")
    if committed is None:
        return "proven"
    if row["payload_erased"]:
        return "proven, erased"
    assert payload_sha256(bytes.fromhex(row["salt"]), row["payload"]) == committed
    return "proven, payload"


async def test_an_export_holds_its_windows_entries_each_provable_by_an_auditors_own_tools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with audit_database("sqlite", tmp_path) as database:
        await database.migrate()
        await (await _log(database)).close()
        config = tmp_path / "stackpin.toml"
        config.write_text(f'[store]\nurl = "{database.url}"\n')
        out = tmp_path / "export.jsonl"
        window = [
            "--since",
            (T0 + timedelta(seconds=1)).isoformat(),
            "--until",
            (T0 + timedelta(seconds=7)).isoformat(),
        ]
        command = ["export", "--config", str(config), *window, "--out", str(out)]
        assert await asyncio.to_thread(stackpin, command) == 0
        assert "exported 6 entries, proofs against the checkpoint of tree size 7" in capsys.readouterr().err
        head, *rows = [json.loads(line) for line in out.read_text().splitlines()]
        checkpoint, _ = open_checkpoint(head["checkpoint"]["note"], [LOG_SIGNER.verifier])
        found = {row["record_id"]: _checked(row, checkpoint.root) for row in rows}
        assert found == {
            "r1": "proven, erased",
            "r2": "proven, payload",
            "r3": "proven, payload",
            "r4": "proven",
            "r5": "proven, payload",
            "r6": "pending",
        }, "r0 is before the window, r1's erasure after it; r6 came after the checkpoint"
        signed = [row["record_id"] for row in rows if row["receipt"]]
        assert signed == ["r1", "r2", "r3", "r4", "r5"], "the log's receipt with each, r6's store held no key"

        tenant = ["--tenant", "beta", "--format", "parquet", "--out", str(tmp_path / "beta.parquet")]
        assert await asyncio.to_thread(stackpin, [*command[:-2], *tenant]) == 0
        table = pq.read_table(tmp_path / "beta.parquet")
        assert table.column("record_id").to_pylist() == ["r3"]
        assert table.to_pylist() == [row for row in rows if row["tenant"] == "beta"], (
            "the same rows as JSON lines"
        )
        assert table.schema.metadata[b"stackpin.checkpoint"].decode() == head["checkpoint"]["note"]


@pytest.mark.parametrize("kind", KINDS)
async def test_an_export_is_read_a_page_at_a_time_and_pages_change_nothing_of_it(
    kind: str, tmp_path: Path
) -> None:
    async with audit_database(kind, tmp_path) as database:
        await database.migrate()
        store = await _log(database)
        try:
            checkpoint = await store.checkpoint()
            window = Window(T0)
            pages = {
                size: [page async for page in store.export(window, checkpoint, page_size=size)]
                for size in (2, 1000)
            }
            assert [len(page) for page in pages[2]] == [2, 2, 2, 2], "never more than a page in memory"
            assert [row for page in pages[2] for row in page] == pages[1000][0]
            order = [row["record_id"] for row in pages[1000][0]]
            assert order == [*(f"r{i}" for i in range(7)), "r1"], "by time: r1's erasure came last"
        finally:
            await store.close()


async def test_export_says_what_it_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path / "none.db"}"\n')
    base = ["export", "--config", str(config)]
    assert stackpin([*base, "--since", "2026-01-01T00:00:00"]) == 2
    assert "--since must carry its time zone" in capsys.readouterr().err
    parquet = await asyncio.to_thread(
        stackpin, [*base, "--since", "2026-01-01T00:00:00Z", "--format", "parquet"]
    )
    assert parquet == 2 and "--out FILE" in capsys.readouterr().err
