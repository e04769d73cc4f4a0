"""Group commit, the sequencing half of the log: concurrent appends share one transaction, and each returns only
after that commit.

A caller's entry goes on a queue with a future. One writer task takes up to `batch_max` entries (waiting at
most `batch_wait_ms` for more once the first arrives) and, in ONE transaction, stores stacks and prompts not
stored yet, gives the entries contiguous sequence numbers, inserts them, queues the batch for integration
(one row: its first number, its size, its entries' leaf hashes), and commits; then it resolves every future, or fails them all with the error. While one
batch commits the next one gathers, so under load the cost of a durable commit is shared by everyone waiting.

No lock is shared by the proxies: on PostgreSQL a batch takes one block of numbers from a sequence, which never
waits for another transaction, and an entry's bytes do not depend on any other entry, so they are hashed before
the transaction begins. Putting entries into the Merkle tree and signing checkpoints is the integrator's work
(`integrate.py`). This module knows nothing of reading records.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from proxy.audit.batch import NOTHING_TO_ERASE, EntryRefused, plan_batch
from proxy.audit.errors import (
    AuditError,
    DuplicateEntry,
    NotErasable,
    StoreClosed,
    StoreUnavailable,
    UnknownStack,
    failure_reason,
)
from proxy.audit.models import SEQUENCE_BLOCK
from proxy.audit.sealed import SealedEntry
from proxy.audit.values import StoredEntry
from proxy.audit.writer import BatchWriter

log = structlog.get_logger(__name__)

# Known-stack and known-prompt caches only save a round trip; past this size they start over.
CACHE_LIMIT = 10_000


class CommitObserver(Protocol):
    """Where the committer reports what it does (the proxy turns these into its stackpin_audit_* metrics)."""

    def committed(self, batch_size: int, seconds: float) -> None: ...

    def queue_depth(self, depth: int) -> None: ...


@dataclass
class _Pending:
    entry: SealedEntry
    receipt: str | None  # the log's receipt for it, stored with it
    future: asyncio.Future[StoredEntry] = field(repr=False)

    def resolve(self, stored: StoredEntry) -> None:
        if not self.future.done():  # the caller may have given up; the entry is committed all the same
            self.future.set_result(stored)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class GroupCommitter:
    def __init__(
        self,
        writer: BatchWriter,
        *,
        batch_max: int,
        batch_wait_ms: float,
        observer: CommitObserver | None = None,
    ) -> None:
        self._writer = writer
        if batch_max > SEQUENCE_BLOCK:
            raise ValueError(f"batch_max must be at most {SEQUENCE_BLOCK}, got {batch_max}")
        self._batch_max = batch_max
        self._batch_wait_s = batch_wait_ms / 1000.0
        self._observer = observer
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._closing = False
        self._known_stacks: set[str] = set()
        self._known_prompts: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="audit-group-commit")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def submit(self, entry: SealedEntry, receipt: str | None = None) -> StoredEntry:
        if self._closing or not self.alive:
            raise StoreClosed("the audit store is closed; no entry can be appended")
        pending = _Pending(entry, receipt, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(pending)
        self._report_depth()
        return await pending.future

    async def close(self) -> None:
        """Commits everything queued so far, then stops the writer."""
        if self._task is None:
            return
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(None)
        await asyncio.gather(self._task, return_exceptions=True)
        # Only reached with entries left if the writer died: their callers must not wait forever.
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if pending is not None:
                pending.fail(StoreClosed("the audit store closed before this entry was committed"))

    async def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = await self._collect()
            try:
                await self._commit_batch(batch)
            # The writer must outlive any one batch, or every later append would wait forever.
            except Exception as exc:
                log.exception("audit_batch_failed", batch_size=len(batch))
                _fail_each(batch, exc)

    async def _collect(self) -> tuple[list[_Pending], bool]:
        """The next batch, and whether the stop mark was reached."""
        first = await self._queue.get()
        if first is None:
            return [], True
        batch = [first]
        deadline = asyncio.get_running_loop().time() + self._batch_wait_s
        while len(batch) < self._batch_max:
            if self._queue.empty():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):
                        item = await self._queue.get()
                except TimeoutError:
                    break
            else:
                item = self._queue.get_nowait()
            if item is None:
                return batch, True
            batch.append(item)
        self._report_depth()
        return batch, False

    def _report_depth(self) -> None:
        if self._observer is not None:
            try:
                self._observer.queue_depth(self._queue.qsize())
            except Exception:
                log.exception("audit_observer_failed")

    def _report_commit(self, batch_size: int, started: float) -> None:
        if self._observer is not None:
            try:
                self._observer.committed(batch_size, time.perf_counter() - started)
            except Exception:
                log.exception("audit_observer_failed")

    async def _commit_batch(self, batch: list[_Pending]) -> None:
        batch = self._drop_duplicates_within(batch)
        if not batch:
            return
        started = time.perf_counter()
        try:
            committed = await self._transaction(batch)
        except EntryRefused:
            # Someone's entry collides with one already stored: commit the others one by one, so that only
            # the offender fails.
            await self._commit_each(batch)
            return
        except Exception as exc:
            log.error("audit_batch_failed", batch_size=len(batch), error=failure_reason(exc))
            _fail_each(batch, exc)
            return
        self._resolve(committed, started)

    async def _commit_each(self, batch: list[_Pending]) -> None:
        for pending in batch:
            started = time.perf_counter()
            try:
                committed = await self._transaction([pending])
            except EntryRefused as exc:
                pending.fail(_explain_refusal(pending.entry, exc))
                continue
            except Exception as exc:
                log.error("audit_batch_failed", batch_size=1, error=failure_reason(exc))
                _fail_each([pending], exc)
                continue
            self._resolve(committed, started)

    def _resolve(self, committed: list[tuple[_Pending, StoredEntry]], started: float) -> None:
        for pending, stored in committed:
            pending.resolve(stored)
        if committed:
            self._report_commit(len(committed), started)

    @staticmethod
    def _drop_duplicates_within(batch: list[_Pending]) -> list[_Pending]:
        seen: set[tuple[str, str]] = set()
        kept: list[_Pending] = []
        for pending in batch:
            key = (pending.entry.record_id, pending.entry.part)
            if pending.entry.part != "flag" and key in seen:
                pending.fail(_duplicate(pending.entry))
                continue
            seen.add(key)
            kept.append(pending)
        return kept

    async def _transaction(self, batch: list[_Pending]) -> list[tuple[_Pending, StoredEntry]]:
        """Commits what it can of `batch` in one transaction; entries it refuses are failed, not returned."""
        planned = plan_batch(((p.entry, p.receipt) for p in batch), self._known_stacks, self._known_prompts)
        written = await self._writer.write(planned)
        self._remember(self._known_stacks, written.found_stacks | written.new_stacks)
        self._remember(self._known_prompts, written.new_prompts)
        committed = []
        for pending, planned_entry in zip(batch, planned.entries, strict=True):
            if pending.entry.fingerprint in written.missing_stacks:
                pending.fail(
                    UnknownStack(
                        f"stack {pending.entry.fingerprint} was never stored: "
                        "pass `stack` with the first entry that names it"
                    )
                )
            else:
                committed.append((pending, planned_entry))
        return [
            (
                pending,
                StoredEntry(
                    record_id=pending.entry.record_id,
                    part=pending.entry.part,
                    seq=seq,
                    sha256=planned_entry.row["sha256"],
                    leaf_hash=planned_entry.leaf_hash,
                    created_at=pending.entry.created_at,
                    receipt=pending.receipt,
                ),
            )
            for (pending, planned_entry), seq in zip(committed, written.seqs, strict=True)
        ]

    @staticmethod
    def _remember(cache: set[str], keys: set[str]) -> None:
        if len(cache) + len(keys) > CACHE_LIMIT:
            cache.clear()
        cache.update(keys)


def _fail_each(batch: list[_Pending], exc: Exception) -> None:
    """Fails every caller of a batch with an exception of its own: one shared object, raised again in every
    caller's task, would carry every caller's traceback."""
    reason = failure_reason(exc)
    for pending in batch:
        pending.fail(StoreUnavailable(f"the audit store could not commit ({reason})"))


def _duplicate(entry: SealedEntry) -> DuplicateEntry:
    return DuplicateEntry(
        f"record {entry.record_id} already has an {entry.part!r} entry; records are append-only"
    )


def _explain_refusal(entry: SealedEntry, exc: EntryRefused) -> AuditError:
    if exc.reason.startswith(NOTHING_TO_ERASE):
        return NotErasable(f"record {entry.record_id}: {exc.reason}")
    reason = exc.reason.lower()
    if "uq_entries_record_part" in reason or "unique" in reason:
        return _duplicate(entry)
    return AuditError(f"the database refused entry {entry.part!r} of record {entry.record_id}: {exc.reason}")
