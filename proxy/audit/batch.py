"""One group commit's transaction: what it writes (`Batch`, built on the event loop from the entries) and its body on
each driver's own API, `sqlite3` and asyncpg, with the statements `statements.py` compiles from the models.

The body checks that every stack an entry names without giving it is stored, stores the stacks and prompts not
stored yet, erases the payloads an erasure entry names, takes a block of contiguous sequence numbers, inserts the
entries with their payloads beside them and queues the batch for integration, all in the caller's one transaction.
It knows nothing of futures, queues or caches: `commit.py` decides what a batch holds and settles its callers;
`writer.py` owns connections, threads and transactions.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg

from proxy.audit.sealed import SealedEntry
from proxy.audit.statements import PAYLOAD_ARRAYS, CommitStatements, commit_statements

# How the body refuses an erasure whose payloads are no longer all there (another erased them first): it fails
# alone, and its caller reads the record again.
NOTHING_TO_ERASE = "nothing left to erase"


class EntryRefused(Exception):
    """The database refused the batch's rows (a constraint); `reason` is the driver's message. Never raised for an
    outage, which is the driver's own error."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BatchEntry:
    fingerprint: str | None
    prompt_sha256: str | None
    row: dict[str, Any]  # the `entries` row, every column but `seq`
    leaf_hash: str  # hex
    payload: tuple[str, str] | None = None  # its salt (hex) and payload text, kept beside it
    erases: tuple[int, ...] = ()  # the entries whose payloads it erases


@dataclass(frozen=True)
class Batch:
    """What one transaction writes. `unsure`: fingerprints named without their stack, not known to be stored."""

    entries: list[BatchEntry]
    unsure: frozenset[str]
    stacks: dict[str, dict[str, Any]]  # fingerprint -> `stacks` row
    prompts: dict[str, dict[str, Any]]  # sha256 -> `prompts` row


@dataclass(frozen=True)
class Written:
    """What one transaction did: the sequence numbers of the entries it stored (in the batch's order, those naming
    a missing stack left out), and what it learnt on the way."""

    seqs: list[int]
    missing_stacks: set[str]
    found_stacks: set[str]
    new_stacks: set[str]
    new_prompts: set[str]


def entry_row(entry: SealedEntry, seq: int, receipt: str | None = None) -> dict[str, Any]:
    """The `entries` row of `entry` at `seq`, by column name: the fields its bytes hold, their hash, and the log's
    receipt for it."""
    row = entry.values()
    row.update(seq=seq, content=entry.content_json, sha256=entry.sha256, prev_sha256=None, receipt=receipt)
    return row


def plan_batch(
    entries: Iterable[tuple[SealedEntry, str | None]], known_stacks: set[str], known_prompts: set[str]
) -> Batch:
    """The batch for `entries` (each with its receipt), skipping stacks and prompts already known to be stored.
    Hashing happens before, when an entry is sealed (an entry's bytes depend on no other entry), once per entry."""
    planned: list[BatchEntry] = []
    stacks: dict[str, dict[str, Any]] = {}
    prompts: dict[str, dict[str, Any]] = {}
    for entry, receipt in entries:
        row = entry_row(entry, 0, receipt)
        del row["seq"]
        fingerprint, prompt_sha = row["fingerprint"], row["prompt_sha256"]
        payload = None
        if entry.payload_json is not None and entry.salt is not None:
            payload = (entry.salt.hex(), entry.payload_json)
        planned.append(BatchEntry(fingerprint, prompt_sha, row, entry.leaf_hash.hex(), payload, entry.erases))
        if fingerprint is not None and fingerprint not in known_stacks and fingerprint not in stacks:
            stack_json = entry.stack_json
            if stack_json is not None:
                stacks[fingerprint] = {
                    "fingerprint": fingerprint,
                    "canonical_json": stack_json,
                    "first_seen": row["created_at"],
                }
        if prompt_sha is not None and prompt_sha not in known_prompts and prompt_sha not in prompts:
            prompts[prompt_sha] = {"sha256": prompt_sha, "text": entry.prompt_text}
    unsure = {e.fingerprint for e in planned if e.fingerprint is not None} - stacks.keys() - known_stacks
    return Batch(planned, frozenset(unsure), stacks, prompts)


@dataclass(frozen=True)
class _Rows:
    """The parameters of a batch once its first sequence number is known."""

    kept: list[BatchEntry]
    stacks: list[tuple[Any, ...]]
    prompt_keys: set[str]
    prompts: list[tuple[Any, ...]]

    def entries(self, statements: CommitStatements, first: int) -> list[tuple[Any, ...]]:
        insert = statements.insert_entry
        return [insert.row({**e.row, "seq": first + i}) for i, e in enumerate(self.kept)]

    def payloads(self, statements: CommitStatements, first: int) -> list[tuple[Any, ...]]:
        insert, rows = statements.insert_payload, []
        for i, e in enumerate(self.kept):
            if e.payload is not None:
                salt, text = e.payload
                row = {"seq": first + i, "tenant": e.row["tenant"], "created_at": e.row["created_at"]}
                rows.append(insert.row({**row, "salt": salt, "payload": text}))
        return rows

    @property
    def erasing(self) -> bool:
        return any(e.erases for e in self.kept)

    def queue(self, statements: CommitStatements, first: int) -> tuple[Any, ...]:
        hashes = "".join(e.leaf_hash for e in self.kept)
        return statements.insert_queue.row(
            {"first_seq": first, "count": len(self.kept), "leaf_hashes": hashes}
        )

    def written(self, batch: Batch, first: int, found: set[str]) -> Written:
        missing = set(batch.unsure - found)
        if not self.kept:
            return Written([], missing, found, set(), set())
        seqs = list(range(first, first + len(self.kept)))
        return Written(seqs, missing, found, set(batch.stacks), self.prompt_keys)


def _rows(batch: Batch, statements: CommitStatements, found: set[str]) -> _Rows:
    missing = batch.unsure - found
    kept = [e for e in batch.entries if e.fingerprint not in missing]
    prompt_keys = {e.prompt_sha256 for e in kept if e.prompt_sha256 is not None} & batch.prompts.keys()
    return _Rows(
        kept,
        [statements.insert_stack.row(row) for row in batch.stacks.values()],
        prompt_keys,
        [statements.insert_prompt.row(batch.prompts[sha]) for sha in sorted(prompt_keys)],
    )


def write_sqlite(cursor: sqlite3.Cursor, batch: Batch) -> Written:
    """The body on `sqlite3`, inside a transaction begun IMMEDIATE: it holds the file's write lock, so the
    largest number plus one is not taken by another process before this commits."""
    statements = commit_statements("sqlite")
    try:
        found = {
            fp
            for fp in batch.unsure
            if cursor.execute(statements.stored_stack.sql, (fp,)).fetchone() is not None
        }
        rows = _rows(batch, statements, found)
        if not rows.kept:
            return rows.written(batch, 0, found)
        if rows.stacks:
            cursor.executemany(statements.insert_stack.sql, rows.stacks)
        if rows.prompts:
            cursor.executemany(statements.insert_prompt.sql, rows.prompts)
        for entry in rows.kept:
            if entry.erases:
                cursor.executemany(statements.erase_payloads.sql, [(seq,) for seq in entry.erases])
                _all_erased(cursor.rowcount, entry)
        first = int(cursor.execute(statements.next_seq.sql).fetchone()[0])
        cursor.executemany(statements.insert_entry.sql, rows.entries(statements, first))
        payloads = rows.payloads(statements, first)
        if payloads:
            cursor.executemany(statements.insert_payload.sql, payloads)
        cursor.execute(statements.insert_queue.sql, rows.queue(statements, first))
    except sqlite3.IntegrityError as exc:
        raise EntryRefused(str(exc)) from exc
    return rows.written(batch, first, found)


def _all_erased(deleted: int, entry: BatchEntry) -> None:
    """An erasure commits only with every payload it names: one erased before it would make it say what is not."""
    if deleted != len(entry.erases):
        raise EntryRefused(
            f"{NOTHING_TO_ERASE}: {len(entry.erases) - deleted} of the payloads were erased already"
        )


async def write_postgres(connection: asyncpg.Connection, batch: Batch) -> Written:
    """The body on asyncpg. The block of numbers comes from a sequence stepping by SEQUENCE_BLOCK, which never
    waits for another proxy's transaction; a block a failed batch leaves unused is a gap, which only orders
    entries and needs no filling. A batch that stores no stack or prompt and names none it is unsure of (the
    usual one) is one statement and one round trip; otherwise a transaction wraps the few statements before it."""
    statements = commit_statements("postgresql")
    try:
        if not (batch.unsure or batch.stacks or batch.prompts or any(e.erases for e in batch.entries)):
            rows = _rows(batch, statements, set())
            return rows.written(batch, await _insert_batch(connection, statements, rows), set())
        async with connection.transaction():
            found = {fp for fp in batch.unsure if await connection.fetchval(statements.stored_stack.sql, fp)}
            rows = _rows(batch, statements, found)
            if not rows.kept:
                return rows.written(batch, 0, found)
            if rows.stacks:
                await connection.executemany(statements.insert_stack.sql, rows.stacks)
            if rows.prompts:
                await connection.executemany(statements.insert_prompt.sql, rows.prompts)
            for entry in rows.kept:
                if entry.erases:
                    status = await connection.execute(statements.erase_payloads.sql, list(entry.erases))
                    _all_erased(int(status.split()[-1]), entry)  # "DELETE <count>"
            return rows.written(batch, await _insert_batch(connection, statements, rows), found)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise EntryRefused(str(exc)) from exc


async def _insert_batch(connection: asyncpg.Connection, statements: CommitStatements, rows: _Rows) -> int:
    """Inserts and queues `rows.kept`; the first number of their block."""
    insert = statements.insert_batch
    assert insert is not None  # compiled for PostgreSQL
    values: dict[str, Any] = {name: [e.row[name] for e in rows.kept] for name in rows.kept[0].row}
    for i, name in enumerate(PAYLOAD_ARRAYS):
        values[name] = [None if e.payload is None else e.payload[i] for e in rows.kept]
    values["count"] = len(rows.kept)
    values["leaf_hashes"] = "".join(e.leaf_hash for e in rows.kept)
    return int(await connection.fetchval(insert.sql, *insert.row(values)))
