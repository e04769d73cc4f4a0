"""Erasing a record's payload (proxy/audit/erasure.py): the request and answer go, the log says what went, when and
why, and every proof of the record's entries stays valid; on real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from proxy.audit import AuditStore, NotErasable, SealedEntry
from proxy.audit.erasure import Policy
from proxy.audit.merkle import leaf_hash, verify_inclusion
from proxy.audit.note import open_checkpoint
from tests.support.audit_databases import KINDS, LOG_SIGNER, T0, AuditDatabase, audit_database, entry

ASKED = Policy("request", "the data subject asked")
NOW = T0 + timedelta(days=1)


def paid(record_id: str, *, part: str = "answer", tenant: str = "acme", seconds: float = 0.0) -> SealedEntry:
    """An entry as the proxy writes one now: what the client said and got is its payload, apart."""
    return entry(
        record_id,
        part=part,
        tenant=tenant,
        seconds=seconds,
        content={
            "endpoint": "/v1/chat/completions",
            "stream": part != "answer",
            "usage": {"total_tokens": 7},
        },
        payload={
            "request": {"messages": [{"role": "user", "content": f"my secret, {record_id}"}]},
            "response": {"choices": [{"index": 0, "message": {"content": "kept safe"}}]},
        },
    )


@pytest.fixture(params=KINDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditDatabase]:
    async with audit_database(request.param, tmp_path) as db:
        await db.migrate()
        yield db


@pytest.fixture
async def store(database: AuditDatabase) -> AsyncIterator[AuditStore]:
    opened = await database.open(checkpoint_interval_s=3600)
    try:
        yield opened
    finally:
        await opened.close()


def _proven(proof: Any, index: int) -> bool:
    checkpoint, _ = open_checkpoint(proof.checkpoint.note, [LOG_SIGNER.verifier])
    item = proof.entries[index]
    path = [base64.b64decode(h) for h in item.proof]
    verify_inclusion(item.index, checkpoint.size, leaf_hash(item.entry.encode()), path, checkpoint.root)
    return True


async def test_an_erased_payload_is_gone_the_log_says_so_and_every_proof_stays_valid(
    store: AuditStore, database: AuditDatabase
) -> None:
    opened = await store.append(paid("r1", part="opened"))
    closed = await store.append(paid("r1", part="closed", seconds=1))
    await store.append(paid("r2"))
    await store.integrate()
    before = await store.record_proof("r1", None)
    record = await store.get_record("r1", None)
    assert before is not None and record is not None
    assert record.entries[0].payload == "kept" and "my secret" in str(record.entries[0].content["request"])
    assert not record.erased

    erasure = await store.erase("r1", ASKED, NOW)
    await store.integrate()

    assert await database.scalar(f"SELECT count(*) FROM payloads WHERE seq = {opened.seq}") == 0
    record = await store.get_record("r1", None)
    assert (
        record is not None and record.erased and [e.payload for e in record.entries] == ["erased", "erased"]
    )
    assert "request" not in record.entries[0].content and record.entries[0].content["usage"] == {
        "total_tokens": 7
    }
    (said,) = record.erasures
    assert said.seq == erasure.seq and said.status == "erased" and record.flags == []
    assert said.content["policy"] == "request" and said.content["why"] == "the data subject asked"
    assert [(e["seq"], e["part"]) for e in said.content["erased"]] == [
        (opened.seq, "opened"),
        (closed.seq, "closed"),
    ]
    after = await store.record_proof("r1", None)
    assert after is not None
    assert [e.leaf_hash for e in after.entries[:2]] == [e.leaf_hash for e in before.entries], (
        "the same leaves"
    )
    assert all(_proven(after, i) for i in range(3)), "both entries and the erasure are proven"
    assert after.entries[0].payload_erased and after.entries[0].payload is None
    kept = await store.record_proof("r2", None)
    assert kept is not None and kept.entries[0].payload is not None and not kept.entries[0].payload_erased
    report = await store.verify(verifiers=[LOG_SIGNER.verifier])
    assert report.ok, report.problem
    assert (report.payloads_checked, report.payloads_erased) == (1, 2)
    listed = {r.id: r for r in await store.list_records()}
    assert listed["r1"].erased and not listed["r1"].flagged, "an erasure is not a flag on the stack"


async def test_what_cannot_be_erased_is_refused_saying_why(store: AuditStore) -> None:
    await store.append(paid("r1"))
    await store.append(entry("old"))  # written before payloads were kept apart: all in its hashed content
    await store.erase("r1", ASKED, NOW)
    with pytest.raises(NotErasable, match="erased already"):
        await store.erase("r1", ASKED, NOW)
    with pytest.raises(NotErasable, match="written before payloads were kept apart"):
        await store.erase("old", ASKED, NOW)
    with pytest.raises(LookupError, match="no record"):
        await store.erase("nobody", ASKED, NOW)
    with pytest.raises(LookupError, match="no record"):
        await store.erase("a\x00b", ASKED, NOW)


async def test_two_erasures_of_one_record_at_once_leave_one_erasure_entry(store: AuditStore) -> None:
    await store.append(paid("r1"))
    outcomes = await asyncio.gather(
        *(store.erase("r1", ASKED, NOW) for _ in range(2)), return_exceptions=True
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["NotErasable", "StoredEntry"]
    record = await store.get_record("r1", None)
    assert record is not None and len(record.erasures) == 1


@pytest.mark.parametrize(
    ("statement", "kind"),
    [
        ("UPDATE payloads SET payload = replace(payload, 'kept safe', 'forged')", "payload_mismatch"),
        ("UPDATE payloads SET salt = '{zeros}'", "payload_mismatch"),
        ("DELETE FROM payloads", "payload_missing"),
    ],
    ids=["edited-payload", "edited-salt", "deleted-payload"],
)
async def test_a_payload_edited_or_deleted_behind_the_logs_back_is_found(
    store: AuditStore, database: AuditDatabase, statement: str, kind: str
) -> None:
    await store.append(paid("r1"))
    await store.integrate()
    await database.execute(statement.format(zeros="0" * 64))
    report = await store.verify(verifiers=[LOG_SIGNER.verifier])
    assert report.problem is not None and (report.problem.kind, report.problem.record_id) == (kind, "r1")


async def test_an_erased_payload_of_another_record_does_not_excuse_a_deleted_one(
    store: AuditStore, database: AuditDatabase
) -> None:
    await store.append(paid("r1"))
    deleted = await store.append(paid("r2"))
    await store.erase("r1", ASKED, NOW)
    await database.execute(f"DELETE FROM payloads WHERE seq = {deleted.seq}")
    report = await store.verify(verifiers=[LOG_SIGNER.verifier])
    assert report.problem is not None and (report.problem.kind, report.problem.record_id) == (
        "payload_missing",
        "r2",
    )


async def test_the_records_a_retention_erases_are_found_by_tenant_and_age(store: AuditStore) -> None:
    await store.append(paid("old", seconds=0))
    await store.append(paid("young", seconds=3600))
    await store.append(paid("theirs", tenant="beta", seconds=0))
    cutoff = T0 + timedelta(minutes=30)
    assert await store.expired("acme", cutoff) == ["old"]
    await store.erase("old", ASKED, NOW)
    assert await store.expired("acme", cutoff) == [], "an erased record is not found again"
    assert await store.expired("beta", cutoff) == ["theirs"]
