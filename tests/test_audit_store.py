"""The audit store on real SQLite and PostgreSQL: appends, reads, tenancy, group commit, integration into the tree,
checkpoints and proofs. Tampering and what `verify` makes of it: tests/test_audit_verify.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.audit import (
    AuditStore,
    DuplicateEntry,
    LogDiverged,
    NoSuchCheckpoint,
    ProofError,
    RecordCounts,
    RecordFilter,
    RecordSummary,
    StoreClosed,
    UnknownStack,
    stack_fingerprint,
    upgrade_database,
)
from proxy.audit.merkle import EMPTY_ROOT, leaf_hash, verify_consistency, verify_inclusion
from proxy.audit.note import open_checkpoint
from proxy.logs import configure_logging
from tests.support.audit_databases import KINDS, LOG_SIGNER, STACK, T0, AuditDatabase, audit_database, entry

FINGERPRINT = stack_fingerprint(STACK)


@pytest.fixture(params=KINDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditDatabase]:
    async with audit_database(request.param, tmp_path) as db:
        await db.migrate()
        yield db


@pytest.fixture
async def store(database: AuditDatabase) -> AsyncIterator[AuditStore]:
    """A store that integrates when told to (and once at its start), so that tests know what the tree holds."""
    opened = await database.open(checkpoint_interval_s=3600)
    yield opened
    await opened.close()


class Batches:
    """A CommitObserver that remembers the size of every group commit."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.depths: list[int] = []

    def committed(self, batch_size: int, seconds: float) -> None:
        self.sizes.append(batch_size)

    def queue_depth(self, depth: int) -> None:
        self.depths.append(depth)


async def test_appends_are_sequenced_integrated_and_survive_reopening(database: AuditDatabase) -> None:
    store = await database.open(signer=None)
    stored = [await store.append(entry(f"r{i}", seconds=i)) for i in range(5)]
    pending = await store.get_record("r3", tenant="acme")
    await store.close()

    seqs = [s.seq for s in stored]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5, "each entry its own number, in commit order"
    assert pending is not None and pending.entries[0].index is None, "not in the tree before integration"

    reopened = await database.open()
    try:
        checkpoint = await reopened.integrate()
        record = await reopened.get_record("r3", tenant="acme")
        report = await reopened.verify(verifiers=[LOG_SIGNER.verifier])
        after = await reopened.append(entry("r5"))
    finally:
        await reopened.close()
    assert checkpoint is not None and checkpoint.tree_size == 5
    assert record is not None
    assert (record.entries[0].index, record.entries[0].sha256) == (3, stored[3].sha256)
    assert record.created_at == T0 + timedelta(seconds=3)
    assert record.stack == STACK and record.fingerprint == FINGERPRINT and record.stack_declared is False
    assert record.prompt_text == "You are terse."
    assert record.entries[0].content["response"]["token_logprobs"] == [-0.125, -1.5e-7, -3.25]
    assert report.ok and report.entries_checked == 5 and report.checkpoints_checked == 1, report.problem
    assert report.checkpoint == checkpoint.note
    assert after.seq > seqs[-1], "a reopened store continues the sequence"


async def test_concurrent_appends_share_commits_and_get_their_own_numbers(database: AuditDatabase) -> None:
    batches = Batches()
    store = await database.open(observer=batches, batch_max=64)
    try:
        stored = await asyncio.gather(*(store.append(entry(f"c{i}")) for i in range(300)))
        await store.integrate()
        report = await store.verify()
    finally:
        await store.close()
    assert len({s.seq for s in stored}) == 300
    assert report.ok and report.entries_checked == 300 and report.pending == 0
    assert sum(batches.sizes) == 300
    assert max(batches.sizes) > 1, "concurrent appends must share group commits"
    assert max(batches.sizes) <= 64


async def test_a_batch_gets_contiguous_sequence_numbers(database: AuditDatabase) -> None:
    batches = Batches()
    store = await database.open(observer=batches, batch_max=64)
    try:
        stored = await asyncio.gather(*(store.append(entry(f"b{i}")) for i in range(10)))
    finally:
        await store.close()
    seqs = sorted(s.seq for s in stored)
    assert batches.sizes == [10]
    assert seqs == list(range(seqs[0], seqs[0] + 10))


async def test_verifying_while_appends_and_integration_go_on_finds_nothing_wrong(
    database: AuditDatabase,
) -> None:
    store = await database.open(batch_max=4, checkpoint_interval_s=0.05)
    try:
        await store.append(entry("first"))
        appends = asyncio.gather(*(store.append(entry(f"c{i}")) for i in range(120)))
        reports = [await store.verify(page_size=7, verifiers=[LOG_SIGNER.verifier]) for _ in range(5)]
        checks = [(await store.check_record(f"c{i}"))[0] for i in range(0, 120, 10)]
        await appends
        await store.integrate()
        final = await store.verify()
    finally:
        await store.close()
    assert all(r.ok for r in reports), [r.problem for r in reports if not r.ok]
    assert all(check.ok for entries in checks for check in entries)
    assert final.ok and final.tree_size == 121


async def test_two_stores_on_one_database_build_one_tree(database: AuditDatabase) -> None:
    """Several proxies on one database: they sequence without waiting for each other, and integrate one at a time
    (both integrate in the background here), so the tree never forks."""
    first = await database.open(batch_max=8, checkpoint_interval_s=0.05)
    second = await database.open(batch_max=8, checkpoint_interval_s=0.05)
    try:
        stored = await asyncio.gather(
            *(
                store.append(entry(f"{name}{i}"))
                for i in range(60)
                for name, store in (("a", first), ("b", second))
            )
        )
        await asyncio.gather(first.integrate(), second.integrate())
        await first.integrate()
        report = await first.verify(verifiers=[LOG_SIGNER.verifier])
    finally:
        await first.close()
        await second.close()
    assert len({s.seq for s in stored}) == 120
    assert report.ok, report.problem
    assert (report.tree_size, report.pending) == (120, 0)


async def test_a_tenant_reads_only_its_own_records(store: AuditStore) -> None:
    await store.append(entry("mine", tenant="acme"))
    await store.append(entry("theirs", tenant="globex"))

    assert await store.get_record("theirs", tenant="acme") is None
    assert await store.get_record("nonexistent", tenant="acme") is None
    mine = await store.get_record("mine", tenant="acme")
    assert mine is not None and mine.tenant == "acme"
    assert (await store.get_record("theirs", tenant=None)) is not None, "tenant=None is the operator's view"
    assert [r.id for r in await store.list_records(tenant="acme")] == ["mine"]


async def test_an_id_no_entry_could_carry_is_no_record_on_either_store(store: AuditStore) -> None:
    await store.append(entry("rec_" + "0" * 32))

    # PostgreSQL refuses NUL in text outright; such an id must be "no record", never a database failure.
    for malformed in ("rec_" + "0" * 32 + "\x00", "\x00", "", "r" * 101, "rec_\ud800"):
        assert await store.get_record(malformed, tenant=None) is None, repr(malformed)
        assert await store.record_proof(malformed, tenant=None) is None, repr(malformed)
        assert (await store.check_record(malformed))[0] == [], repr(malformed)


async def test_a_stream_is_opened_then_closed(store: AuditStore) -> None:
    await store.append(entry("s1", part="opened", status="streaming"))
    await store.append(entry("other", seconds=1))
    await store.append(
        entry("s1", part="closed", status="interrupted", with_stack=False, fingerprint=FINGERPRINT)
    )
    await store.append(entry("s2", part="opened", status="streaming", seconds=2))

    record = await store.get_record("s1", tenant="acme")
    assert record is not None
    assert [e.part for e in record.entries] == ["opened", "closed"]
    await store.integrate()
    integrated = await store.get_record("s1", tenant="acme")
    assert integrated is not None and [e.index for e in integrated.entries] == [0, 2]
    assert record.status == "interrupted"
    summaries = {s.id: s for s in await store.list_records()}
    assert (summaries["s1"].part, summaries["s1"].status) == ("closed", "interrupted")
    assert (summaries["s2"].part, summaries["s2"].status) == ("opened", "streaming")
    assert len(summaries) == 3, "a stream is one record, not two"


async def test_flags_accumulate_but_other_parts_are_written_once(store: AuditStore) -> None:
    await store.append(entry("r1"))
    for reason in ("stack_changed", "fingerprint_mismatch"):
        await store.append(entry("r1", part="flag", status=reason, content={"reason": reason}))
    with pytest.raises(DuplicateEntry, match="already has an 'answer' entry"):
        await store.append(entry("r1"))

    record = await store.get_record("r1", tenant="acme")
    assert record is not None
    assert [f.status for f in record.flags] == ["stack_changed", "fingerprint_mismatch"]
    assert [e.part for e in record.entries] == ["answer"]
    assert (await store.list_records())[0].flagged
    await store.integrate()
    assert (await store.verify()).ok


async def test_one_bad_entry_fails_alone_in_a_shared_commit(store: AuditStore) -> None:
    await store.append(entry("taken"))
    unknown = "f" * 64
    results = await asyncio.gather(
        *(store.append(entry(f"ok{i}")) for i in range(5)),
        store.append(entry("taken")),
        store.append(entry("lost", with_stack=False, fingerprint=unknown)),
        store.append(entry("twice")),
        store.append(entry("twice")),
        return_exceptions=True,
    )
    assert all(not isinstance(r, BaseException) for r in results[:5])
    assert isinstance(results[5], DuplicateEntry)
    assert isinstance(results[6], UnknownStack) and unknown in str(results[6])
    assert [type(r) for r in results[7:]] == [type(results[0]), DuplicateEntry]
    await store.integrate()
    report = await store.verify()
    assert report.ok and report.tree_size == 7


async def test_each_caller_gets_its_own_entry_back_when_one_is_refused(store: AuditStore) -> None:
    names = ["a", "b", "lost", "c", "d"]
    results = await asyncio.gather(
        *(
            store.append(entry(n, with_stack=False, fingerprint="f" * 64) if n == "lost" else entry(n))
            for n in names
        ),
        return_exceptions=True,
    )
    assert isinstance(results[2], UnknownStack)
    kept = [r for r in results if not isinstance(r, BaseException)]
    assert [r.record_id for r in kept] == ["a", "b", "c", "d"]
    for stored in kept:
        record = await store.get_record(stored.record_id, tenant="acme")
        assert record is not None and record.entries[0].seq == stored.seq
        assert record.entries[0].sha256 == stored.sha256


class BrokenObserver:
    def committed(self, batch_size: int, seconds: float) -> None:
        raise RuntimeError("metrics backend down")

    def queue_depth(self, depth: int) -> None:
        raise RuntimeError("metrics backend down")


async def test_a_failing_observer_does_not_stop_the_writer(database: AuditDatabase) -> None:
    store = await database.open(observer=BrokenObserver())
    try:
        first = await store.append(entry("one"))
        second = await store.append(entry("two"))
        await store.ping()
    finally:
        await store.close()
    assert first.seq < second.seq


async def test_numbers_survive_storage_bit_for_bit(store: AuditStore) -> None:
    numbers = [2.0**60, -0.0, 5e-324, 0.1, 1e300, 2**53 - 1, -3.2500000000000004]
    await store.append(entry("n", content={"numbers": numbers}))
    record = await store.get_record("n", tenant="acme")
    assert record is not None
    assert [repr(x) for x in record.entries[0].content["numbers"]] == [
        repr(x) for x in [2.0**60, 0, *numbers[2:]]
    ]
    await store.integrate()
    assert (await store.verify()).ok


async def test_a_known_stack_need_not_be_sent_again(store: AuditStore) -> None:
    await store.append(entry("first"))
    await store.append(entry("second", with_stack=False, fingerprint=FINGERPRINT))
    assert await store.get_stack(FINGERPRINT) == STACK
    assert await store.get_stack("0" * 64) is None
    record = await store.get_record("second", tenant=None)
    assert record is not None and record.stack == STACK


async def test_listing_filters_by_stack_model_and_time(store: AuditStore) -> None:
    other_stack = {**STACK, "kernel_mode": "default"}
    for i in range(6):
        await store.append(
            entry(f"r{i}", seconds=i * 60, stack=other_stack if i % 2 else STACK, model=f"m{i % 3}")
        )

    assert [r.id for r in await store.list_records()] == ["r5", "r4", "r3", "r2", "r1", "r0"]
    assert [r.id for r in await store.list_records(limit=2)] == ["r5", "r4"]
    assert [r.id for r in await store.list_records(fingerprint=FINGERPRINT)] == ["r4", "r2", "r0"]
    assert [r.id for r in await store.list_records(model="m1")] == ["r4", "r1"]
    window = await store.list_records(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=3))
    assert [r.id for r in window] == ["r2", "r1"]
    with pytest.raises(ValueError, match="limit must be between 1 and 1000"):
        await store.list_records(limit=0)
    with pytest.raises(ValueError, match="time zone"):
        await store.list_records(since=T0.replace(tzinfo=None))


async def test_listing_filters_by_fingerprint_prefix_replays_and_flags_and_counts_them(
    store: AuditStore,
) -> None:
    other_stack = {**STACK, "kernel_mode": "default"}
    other = stack_fingerprint(other_stack)
    await store.append(entry("orig", seconds=0))
    await store.append(entry("again", seconds=1, replay_of="orig", with_stack=False, fingerprint=FINGERPRINT))
    await store.append(entry("elsewhere", seconds=2, stack=other_stack))
    await store.append(entry("theirs", seconds=3, tenant="globex", replay_of="orig"))
    await store.append(entry("orig", part="flag", status="stack_changed", seconds=4, content={}))

    def ids(records: list[RecordSummary]) -> list[str]:
        return [r.id for r in records]

    assert ids(await store.list_records(fingerprint=other[:8])) == ["elsewhere"]
    assert ids(await store.list_records(fingerprint=FINGERPRINT[:12])) == ["theirs", "again", "orig"]
    assert ids(await store.list_records(replays_only=True, tenant="acme")) == ["again"]
    assert ids(await store.list_records(replay_of="orig")) == ["theirs", "again"]
    assert ids(await store.list_records(flagged_only=True)) == ["orig"]
    assert await store.count_records(RecordFilter()) == RecordCounts(total=4, replays=2, flagged=1)
    assert await store.count_records(RecordFilter(tenant="acme", fingerprint=FINGERPRINT)) == RecordCounts(
        total=2, replays=1, flagged=1
    )
    with pytest.raises(ValueError, match="lowercase hex"):
        await store.list_records(fingerprint="9A%")
    with pytest.raises(TypeError, match="not both"):
        await store.list_records(RecordFilter(), tenant="acme")


@pytest.mark.parametrize("field", ["model", "tenant", "replay_of"])
@pytest.mark.parametrize(
    "value", ["a\x00", "\ud800", "", "m" * 201], ids=["nul", "surrogate", "empty", "long"]
)
async def test_a_text_filter_no_column_could_hold_is_the_callers_to_fix_not_the_store_down(
    store: AuditStore, field: str, value: str
) -> None:
    await store.append(entry("r1"))
    with pytest.raises(ValidationError, match=f"{field} must be 1 to"):
        await store.list_records(**{field: value})
    with pytest.raises(ValidationError, match=f"{field} must be 1 to"):
        await store.count_records(RecordFilter(**{field: value}))
    assert [r.id for r in await store.list_records()] == ["r1"], "and the store is not down"


async def test_pages_are_keyset_pages_that_appends_do_not_shift(store: AuditStore) -> None:
    for i in range(7):
        await store.append(entry(f"r{i}", seconds=i))

    first = await store.list_records(limit=3)
    assert [r.id for r in first] == ["r6", "r5", "r4"]
    await store.append(entry("newest", seconds=100))
    second = await store.list_records(limit=3, before=first[-1].id)
    assert [r.id for r in second] == ["r3", "r2", "r1"]
    assert [r.id for r in await store.list_records(limit=3, before=second[-1].id)] == ["r0"]
    assert [r.id for r in await store.list_records(limit=3, after=second[0].id)] == ["r6", "r5", "r4"], (
        "the page just newer, newest first"
    )
    assert [r.id for r in await store.list_records(limit=3, after="r5")] == ["newest", "r6"]
    with pytest.raises(ValueError, match="no record 'nope' to page from"):
        await store.list_records(before="nope")


async def test_listing_is_newest_first_by_time_not_by_arrival(store: AuditStore) -> None:
    """Proxies with their own clocks append in one chain; a listing still reads in time order."""
    await store.append(entry("later", seconds=100))
    await store.append(entry("earlier", seconds=50))
    await store.append(entry("same-time-second", seconds=100))
    assert [r.id for r in await store.list_records()] == ["same-time-second", "later", "earlier"]


async def test_records_served_since_names_what_a_replica_produced(store: AuditStore) -> None:
    await store.append(entry("early", seconds=0))
    await store.append(entry("late", seconds=100))
    await store.append(entry("elsewhere", seconds=100, replica="replica-b"))
    await store.append(entry("late", part="flag", status="stack_changed", seconds=200, content={}))

    assert await store.records_served_since("replica-a", T0 + timedelta(seconds=50)) == ["late"]
    assert await store.records_served_since("replica-a", T0) == ["early", "late"]


async def test_process_durability_commits_the_same_chain(database: AuditDatabase) -> None:
    """'process' skips the sync at each commit; what is committed and how it chains stays the same."""
    store = await database.open(durability="process")
    try:
        stored = await asyncio.gather(*(store.append(entry(f"p{i}")) for i in range(20)))
    finally:
        await store.close()
    reopened = await database.open()
    try:
        report = await reopened.verify()
    finally:
        await reopened.close()
    assert len({s.seq for s in stored}) == 20
    assert report.ok and report.tree_size == 20, "closing integrated what it had committed"


async def test_an_unknown_durability_is_refused(database: AuditDatabase) -> None:
    with pytest.raises(ValueError, match="durability must be 'disk' or 'process'"):
        await database.open(durability="fast")


async def test_an_empty_log_signs_and_verifies_the_empty_tree(store: AuditStore) -> None:
    checkpoint = await store.integrate()
    report = await store.verify(verifiers=[LOG_SIGNER.verifier])
    assert checkpoint is not None and checkpoint.tree_size == 0
    assert base64.b64decode(checkpoint.root_hash) == EMPTY_ROOT
    assert report.ok and report.entries_checked == 0 and report.checkpoints_checked == 1


async def test_sqlite_keeps_its_log_in_wal_mode(tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        store = await db.open(create_if_empty=True)
        try:
            await store.append(entry("r1"))
        finally:
            await store.close()
        assert await db.scalar("PRAGMA journal_mode") == "wal"


async def test_an_sqlite_database_and_its_wal_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    store = await AuditStore.open(f"sqlite+aiosqlite:///{path}", create_if_empty=True, signer=LOG_SIGNER)
    try:
        await store.append(entry("r1"))
        files = sorted(tmp_path.iterdir())
        assert [f.name for f in files] == ["audit.db", "audit.db-shm", "audit.db-wal"]
        assert [oct(f.stat().st_mode & 0o777) for f in files] == ["0o600"] * 3
    finally:
        await store.close()
    upgraded = tmp_path / "upgraded.db"  # `stackpin db upgrade` on a new file
    await asyncio.to_thread(upgrade_database, f"sqlite:///{upgraded}")
    assert upgraded.stat().st_mode & 0o777 == 0o600


async def test_close_commits_what_is_queued_and_refuses_more(database: AuditDatabase) -> None:
    store = await database.open(batch_max=4)
    pending = [asyncio.ensure_future(store.append(entry(f"q{i}"))) for i in range(20)]
    await asyncio.sleep(0)  # let every append reach the queue
    await store.close()
    assert len({p.result().seq for p in pending}) == 20
    with pytest.raises(StoreClosed):
        await store.append(entry("late"))

    reopened = await database.open()
    try:
        assert (await reopened.verify()).tree_size == 20
        await reopened.ping()
    finally:
        await reopened.close()


async def _integrated(store: AuditStore, count: int, prefix: str = "p") -> None:
    for i in range(count):
        await store.append(entry(f"{prefix}{i}", seconds=i))
    await store.integrate()


async def test_a_record_is_proven_in_a_checkpoint_without_reading_the_log(store: AuditStore) -> None:
    await _integrated(store, 6)
    await store.append(entry("s", part="opened", status="streaming"))
    await store.integrate()
    await store.append(
        entry("s", part="closed", status="complete", with_stack=False, fingerprint=FINGERPRINT)
    )

    proof = await store.record_proof("s", tenant="acme")
    assert proof is not None
    checkpoint, _ = open_checkpoint(proof.checkpoint.note, [LOG_SIGNER.verifier])
    assert checkpoint.size == proof.checkpoint.tree_size == 7
    opened, closed = proof.entries
    assert (opened.part, opened.index, closed.index, closed.proof) == ("opened", 6, None, None)
    assert base64.b64decode(opened.leaf_hash) == leaf_hash(opened.entry.encode())
    assert opened.proof is not None
    verify_inclusion(
        6, 7, base64.b64decode(opened.leaf_hash), [base64.b64decode(p) for p in opened.proof], checkpoint.root
    )
    assert '"record_id":"s"' in opened.entry, "the entry's bytes travel with its proof"

    assert await store.record_proof("s", tenant="globex") is None, "tenant-scoped like the record"
    assert await store.record_proof("nobody", tenant=None) is None
    older = await store.record_proof("p2", tenant="acme", size=6)
    assert older is not None and older.checkpoint.tree_size == 6 and older.entries[0].proof is not None
    with pytest.raises(NoSuchCheckpoint, match="no checkpoint of tree size 5"):
        await store.record_proof("p2", tenant="acme", size=5)


async def test_consistency_proofs_join_any_two_checkpoints(store: AuditStore) -> None:
    roots, done = {}, 0
    for size in (1, 3, 4, 9):
        await _integrated(store, size - done, prefix=f"c{size}-")
        done, signed = size, await store.checkpoint()
        roots[signed.tree_size] = base64.b64decode(signed.root_hash)
    assert sorted(roots) == [1, 3, 4, 9]
    for old in roots:
        for new in roots:
            if old <= new:
                proof = await store.consistency(old, new)
                verify_consistency(
                    old, new, roots[old], roots[new], [base64.b64decode(p) for p in proof.proof]
                )
    assert (await store.consistency(3)).new_size == 9, "to defaults to the latest checkpoint"
    assert (await store.checkpoint(4)).tree_size == 4
    with pytest.raises(ProofError, match="0 < from <= to"):
        await store.consistency(0, 4)
    with pytest.raises(ProofError, match="latest checkpoint has tree size 9"):
        await store.consistency(3, 10)


async def test_a_checkpoint_follows_arriving_entries_within_a_second(database: AuditDatabase) -> None:
    store = await database.open(checkpoint_interval_s=0.5)
    try:
        await store.append(entry("first"))
        deadline = asyncio.get_running_loop().time() + 30  # generous: a busy machine delays, it does not skip
        while await _signed_size(store) < 1:
            assert asyncio.get_running_loop().time() < deadline, "no checkpoint covered the entry"
            await asyncio.sleep(0.05)
    finally:
        await store.close()


async def _signed_size(store: AuditStore) -> int:
    try:
        return (await store.checkpoint()).tree_size
    except NoSuchCheckpoint:
        return -1


async def test_integration_refuses_to_sign_over_a_tree_changed_behind_its_back(
    database: AuditDatabase,
) -> None:
    store = await database.open()
    try:
        await _integrated(store, 4)
        await database.execute(f"UPDATE tree_nodes SET hash = '{'0' * 64}' WHERE level = 2 AND idx = 0")
        await store.append(entry("later"))
        with pytest.raises(LogDiverged, match="not the one the last checkpoint signed"):
            await store.integrate()
    finally:
        await database.execute("DELETE FROM log_queue")
        await store.close()
    assert (await database.scalar("SELECT max(tree_size) FROM checkpoints")) == 4, "nothing more was signed"


async def test_a_diverged_log_says_so_every_round_until_the_database_is_put_right(
    database: AuditDatabase,
) -> None:
    store = await database.open(checkpoint_interval_s=3600)
    try:
        await _integrated(store, 4)
        good = await database.scalar("SELECT hash FROM tree_nodes WHERE level = 2 AND idx = 0")
        await database.execute(f"UPDATE tree_nodes SET hash = '{'0' * 64}' WHERE level = 2 AND idx = 0")
        await store.append(entry("later"))
        assert store.diverged is None, "nothing is known before a round looks"
        for _ in range(3):
            with pytest.raises(LogDiverged):
                await store.integrate()
        assert store.diverged is not None and "not the one the last checkpoint signed" in store.diverged

        await database.execute(f"UPDATE tree_nodes SET hash = '{good}' WHERE level = 2 AND idx = 0")
        assert (await store.integrate()) is not None
        assert store.diverged is None, "a round that signs clears it"
    finally:
        await store.close()

    rounds = await database.open(checkpoint_interval_s=0.05)
    sink = io.StringIO()
    configure_logging("info", sink)
    try:
        await database.execute(f"UPDATE tree_nodes SET hash = '{'0' * 64}' WHERE level = 2 AND idx = 0")
        await rounds.append(entry("even-later"))
        deadline = asyncio.get_running_loop().time() + 30
        while sink.getvalue().count('"audit_integration_failed"') < 3:
            assert asyncio.get_running_loop().time() < deadline, sink.getvalue()[-2000:]
            await asyncio.sleep(0.05)
        assert rounds.diverged is not None
    finally:
        await database.execute("DELETE FROM log_queue")
        await rounds.close()
        configure_logging("info", sys.stderr)
    failed = [
        json.loads(line) for line in sink.getvalue().splitlines() if '"audit_integration_failed"' in line
    ]
    assert {(line["level"], line["kind"]) for line in failed} == {("error", "LogDiverged")}


async def test_integration_refuses_a_log_rewound_below_what_it_signed(database: AuditDatabase) -> None:
    store = await database.open()
    try:
        await _integrated(store, 3)
        await database.execute(
            "DELETE FROM checkpoints WHERE tree_size > 0",
            "DELETE FROM tree_nodes",
            "DELETE FROM log_leaves",
        )
        with pytest.raises(LogDiverged, match="rewound"):
            await store.integrate()
    finally:
        await store.close()


async def test_what_a_record_says_of_its_stack_comes_from_hashed_bytes(store: AuditStore) -> None:
    await store.append(entry("upstream", stack_declared=True))
    await store.append(entry("proved"))
    upstream, proved = await store.get_record("upstream", None), await store.get_record("proved", None)
    assert upstream is not None and proved is not None
    assert (upstream.stack_declared, proved.stack_declared) == (True, False)
    assert upstream.entries[0].stack_declared is True
