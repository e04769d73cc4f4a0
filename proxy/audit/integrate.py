"""Integration, the second half of the log: queued entries become leaves of the Merkle tree, and each new tree
is signed as a checkpoint.

Every proxy runs an integrator, and one at a time does the work: on PostgreSQL each round's transaction takes a
transaction-scoped advisory lock with `pg_try_advisory_xact_lock`, and a proxy that does not get it skips the
round, so nothing on the request path ever waits for it; on SQLite the transaction's `BEGIN IMMEDIATE` already
admits one writer. A round reads the queue in sequence order, appends the leaves to the stored tree (only its
O(log n) peaks are read) with their hashes, stores every inner node they complete, deletes their batches from
the queue, and signs and stores
the checkpoint of the new size, all in one transaction.

Before it signs, a round checks that the stored tree is the one the last checkpoint signed, and that no
checkpoint the integrator saw itself has gone (a rewound log): a log must never sign a tree inconsistent with
one it signed before. When that check fails it stops signing, and says so in its log every round and in
`diverged` (which the proxy's readiness and metrics read) until the database is put right; `stackpin verify`
says what changed. The queue is read with its leaf hashes; a queued entry without one (a chained entry, queued
by the migration) is hashed from its row here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import structlog
from sqlalchemy import Connection, delete, insert, select, text

from proxy.audit.errors import LogDiverged
from proxy.audit.merkle import fold, grow, leaf_hash
from proxy.audit.models import Entry, LogCheckpoint, LogQueue
from proxy.audit.note import Checkpoint, Signer, sign_note
from proxy.audit.statements import DialectName, integration_statements
from proxy.audit.tree import b64, latest_checkpoint, leaf_count, peak_hashes, stored_fields
from proxy.audit.values import SignedCheckpoint
from proxy.audit.writer import TransactionRunner

log = structlog.get_logger(__name__)

CHUNK = 4096  # leaves per round's transaction
# How long closing waits for a round under way before it cancels it (a database gone away).
_ROUND_FINISH_S = 10.0
# PostgreSQL names advisory locks by two numbers: this class, and a hash of the schema, so that logs in other
# schemas of one server never wait for each other.
LOCK_CLASS = 0x53544C47


@dataclass(frozen=True)
class Round:
    """What one integration round did: the latest checkpoint after it (None when another proxy held the lock),
    and whether the queue may hold more."""

    checkpoint: SignedCheckpoint | None
    more: bool = False


def _dialect_name(connection: Connection) -> DialectName:
    return "postgresql" if connection.dialect.name == "postgresql" else "sqlite"


def _locked(connection: Connection) -> bool:
    if connection.dialect.name != "postgresql":
        return True
    query = text("SELECT pg_try_advisory_xact_lock(:class, hashtext(current_schema()))")
    return bool(connection.execute(query, {"class": LOCK_CLASS}).scalar())


def _queued(connection: Connection, chunk: int) -> tuple[list[int], list[tuple[int, bytes]], bool]:
    """Whole batches from the queue, in sequence order, up to `chunk` entries (at least one batch): their first
    numbers, every entry's (seq, leaf hash), and whether more are queued."""
    rows = connection.execute(
        select(LogQueue.first_seq, LogQueue.count, LogQueue.leaf_hashes)
        .order_by(LogQueue.first_seq)
        .limit(chunk)
    ).all()
    firsts: list[int] = []
    leaves: list[tuple[int, bytes]] = []
    for first, count, hashes in rows:
        if firsts and len(leaves) + count > chunk:
            return firsts, leaves, True
        firsts.append(int(first))
        leaves += _batch_leaves(connection, int(first), int(count), hashes)
    return firsts, leaves, len(rows) == chunk


def _batch_leaves(
    connection: Connection, first: int, count: int, hashes: str | None
) -> list[tuple[int, bytes]]:
    seqs = range(first, first + count)
    if hashes is not None:
        return [(seq, bytes.fromhex(hashes[64 * i : 64 * i + 64])) for i, seq in enumerate(seqs)]
    rows = connection.execute(
        select(Entry.__table__).where(Entry.seq >= first, Entry.seq < first + count).order_by(Entry.seq)
    ).mappings()
    found = [(int(row["seq"]), leaf_hash(stored_fields(row).text().encode("utf-8"))) for row in rows]
    if [seq for seq, _ in found] != list(seqs):
        raise LogDiverged(f"the queued entries {first} to {first + count - 1} are not all stored any more")
    return found


def integrate_round(
    connection: Connection,
    *,
    signer: Signer,
    now: datetime,
    seen: SignedCheckpoint | None,
    chunk: int = CHUNK,
) -> Round:
    """One round's transaction body; raises LogDiverged rather than sign a tree inconsistent with the past."""
    if not _locked(connection):
        return Round(None)
    latest = latest_checkpoint(connection)
    size = leaf_count(connection)
    peaks = peak_hashes(connection, size)
    _check_history(latest, seen, size, fold([h for _, h in peaks]))
    batches, queued, more = _queued(connection, chunk)
    if not queued and latest is not None:
        return Round(latest)
    growth = grow(size, peaks, [digest for _, digest in queued])
    if queued:
        # Straight to the driver: thousands of rows a round, whose per-row handling in SQLAlchemy cost more
        # than the hashing. The statements and the rows' value conversions come from the models.
        statements = integration_statements(_dialect_name(connection))
        leaf, node = statements.insert_leaf, statements.insert_node
        connection.exec_driver_sql(
            leaf.sql,
            [
                leaf.row({"leaf_index": size + i, "seq": seq, "leaf_hash": h.hex()})
                for i, (seq, h) in enumerate(queued)
            ],
        )
        inner = [
            node.row({"level": lv, "idx": idx, "hash": h.hex()}) for (lv, idx), h in growth.nodes if lv > 0
        ]
        if inner:
            connection.exec_driver_sql(node.sql, inner)
        connection.execute(delete(LogQueue).where(LogQueue.first_seq.in_(batches)))
    new_size = size + len(queued)
    note = sign_note(Checkpoint(signer.name, new_size, growth.root).text, signer).render()
    connection.execute(
        insert(LogCheckpoint),
        [{"tree_size": new_size, "root_hash": growth.root.hex(), "note": note, "signed_at": now}],
    )
    signed = SignedCheckpoint(tree_size=new_size, root_hash=b64(growth.root), note=note)
    return Round(signed, more=more)


def _check_history(
    latest: SignedCheckpoint | None, seen: SignedCheckpoint | None, size: int, root: bytes
) -> None:
    if latest is None:
        if size:
            raise LogDiverged(f"the stored tree has {size} leaves but no checkpoint signs any of them")
    elif (latest.tree_size, latest.root_hash) != (size, b64(root)):
        raise LogDiverged(
            f"the stored tree (size {size}, root {b64(root)}) is not the one the last checkpoint signed "
            f"(size {latest.tree_size}, root {latest.root_hash})"
        )
    if seen is not None and (latest is None or latest.tree_size < seen.tree_size):
        raise LogDiverged(
            f"this proxy saw a checkpoint of size {seen.tree_size}; the database's latest is now "
            f"{latest.tree_size if latest else 'none'} (the log was rewound)"
        )


class Integrator:
    """Runs rounds every `interval_s` while the store is open; `integrate()` runs them now, until the queue is
    empty."""

    def __init__(
        self,
        runner: TransactionRunner,
        signer: Signer,
        *,
        interval_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._runner = runner
        self._signer = signer
        self._interval_s = interval_s
        self._clock = clock
        self._seen: SignedCheckpoint | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._lock = asyncio.Lock()
        self._last_error: str | None = None
        self._diverged: str | None = None

    @property
    def diverged(self) -> str | None:
        """Why the log refuses to integrate (the last round's LogDiverged), or None; cleared by a round that signs."""
        return self._diverged

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="audit-integrator")

    async def close(self) -> None:
        """Stops the rounds, then integrates what is queued (when no other proxy is doing it).

        A round under way is let finish, for a while: cancelled mid-transaction, it would leave its connection
        to be reclaimed at the pool's timeout, and the closing round would wait that long for it."""
        if self._task is not None:
            self._stopping.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), _ROUND_FINISH_S)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.integrate()

    async def integrate(self) -> SignedCheckpoint | None:
        """Rounds until the queue is empty; the latest checkpoint, or None when another proxy is integrating."""
        async with self._lock:
            while True:
                try:
                    result = await self._runner.run(
                        partial(integrate_round, signer=self._signer, now=self._clock(), seen=self._seen)
                    )
                except LogDiverged as exc:
                    self._diverged = str(exc)
                    raise
                if result.checkpoint is not None:  # None: another proxy held the round, which says nothing
                    self._seen, self._diverged = result.checkpoint, None
                if not result.more:
                    return result.checkpoint

    async def _run(self) -> None:
        while True:
            try:
                await self.integrate()
                self._last_error = None
            except Exception as exc:
                # A diverged log is a line every round: no answer from now on can be proven until someone puts the
                # database right, and one line scrolled away is easy to miss. Other failures (the database away)
                # are a line each time they change: the store's own errors already say it is away.
                if isinstance(exc, LogDiverged) or str(exc) != self._last_error:
                    log.error("audit_integration_failed", error=str(exc), kind=type(exc).__name__)
                    self._last_error = str(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            if self._stopping.is_set():
                return
