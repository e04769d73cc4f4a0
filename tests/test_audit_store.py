"""The audit store on real SQLite and PostgreSQL: appends, reads, tenancy, group commit and tamper detection."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from proxy.audit import (
    AuditStore,
    DuplicateEntry,
    RecordCounts,
    RecordFilter,
    RecordSummary,
    StoreClosed,
    UnknownStack,
    stack_fingerprint,
)
from proxy.audit.chain import GENESIS_SHA256
from tests.audit_databases import KINDS, STACK, T0, AuditDatabase, audit_database, entry

FINGERPRINT = stack_fingerprint(STACK)


@pytest.fixture(params=KINDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditDatabase]:
    async with audit_database(request.param, tmp_path) as db:
        await db.migrate()
        yield db


@pytest.fixture
async def store(database: AuditDatabase) -> AsyncIterator[AuditStore]:
    opened = await database.open()
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


async def test_appends_are_chained_and_survive_reopening(database: AuditDatabase) -> None:
    store = await database.open()
    stored = [await store.append(entry(f"r{i}", seconds=i)) for i in range(5)]
    await store.close()

    assert [s.position for s in stored] == [1, 2, 3, 4, 5]
    assert stored[0].prev_sha256 == GENESIS_SHA256
    assert all(b.prev_sha256 == a.sha256 for a, b in itertools.pairwise(stored))

    reopened = await database.open()
    try:
        record = await reopened.get_record("r3", tenant="acme")
        report = await reopened.verify()
        after = await reopened.append(entry("r5"))
    finally:
        await reopened.close()
    assert record is not None
    assert record.entries[0].sha256 == stored[3].sha256
    assert record.created_at == T0 + timedelta(seconds=3)
    assert record.stack == STACK and record.fingerprint == FINGERPRINT and record.stack_declared is False
    assert record.prompt_text == "You are terse."
    assert record.entries[0].content["response"]["token_logprobs"] == [-0.125, -1.5e-7, -3.25]
    assert report.ok and report.entries_checked == 5 and report.head == (5, stored[-1].sha256)
    assert (after.position, after.prev_sha256) == (6, stored[-1].sha256), (
        "a reopened store continues the chain"
    )


async def test_concurrent_appends_share_commits_and_get_contiguous_positions(database: AuditDatabase) -> None:
    batches = Batches()
    store = await database.open(observer=batches, batch_max=64)
    try:
        stored = await asyncio.gather(*(store.append(entry(f"c{i}")) for i in range(300)))
        report = await store.verify()
    finally:
        await store.close()
    assert sorted(s.position for s in stored) == list(range(1, 301))
    assert report.ok and report.entries_checked == 300
    assert sum(batches.sizes) == 300
    assert max(batches.sizes) > 1, "concurrent appends must share group commits"
    assert max(batches.sizes) <= 64


async def test_verifying_while_appends_go_on_finds_nothing_wrong(database: AuditDatabase) -> None:
    store = await database.open(batch_max=4)
    try:
        await store.append(entry("first"))
        appends = asyncio.gather(*(store.append(entry(f"c{i}")) for i in range(120)))
        reports = [await store.verify(page_size=7) for _ in range(5)]
        links = [await store.verify_record(f"c{i}") for i in range(0, 120, 10)]
        await appends
        final = await store.verify()
    finally:
        await store.close()
    assert all(r.ok for r in reports), [r.problem for r in reports if not r.ok]
    assert all(check.ok for checks in links for check in checks)
    assert final.ok and final.head_position == 121


async def test_two_stores_on_one_database_build_one_chain(database: AuditDatabase) -> None:
    """Several proxies on one database: each append locks the head, so the chain never forks."""
    first, second = await database.open(batch_max=8), await database.open(batch_max=8)
    try:
        stored = await asyncio.gather(
            *(
                store.append(entry(f"{name}{i}"))
                for i in range(60)
                for name, store in (("a", first), ("b", second))
            )
        )
        report = await first.verify()
    finally:
        await first.close()
        await second.close()
    assert sorted(s.position for s in stored) == list(range(1, 121))
    assert report.ok, report.problem
    assert report.head_position == 120


async def test_a_tenant_reads_only_its_own_records(store: AuditStore) -> None:
    await store.append(entry("mine", tenant="acme"))
    await store.append(entry("theirs", tenant="globex"))

    assert await store.get_record("theirs", tenant="acme") is None
    assert await store.get_record("nonexistent", tenant="acme") is None
    mine = await store.get_record("mine", tenant="acme")
    assert mine is not None and mine.tenant == "acme"
    assert (await store.get_record("theirs", tenant=None)) is not None, "tenant=None is the operator's view"
    assert [r.id for r in await store.list_records(tenant="acme")] == ["mine"]


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
    assert [e.position for e in record.entries] == [1, 3]
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
    report = await store.verify()
    assert report.ok and report.head_position == 7


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
        assert record is not None and record.entries[0].position == stored.position
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
    assert (first.position, second.position) == (1, 2)


async def test_numbers_survive_storage_bit_for_bit(store: AuditStore) -> None:
    numbers = [2.0**60, -0.0, 5e-324, 0.1, 1e300, 2**53 - 1, -3.2500000000000004]
    await store.append(entry("n", content={"numbers": numbers}))
    record = await store.get_record("n", tenant="acme")
    assert record is not None
    assert [repr(x) for x in record.entries[0].content["numbers"]] == [
        repr(x) for x in [2.0**60, 0, *numbers[2:]]
    ]
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
    assert sorted(s.position for s in stored) == list(range(1, 21))
    assert report.ok and report.head_position == 20


async def test_an_unknown_durability_is_refused(database: AuditDatabase) -> None:
    with pytest.raises(ValueError, match="durability must be 'disk' or 'process'"):
        await database.open(durability="fast")


async def test_an_empty_log_verifies_at_the_genesis_head(store: AuditStore) -> None:
    report = await store.verify()
    assert report.ok and report.entries_checked == 0
    assert report.head == (0, GENESIS_SHA256)


async def test_sqlite_keeps_its_log_in_wal_mode(tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        store = await db.open(create_if_empty=True)
        try:
            await store.append(entry("r1"))
        finally:
            await store.close()
        assert await db.scalar("PRAGMA journal_mode") == "wal"


async def test_close_commits_what_is_queued_and_refuses_more(database: AuditDatabase) -> None:
    store = await database.open(batch_max=4)
    pending = [asyncio.ensure_future(store.append(entry(f"q{i}"))) for i in range(20)]
    await asyncio.sleep(0)  # let every append reach the queue
    await store.close()
    assert sorted(p.result().position for p in pending) == list(range(1, 21))
    with pytest.raises(StoreClosed):
        await store.append(entry("late"))

    reopened = await database.open()
    try:
        assert (await reopened.verify()).head_position == 20
        await reopened.ping()
    finally:
        await reopened.close()


# Tampering: each edit to a chain of ten entries, and where verification must locate it.
async def _tampered_chain(database: AuditDatabase) -> tuple[AuditStore, list[str]]:
    store = await database.open()
    stored = [await store.append(entry(f"t{i}")) for i in range(1, 11)]
    return store, [s.sha256 for s in stored]


SWAP_3_AND_4 = (
    "UPDATE entries SET position = 1000003 WHERE position = 3",
    "UPDATE entries SET position = 3 WHERE position = 4",
    "UPDATE entries SET position = 4 WHERE position = 1000003",
)


@pytest.mark.parametrize(
    ("statements", "kind", "position", "record_id"),
    [
        (["UPDATE entries SET content = '{\"forged\":true}' WHERE position = 4"], "hash_mismatch", 4, "t4"),
        (
            ["UPDATE entries SET content = replace(content, ',', ', ') WHERE position = 4"],
            "content_not_canonical",
            4,
            "t4",
        ),
        (["UPDATE entries SET status = 'forged' WHERE position = 6"], "hash_mismatch", 6, "t6"),
        ([f"UPDATE entries SET sha256 = '{'e' * 64}' WHERE position = 5"], "hash_mismatch", 5, "t5"),
        (list(SWAP_3_AND_4), "prev_mismatch", 3, "t4"),
        (["DELETE FROM entries WHERE position = 7"], "gap", 8, "t8"),
        (["DELETE FROM entries WHERE position = 1"], "gap", 2, "t2"),
        (["DELETE FROM entries WHERE position >= 9"], "head_mismatch", 8, None),
        (["UPDATE prompts SET text = 'You are verbose.'"], "prompt_hash_mismatch", None, None),
        (
            ["UPDATE stacks SET canonical_json = replace(canonical_json, 'fp32', 'bf16')"],
            "stack_hash_mismatch",
            None,
            None,
        ),
    ],
    ids=[
        "edited-content",
        "respaced-content",
        "edited-status",
        "edited-hash",
        "swapped-pair",
        "deleted-middle",
        "deleted-first",
        "deleted-tail",
        "edited-prompt",
        "edited-stack",
    ],
)
async def test_tampering_is_detected_and_located(
    database: AuditDatabase, statements: list[str], kind: str, position: int | None, record_id: str | None
) -> None:
    store, _ = await _tampered_chain(database)
    try:
        assert (await store.verify()).ok
        await database.execute(*statements)
        report = await store.verify(page_size=3)  # the walk crosses pages, as it does on a long log
    finally:
        await store.close()
    assert not report.ok
    assert report.problem is not None
    assert (report.problem.kind, report.problem.position, report.problem.record_id) == (
        kind,
        position,
        record_id,
    )


async def test_a_deleted_tail_with_a_rewound_head_is_caught_by_the_kept_head(database: AuditDatabase) -> None:
    store, hashes = await _tampered_chain(database)
    try:
        kept = (await store.verify()).head
        await database.execute(
            "DELETE FROM entries WHERE position >= 9",
            f"UPDATE chain_head SET position = 8, sha256 = '{hashes[7]}'",
        )
        unanchored = await store.verify()
        anchored = await store.verify(expect_head=kept)
        older_anchor = await store.verify(expect_head=(5, hashes[4]))
    finally:
        await store.close()
    assert kept == (10, hashes[9])
    assert unanchored.ok, "without an anchor a cut tail looks like a shorter log"
    assert not anchored.ok and anchored.problem is not None
    assert anchored.problem.kind == "expect_head_mismatch"
    assert "position 10" in anchored.problem.message
    assert older_anchor.ok, "an anchor taken earlier still matches a log that only grew"


async def test_an_entry_slipped_past_the_head_is_detected(database: AuditDatabase) -> None:
    store, hashes = await _tampered_chain(database)
    try:
        await database.execute(
            "INSERT INTO entries (position, record_id, part, tenant, created_at, status, content, sha256, prev_sha256)"
            f" VALUES (11, 'slipped', 'answer', 'acme', '2026-01-02 03:04:05', 'ok', '{{}}', '{'1' * 64}',"
            f" '{hashes[9]}')"
        )
        report = await store.verify()
    finally:
        await store.close()
    assert report.problem is not None and report.problem.kind == "head_mismatch"
    assert "beyond the stored head" in report.problem.message


async def test_verify_record_checks_an_entry_against_its_neighbours(database: AuditDatabase) -> None:
    store, _ = await _tampered_chain(database)
    try:
        intact = await store.verify_record("t5")
        last = await store.verify_record("t10")
        await database.execute("UPDATE entries SET content = '{\"forged\":true}' WHERE position = 5")
        forged = await store.verify_record("t5")
        missing = await store.verify_record("nobody")
    finally:
        await store.close()
    assert [(c.position, c.ok) for c in intact] == [(5, True)]
    assert last[0].next_links is None and last[0].ok
    assert (forged[0].recomputes, forged[0].prev_matches, forged[0].next_links) == (False, True, True)
    assert missing == []
