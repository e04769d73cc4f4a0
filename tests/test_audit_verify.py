"""`verify` against every attack on a stored log, on real SQLite and PostgreSQL, with a witness's checkpoints.

The log: ten entries, integrated as two checkpoints (sizes 6 and 10), each cosigned by a witness that followed
it. Then raw SQL behind the store's back, as whoever holds the database would write it, and `verify` must say
what happened and where. The cut tail and the consistent rewrite leave a log that is sound in itself: only the
witness's checkpoints reveal them, and that is what the tests show.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.audit import AuditStore, VerifyReport, Witnessed
from proxy.audit.entries import entry_text
from proxy.audit.merkle import grow, leaf_hash, peaks
from proxy.audit.note import Checkpoint, generate_signer, parse_note, sign_note
from proxy.audit.receipts import Receipt, ReceiptSigner, parse_receipt
from proxy.commands.witness import WitnessStore, observe
from tests.support.audit_databases import (
    KINDS,
    LOG_SIGNER,
    WITNESS_SIGNER,
    AuditDatabase,
    StoreLogSource,
    audit_database,
    entry,
)

TRUSTED = [LOG_SIGNER.verifier]


@dataclass
class Log:
    database: AuditDatabase
    store: AuditStore
    witness: WitnessStore
    seqs: list[int]  # by leaf index

    async def verify(self, *, witnessed: bool = True, page_size: int = 3) -> VerifyReport:
        held = self.witness.witnessed([WITNESS_SIGNER.verifier]) if witnessed else []
        return await self.store.verify(verifiers=TRUSTED, witnessed=held, page_size=page_size)


async def _witness(store: AuditStore, witness: WitnessStore) -> None:
    outcome = await observe(
        StoreLogSource(store), witness, TRUSTED, WITNESS_SIGNER, lambda: datetime.now(UTC)
    )
    assert outcome.verdict == "accepted", outcome


@pytest.fixture(params=KINDS)
async def log(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Log]:
    async with audit_database(request.param, tmp_path) as db:
        await db.migrate()
        store = await db.open(checkpoint_interval_s=3600)
        witness = WitnessStore(tmp_path / "witness.jsonl")
        seqs: list[int] = []
        try:
            for batch in (range(6), range(6, 10)):  # one group commit each: contiguous numbers
                stored = await asyncio.gather(
                    *(store.append(entry(f"t{i}", seconds=i, stack_declared=i == 4)) for i in batch)
                )
                seqs += [s.seq for s in stored]
                await store.integrate()
                await _witness(store, witness)
            yield Log(db, store, witness, seqs)
        finally:
            await store.close()


def _where(report: VerifyReport) -> tuple[str, int | None]:
    assert not report.ok and report.problem is not None, "the tampering went unnoticed"
    return report.problem.kind, report.problem.position


async def test_an_untouched_log_verifies_with_its_witness(log: Log) -> None:
    report = await log.verify()
    assert report.ok, report.problem
    assert (report.entries_checked, report.witnessed_checked) == (10, 2)
    assert report.checkpoints_checked >= 2, "sizes 6 and 10, and the empty tree's when it was signed first"
    assert report.signatures_checked and report.nodes_checked == 8


async def test_an_edited_entry_is_found(log: Log) -> None:
    await log.database.execute(
        f"UPDATE entries SET content = '{{\"forged\":true}}' WHERE seq = {log.seqs[3]}"
    )
    assert _where(await log.verify()) == ("hash_mismatch", 3)


async def test_an_entry_edited_with_its_hash_no_longer_matches_its_leaf(log: Log) -> None:
    forged = replace(entry("t3", seconds=3), content_json='{"forged":true}')
    digest = hashlib.sha256(entry_text(forged).encode()).hexdigest()
    await log.database.execute(
        f"UPDATE entries SET content = '{{\"forged\":true}}', sha256 = '{digest}' WHERE seq = {log.seqs[3]}"
    )
    assert _where(await log.verify()) == ("leaf_mismatch", 3)


async def test_a_deleted_entry_is_found(log: Log) -> None:
    await log.database.execute(
        "DELETE FROM log_leaves WHERE leaf_index = 7", f"DELETE FROM entries WHERE seq = {log.seqs[7]}"
    )
    assert _where(await log.verify()) == ("gap", 7)


async def test_entries_moved_under_their_leaves_are_found(log: Log) -> None:
    await log.database.execute(
        "UPDATE log_leaves SET leaf_hash = (SELECT leaf_hash FROM log_leaves WHERE leaf_index = 3) WHERE leaf_index = 2"
    )
    assert _where(await log.verify()) == ("leaf_mismatch", 2)


async def test_reordered_entries_with_their_leaves_break_the_signed_root(log: Log) -> None:
    await log.database.execute(
        "UPDATE log_leaves SET leaf_index = -1 WHERE leaf_index = 2",
        "UPDATE log_leaves SET leaf_index = 2 WHERE leaf_index = 3",
        "UPDATE log_leaves SET leaf_index = 3 WHERE leaf_index = -1",
    )
    assert _where(await log.verify()) == ("root_mismatch", 5)


async def _cut_tail(log: Log, keep: int) -> None:
    """Deletes every leaf from `keep` on, the nodes over them, their entries and the checkpoints past `keep`."""
    doomed = ", ".join(str(seq) for seq in log.seqs[keep:])
    await log.database.execute(
        f"DELETE FROM log_leaves WHERE leaf_index >= {keep}",
        f"DELETE FROM tree_nodes WHERE (idx + 1) * (1 << level) > {keep}",
        f"DELETE FROM checkpoints WHERE tree_size > {keep}",
        f"DELETE FROM entries WHERE seq IN ({doomed})",
    )


async def test_a_cut_tail_with_the_log_rewound_is_found_by_the_witness(log: Log) -> None:
    await _cut_tail(log, 6)
    alone = await log.verify(witnessed=False)
    assert alone.ok and alone.tree_size == 6, "without a witness a cut tail looks like a shorter log"
    assert _where(await log.verify()) == ("witnessed_beyond_log", 6)


async def test_a_consistent_rewrite_of_the_tail_is_found_by_the_witness(log: Log) -> None:
    """The worst case: the database's owner holds the signing key too, and rewrites history from leaf 6 on."""
    await _cut_tail(log, 6)
    for i in range(6, 10):
        await log.store.append(entry(f"t{i}", seconds=i, content={"rewritten": i}))
    insider = await log.database.open()
    try:
        await insider.integrate()
    finally:
        await insider.close()
    alone = await log.verify(witnessed=False)
    assert alone.ok and alone.tree_size == 10, "signed with the real key, the rewrite is sound in itself"
    assert _where(await log.verify()) == ("witnessed_root_mismatch", 9)
    outcome = await observe(
        StoreLogSource(log.store), log.witness, TRUSTED, WITNESS_SIGNER, lambda: datetime.now(UTC)
    )
    assert outcome.verdict == "refused" and "two different roots" in (outcome.reason or "")


async def _forge_append(log: Log, *, sign_with: object | None) -> None:
    """Appends an entry with its leaf and nodes, and moves the log's head: a checkpoint of the new size."""
    forged = entry("forged", seconds=99)
    seq = max(log.seqs) + 5000
    await log.database.insert_entry(seq, forged)
    wanted = peaks(0, 10)  # (3, 0) and (1, 4): inner nodes
    nodes = {}
    for level, idx in wanted:
        query = f"SELECT hash FROM tree_nodes WHERE level = {level} AND idx = {idx}"
        nodes[(level, idx)] = bytes.fromhex(await log.database.scalar(query))
    leaf = leaf_hash(forged.encoded)
    growth = grow(10, [(n, nodes[n]) for n in wanted], [leaf])
    statements = [f"INSERT INTO log_leaves (leaf_index, seq, leaf_hash) VALUES (10, {seq}, '{leaf.hex()}')"]
    statements += [
        f"INSERT INTO tree_nodes (level, idx, hash) VALUES ({lv}, {i}, '{h.hex()}')"
        for (lv, i), h in growth.nodes
        if lv > 0
    ]
    if sign_with is not None:
        note = sign_note(Checkpoint(LOG_SIGNER.name, 11, growth.root).text, sign_with).render()  # type: ignore[arg-type]
        statements.append(
            "INSERT INTO checkpoints (tree_size, root_hash, note, signed_at) "
            f"VALUES (11, '{growth.root.hex()}', '{note}', '2026-01-02 03:04:05')"
        )
    await log.database.execute(*statements)


async def test_a_forged_append_with_the_head_moved_needs_the_signing_key(log: Log) -> None:
    await _forge_append(log, sign_with=generate_signer(LOG_SIGNER.name))
    assert _where(await log.verify()) == ("signature_invalid", 10)


async def test_leaves_appended_without_a_checkpoint_are_found(log: Log) -> None:
    await _forge_append(log, sign_with=None)
    assert _where(await log.verify()) == ("unsigned_leaves", 10)


@pytest.mark.parametrize(
    ("statement", "kind", "position"),
    [
        ("UPDATE entries SET stack_declared = NOT stack_declared WHERE seq = {seq4}", "hash_mismatch", 4),
        ("UPDATE entries SET part = 'flag' WHERE seq = {seq1}", "hash_mismatch", 1),
        ("UPDATE entries SET status = 'forged' WHERE seq = {seq1}", "hash_mismatch", 1),
        ("UPDATE entries SET prev_sha256 = '{zeros}' WHERE seq = {seq1}", "hash_mismatch", 1),
        ("UPDATE tree_nodes SET hash = '{zeros}' WHERE level = 1 AND idx = 0", "node_mismatch", 0),
        ("UPDATE checkpoints SET root_hash = '{zeros}' WHERE tree_size = 6", "signature_invalid", 5),
        ("UPDATE prompts SET text = 'You are verbose.'", "prompt_hash_mismatch", None),
        (
            "UPDATE stacks SET canonical_json = replace(canonical_json, 'fp32', 'bf16')",
            "stack_hash_mismatch",
            None,
        ),
    ],
    ids=[
        "flipped-declared",
        "entry-made-a-flag",
        "edited-status",
        "entry-made-chained",
        "edited-node",
        "edited-checkpoint",
        "edited-prompt",
        "edited-stack",
    ],
)
async def test_a_flipped_field_in_any_row_audit_reads_is_found(
    log: Log, statement: str, kind: str, position: int | None
) -> None:
    await log.database.execute(statement.format(seq4=log.seqs[4], seq1=log.seqs[1], zeros="0" * 64))
    assert _where(await log.verify()) == (kind, position)


async def test_an_entry_slipped_in_outside_the_tree_and_its_queue_is_found(log: Log) -> None:
    await log.database.insert_entry(max(log.seqs) + 7000, entry("slipped"))
    assert _where(await log.verify()) == ("orphan_entry", None)


async def test_an_invalid_cosignature_in_the_witness_store_is_refused(log: Log, tmp_path: Path) -> None:
    other = generate_signer("witness.test/w1", WITNESS_SIGNER.kind)
    held = [Witnessed("witness elsewhere", note, [other.verifier]) for note in log.witness.notes()]
    report = await log.store.verify(verifiers=TRUSTED, witnessed=held)
    assert _where(report) == ("witness_signature_invalid", None)
    assert parse_note(log.witness.notes()[-1]).signatures[-1].name == "witness.test/w1"


async def _kept_receipts(log: Log) -> list[Receipt]:
    """The receipts the log handed out for the fixture's ten entries, as their clients kept them."""
    texts = [await log.database.scalar(f"SELECT receipt FROM entries WHERE seq = {seq}") for seq in log.seqs]
    return [parse_receipt(text) for text in texts]


async def test_receipts_clients_kept_are_each_an_entry_of_the_log(log: Log) -> None:
    kept = await _kept_receipts(log)
    report = await log.store.verify(verifiers=TRUSTED, receipts=kept)
    assert report.ok, report.problem
    assert (report.receipts_checked, report.receipts_pending, report.stored_receipts_checked) == (10, 0, 10)
    pending = parse_receipt((await log.store.append(entry("t10", seconds=10))).receipt or "")
    report = await log.store.verify(verifiers=TRUSTED, receipts=[*kept, pending])
    assert report.ok and (report.receipts_checked, report.receipts_pending) == (10, 1), (
        "committed, not yet in"
    )


async def test_an_entry_dropped_before_its_integration_breaks_its_receipts_promise(log: Log) -> None:
    dropped = await log.store.append(entry("t10", seconds=10))
    await log.database.execute(
        f"DELETE FROM log_queue WHERE first_seq = {dropped.seq}",
        f"DELETE FROM entries WHERE seq = {dropped.seq}",
    )
    await log.store.integrate()
    assert (await log.verify()).ok, "without the receipt, nothing shows the entry was ever appended"
    receipt = parse_receipt(dropped.receipt or "")
    report = await log.store.verify(verifiers=TRUSTED, receipts=[receipt])
    assert _where(report) == ("receipt_unfulfilled", None)
    assert report.problem is not None and report.problem.record_id == "t10"


async def test_an_entry_replaced_before_its_integration_no_longer_matches_the_receipt_it_keeps(
    log: Log,
) -> None:
    original = await log.store.append(entry("t10", seconds=10))
    forged = entry("t10", seconds=10, content={"forged": True})
    await log.database.execute(
        f"UPDATE entries SET content = '{forged.content_json}', sha256 = '{forged.sha256}' WHERE seq = {original.seq}",
        f"UPDATE log_queue SET leaf_hashes = '{forged.leaf_hash.hex()}' WHERE first_seq = {original.seq}",
    )
    await log.store.integrate()  # the log signs the forged leaf, as it would have in that moment
    assert _where(await log.verify()) == ("receipt_mismatch", 10)
    await log.database.execute(f"UPDATE entries SET receipt = NULL WHERE seq = {original.seq}")
    assert (await log.verify()).ok, "with the kept receipt gone too, only the client's copy shows it"
    report = await log.store.verify(verifiers=TRUSTED, receipts=[parse_receipt(original.receipt or "")])
    assert _where(report) == ("receipt_unfulfilled", None)


async def test_a_receipt_the_log_did_not_sign_is_refused(log: Log) -> None:
    impostor = ReceiptSigner(generate_signer(LOG_SIGNER.name))
    report = await log.store.verify(verifiers=TRUSTED, receipts=[parse_receipt(impostor.issue(entry("t1")))])
    assert _where(report) == ("receipt_invalid", None)
