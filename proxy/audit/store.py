"""The audit store: the one object the proxy holds to append entries, read records and proofs back, and verify
the log.

It opens the database (refusing a schema that is not at this stackpin's head revision), owns the group
committer that sequences entries (`commit.py`) and, when it is given the log's signing key, the integrator that
puts them in the Merkle tree and signs checkpoints (`integrate.py`), and answers reads. What goes into a
record's content is the proxy's business; how a log is judged is `checks.py`'s; the schema is made only by the
Alembic migrations (`schema.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import exists, func, select, text
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from proxy.audit import erasure, export, listing, proofs
from proxy.audit.commit import CommitObserver, GroupCommitter
from proxy.audit.database import (
    Durability,
    describe,
    make_engine,
    make_integration_runner,
    make_writer,
    parse_url,
)
from proxy.audit.entries import load_canonical
from proxy.audit.errors import (
    AuditError,
    DatabaseUrlError,
    SchemaOutdated,
    SchemaTooNew,
    StoreUnavailable,
    failure_reason,
)
from proxy.audit.header import ERASED, storable
from proxy.audit.integrate import Integrator
from proxy.audit.listing import RecordFilter
from proxy.audit.models import Entry, LogLeaf, Payload, Prompt, Stack
from proxy.audit.note import Signer, Verifier
from proxy.audit.receipts import Receipt, ReceiptSigner
from proxy.audit.schema import HEAD_REVISION, create_schema_if_empty, inspect_database, known_revisions
from proxy.audit.sealed import SealedEntry
from proxy.audit.tree import (
    checkpoint_of_size,
)
from proxy.audit.values import (
    AuditRecord,
    ConsistencyProof,
    EntryCheck,
    EntryView,
    OpenStream,
    RecordCounts,
    RecordProof,
    RecordSummary,
    SignedCheckpoint,
    StoredEntry,
    StreamCounts,
    VerifyReport,
)
from proxy.audit.verify import PAGE_SIZE, Witnessed, verify_log
from proxy.audit.writer import BatchWriter, TransactionRunner

ENTRIES = Entry.__table__
LEAVES = LogLeaf.__table__
PAYLOADS = Payload.__table__
STACKS = Stack.__table__
PROMPTS = Prompt.__table__
LIST_LIMIT_MAX = 1000
SUMMARY_COLUMNS = (
    "record_id",
    "seq",
    "tenant",
    "created_at",
    "model",
    "fingerprint",
    "status",
    "replay_of",
    "part",
)
# How a `closed` entry written by a proxy's start says so: content is canonical JSON (no whitespace, quotes
# inside strings escaped), so this text appears in it only as that key and value.
MARKED_AT_START = '"marked_at_start":true'
RECORD_ID_LENGTH = ENTRIES.c.record_id.type.length


class AuditStore:
    """Open with `await AuditStore.open(url)`; `close()` when done (it commits what is queued first)."""

    def __init__(
        self,
        reader: AsyncEngine,
        writer: BatchWriter,
        integration: TransactionRunner | None,
        committer: GroupCommitter,
        integrator: Integrator | None,
        receipts: ReceiptSigner | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._integration = integration
        self._committer = committer
        self._integrator = integrator
        self._receipts = receipts

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        batch_max: int = 256,
        batch_wait_ms: float = 1.0,
        create_if_empty: bool = False,
        schema: str | None = None,
        observer: CommitObserver | None = None,
        durability: Durability = "disk",
        signer: Signer | None = None,
        checkpoint_interval_s: float = 0.5,
    ) -> AuditStore:
        """Connects to `url` (sqlite+aiosqlite:///file.db or postgresql+asyncpg://...).

        Raises SchemaOutdated when the database is not at HEAD_REVISION; with `create_if_empty`, a
        database that holds no table at all is migrated instead (the embedded default's first run).
        `schema` (PostgreSQL only) names the schema that holds the tables. `durability`: see make_writer.
        With `signer` (the log's key), the store also integrates entries into the tree and signs a checkpoint
        every `checkpoint_interval_s` while entries arrive, and signs a receipt for every entry it appends;
        without it, it only appends (without receipts) and reads.
        """
        if batch_max < 1:
            raise ValueError(f"batch_max must be at least 1, got {batch_max}")
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must not be negative, got {batch_wait_ms}")
        if durability not in ("disk", "process"):
            raise ValueError(f"durability must be 'disk' or 'process', got {durability!r}")
        parsed = parse_url(url)
        if parsed.get_backend_name() == "sqlite" and not create_if_empty:
            # Opening a missing file would create an empty one: a typo in the path must not leave a database
            # behind, nor be reported as a schema to upgrade.
            database = parsed.database or ""
            if not Path(database).is_file():
                raise DatabaseUrlError(
                    f"the audit database {database!r} does not exist; check [store] url (a proxy's first "
                    "start creates it, as does `stackpin db upgrade`)"
                )
        await _ensure_schema(url, schema=schema, create_if_empty=create_if_empty)
        reader = make_engine(parsed, schema=schema, writer=False)
        writer = make_writer(parsed, schema=schema, durability=durability)
        committer = GroupCommitter(
            writer, batch_max=batch_max, batch_wait_ms=batch_wait_ms, observer=observer
        )
        integration, integrator = None, None
        if signer is not None:
            integration = make_integration_runner(parsed, writer, schema=schema, durability=durability)
            integrator = Integrator(integration, signer, interval_s=checkpoint_interval_s)
        committer.start()
        if integrator is not None:
            integrator.start()
        receipts = None if signer is None else ReceiptSigner(signer)
        return cls(reader, writer, integration, committer, integrator, receipts)

    async def append(self, entry: SealedEntry) -> StoredEntry:
        """Appends `entry` (made by `seal`) to the log; returns only once it is committed (durably), before it is
        in the tree, with the log's receipt for it when this store holds the log's key."""
        # Signed before the commit and stored with the entry; handed out only after it, so never for an entry
        # that did not commit.
        receipt = None if self._receipts is None else self._receipts.issue(entry)
        return await self._committer.submit(entry, receipt)

    async def integrate(self) -> SignedCheckpoint | None:
        """Puts every committed entry in the tree now and signs the checkpoint (None: another proxy is at it)."""
        if self._integrator is None:
            raise AuditError("this store has no signing key: it cannot integrate entries or sign checkpoints")
        return await self._integrator.integrate()

    async def close(self) -> None:
        """Commits every entry already queued, integrates it when this store signs, then releases the database."""
        await self._committer.close()
        if self._integrator is not None:
            await self._integrator.close()
        if self._integration is not None and self._integration is not self._writer:
            await self._integration.dispose()
        await self._writer.dispose()
        await self._reader.dispose()

    @property
    def diverged(self) -> str | None:
        """Why this store's log refuses to integrate new entries (LogDiverged), or None while it integrates."""
        return self._integrator.diverged if self._integrator is not None else None

    async def ping(self) -> None:
        """Raises unless the database answers and the writer runs (readiness)."""
        if not self._committer.alive:
            raise AuditError("the audit store's writer is not running")
        async with self._reader.connect() as connection:
            await connection.execute(text("SELECT 1"))

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        """A connection to read on; a database that fails the read is `StoreUnavailable`, one per caller."""
        try:
            async with self._reader.connect() as connection:
                yield connection
        except (DBAPIError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"the audit store cannot be read ({failure_reason(exc)})") from exc

    async def get_record(self, record_id: str, tenant: str | None) -> AuditRecord | None:
        """The record, or None when it does not exist or belongs to another tenant (`tenant=None`: any)."""
        if not _could_be_stored(record_id):
            return None
        async with self._read() as connection:
            rows = (
                (
                    await connection.execute(
                        select(ENTRIES, LEAVES.c.leaf_index, PAYLOADS.c.payload.label("payload_text"))
                        .select_from(
                            ENTRIES.outerjoin(LEAVES, LEAVES.c.seq == ENTRIES.c.seq).outerjoin(
                                PAYLOADS, PAYLOADS.c.seq == ENTRIES.c.seq
                            )
                        )
                        .where(ENTRIES.c.record_id == record_id)
                        .order_by(ENTRIES.c.seq)
                    )
                )
                .mappings()
                .all()
            )
            main = [row for row in rows if row["part"] != "flag"]
            if not main or (tenant is not None and main[0]["tenant"] != tenant):
                return None
            first = main[0]
            stack_row = None
            if first["fingerprint"] is not None:
                stack_row = (
                    await connection.execute(
                        select(STACKS.c.canonical_json).where(STACKS.c.fingerprint == first["fingerprint"])
                    )
                ).one_or_none()
            prompt_sha = next(
                (row["prompt_sha256"] for row in main if row["prompt_sha256"] is not None), None
            )
            prompt_text = None
            if prompt_sha is not None:
                prompt_text = (
                    await connection.execute(select(PROMPTS.c.text).where(PROMPTS.c.sha256 == prompt_sha))
                ).scalar_one_or_none()
        return AuditRecord(
            id=record_id,
            tenant=first["tenant"],
            created_at=first["created_at"],
            model=first["model"],
            fingerprint=first["fingerprint"],
            replica=first["replica"],
            replay_of=first["replay_of"],
            status=main[-1]["status"],
            stack=None if stack_row is None else load_canonical(stack_row.canonical_json),
            stack_declared=_declared(first),
            prompt_sha256=prompt_sha,
            prompt_text=prompt_text,
            entries=[_view(row) for row in main],
            flags=[_view(row) for row in rows if row["part"] == "flag" and row["status"] != ERASED],
            erasures=[_view(row) for row in rows if row["part"] == "flag" and row["status"] == ERASED],
        )

    async def list_records(
        self,
        selected: RecordFilter | None = None,
        *,
        limit: int = 100,
        before: str | None = None,
        after: str | None = None,
        **filters: Any,
    ) -> list[RecordSummary]:
        """Records newest first (by the time of their first entry, `answer` or `opened`).

        Select with a `RecordFilter` or its fields as keywords (`tenant=...`); `since` is inclusive, `until`
        exclusive, and both must carry a time zone. `before`/`after` name a record: the page is the records just
        older (or just newer) than it, newest first either way.
        """
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise ValueError(f"limit must be between 1 and {LIST_LIMIT_MAX}, got {limit}")
        if selected is not None and filters:
            raise TypeError("give a RecordFilter or its fields as keywords, not both")
        selected = selected or RecordFilter(**filters)
        listed = [ENTRIES.c[name] for name in SUMMARY_COLUMNS]  # never the content: it can be large
        async with self._read() as connection:
            cursors = {}
            for name, record_id in (("before", before), ("after", after)):
                if record_id is not None:
                    cursors[name] = await self._cursor(connection, record_id)
            query = listing.page(listed, selected, limit=limit, **cursors)
            starts = list((await connection.execute(query)).mappings().all())
            if after is not None:
                starts.reverse()
            later = await self._later_parts(connection, [row["record_id"] for row in starts])
        return [_summary(row, later.get(row["record_id"], [])) for row in starts]

    async def count_records(self, selected: RecordFilter) -> RecordCounts:
        """How many records `selected` selects, and how many of those are replays and flagged."""
        async with self._read() as connection:
            total, replays, flagged = (await connection.execute(listing.counts(selected))).one()
        return RecordCounts(total=total, replays=replays, flagged=int(flagged))

    @staticmethod
    async def _cursor(connection: Any, record_id: str) -> tuple[datetime, int]:
        if not _could_be_stored(record_id):
            raise ValueError(f"no record {record_id!r} to page from")
        row = (
            await connection.execute(
                select(ENTRIES.c.created_at, ENTRIES.c.seq).where(
                    ENTRIES.c.record_id == record_id, ENTRIES.c.part.in_(listing.FIRST_PARTS)
                )
            )
        ).one_or_none()
        if row is None:
            raise ValueError(f"no record {record_id!r} to page from")
        return row.created_at, row.seq

    @staticmethod
    async def _later_parts(connection: Any, record_ids: Sequence[str]) -> dict[str, list[RowMapping]]:
        if not record_ids:
            return {}
        rows = (
            (
                await connection.execute(
                    select(ENTRIES.c.record_id, ENTRIES.c.part, ENTRIES.c.status)
                    .where(ENTRIES.c.record_id.in_(record_ids), ENTRIES.c.part.in_(("closed", "flag")))
                    .order_by(ENTRIES.c.seq)
                )
            )
            .mappings()
            .all()
        )
        later: dict[str, list[RowMapping]] = {}
        for row in rows:
            later.setdefault(row["record_id"], []).append(row)
        return later

    async def erase(self, record_id: str, policy: erasure.Policy, now: datetime) -> StoredEntry:
        """Erases the record's payload (its request and answer) and appends the entry that says so, in one
        transaction (erasure.py); the erasure entry. NotErasable when the record holds nothing to erase, LookupError
        when there is no such record."""
        if not _could_be_stored(record_id):
            raise LookupError(f"no record {record_id!r}")
        async with self._read() as connection:
            found = await connection.run_sync(erasure.held, record_id)
        if found is None:
            raise LookupError(f"no record {record_id!r}")
        return await self.append(erasure.erasure_entry(found, policy, now))

    async def expired(self, tenant: str, before: datetime, limit: int = 500) -> list[str]:
        """Records of `tenant` whose payloads, kept still, are from before `before` (what retention erases)."""
        if before.tzinfo is None:
            raise ValueError("before must carry a time zone")
        async with self._read() as connection:
            return await connection.run_sync(erasure.expired, tenant, before, limit)

    async def records_served_since(self, replica: str, since: datetime) -> list[str]:
        """Ids of records `replica` served at or after `since`, oldest first: to mark when it changed."""
        if since.tzinfo is None:
            raise ValueError("since must carry a time zone")
        query = (
            select(ENTRIES.c.record_id)
            .where(ENTRIES.c.replica == replica, ENTRIES.c.created_at >= since, ENTRIES.c.part != "flag")
            .group_by(ENTRIES.c.record_id)
            .order_by(func.min(ENTRIES.c.seq))
        )
        async with self._read() as connection:
            return list((await connection.execute(query)).scalars())

    async def open_streams(self, *, opened_before: datetime | None = None) -> list[OpenStream]:
        """Streams whose `opened` entry no `closed` entry follows, oldest first (to mark those left by a crash)."""
        closed = ENTRIES.alias("closed")
        query = select(*(ENTRIES.c[name] for name in OpenStream.model_fields)).where(
            ENTRIES.c.part == "opened",
            ~exists().where(closed.c.record_id == ENTRIES.c.record_id, closed.c.part == "closed"),
        )
        if opened_before is not None:
            query = query.where(ENTRIES.c.created_at < opened_before)
        async with self._read() as connection:
            rows = (await connection.execute(query.order_by(ENTRIES.c.seq))).mappings().all()
        return [OpenStream.model_validate(dict(row)) for row in rows]

    async def stream_counts(self) -> StreamCounts:
        closed = ENTRIES.alias("closed")
        still_open = (
            select(func.count())
            .select_from(ENTRIES)
            .where(
                ENTRIES.c.part == "opened",
                ~exists().where(closed.c.record_id == ENTRIES.c.record_id, closed.c.part == "closed"),
            )
        )
        marked = (
            select(func.count())
            .select_from(ENTRIES)
            .where(
                ENTRIES.c.part == "closed",
                ENTRIES.c.status == "interrupted",
                ENTRIES.c.content.contains(MARKED_AT_START, autoescape=True),
            )
        )
        async with self._read() as connection:
            counts = (
                await connection.execute(select(still_open.scalar_subquery(), marked.scalar_subquery()))
            ).one()
        return StreamCounts(open=counts[0], marked_at_start=counts[1])

    async def get_stack(self, fingerprint: str) -> dict[str, Any] | None:
        async with self._read() as connection:
            found = (
                await connection.execute(
                    select(STACKS.c.canonical_json).where(STACKS.c.fingerprint == fingerprint)
                )
            ).scalar_one_or_none()
        return None if found is None else load_canonical(found)

    async def checkpoint(self, size: int | None = None) -> SignedCheckpoint:
        """The signed checkpoint of tree size `size`, or the latest; NoSuchCheckpoint when there is none."""
        async with self._reader.connect() as connection:
            return await connection.run_sync(checkpoint_of_size, size)

    async def record_proof(
        self, record_id: str, tenant: str | None, size: int | None = None
    ) -> RecordProof | None:
        """Each entry of the record with its inclusion proof in the checkpoint of `size` (default the latest).

        None when the record does not exist or is another tenant's (`tenant=None`: any); an entry not in that
        checkpoint's tree (integrated later, or not yet) has no proof.
        """
        if not _could_be_stored(record_id):
            return None
        async with self._reader.connect() as connection:
            return await connection.run_sync(proofs.record_proof, record_id, tenant, size)

    async def export(
        self, window: export.Window, checkpoint: SignedCheckpoint | None, *, page_size: int = export.PAGE_SIZE
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Every entry created in `window`, oldest first, a page at a time, each with its inclusion proof in
        `checkpoint`'s tree (none for an entry integrated after it), its payload while kept and its receipt."""
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        after: tuple[datetime, int] | None = None
        while True:
            async with self._read() as connection:
                rows, after = await connection.run_sync(export.page, window, checkpoint, after, page_size)
            if rows:
                yield rows
            if after is None:
                return

    async def consistency(self, old: int, new: int | None = None) -> ConsistencyProof:
        """The proof that the tree of size `new` (default: the latest checkpoint's) extends the tree of `old`."""
        async with self._reader.connect() as connection:
            return await connection.run_sync(proofs.consistency, old, new)

    async def verify(
        self,
        *,
        verifiers: list[Verifier] | None = None,
        witnessed: list[Witnessed] | None = None,
        receipts: list[Receipt] | None = None,
        page_size: int = PAGE_SIZE,
    ) -> VerifyReport:
        """Rebuilds the tree from the entries, `page_size` at a time, and holds it to every signed checkpoint (each
        signature checked with `verifiers`, the trusted log keys) and every `witnessed` one, and holds the log to
        every receipt it gave (`receipts`, kept by clients); reports the first problem and where it is."""
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        return await verify_log(
            self._reader,
            verifiers=verifiers or [],
            witnessed=witnessed or [],
            receipts=receipts or [],
            page_size=page_size,
        )

    async def check_record(
        self, record_id: str, verifiers: list[Verifier] | None = None
    ) -> tuple[list[EntryCheck], SignedCheckpoint | None]:
        """Per entry of the record: do its bytes recompute, and does its proof in the latest checkpoint verify.

        With `verifiers`, the checkpoint's signature is checked too (NoteError when it fails). Empty when the
        record does not exist.
        """
        if not _could_be_stored(record_id):
            return [], None
        async with self._reader.connect() as connection:
            return await connection.run_sync(proofs.check_record, record_id, verifiers or [])


def _could_be_stored(record_id: str) -> bool:
    """Whether an entry could carry this id. One that none could is no record, without asking the database."""
    return storable(record_id, RECORD_ID_LENGTH)


def _declared(row: RowMapping) -> bool | None:
    """Whether the record's stack was declared, from hashed bytes only: the entry's field, or for a chained
    entry its content (the chain never hashed `stacks.declared`)."""
    if row["prev_sha256"] is None:
        return row["stack_declared"]
    declared = load_canonical(row["content"]).get("stack_declared")
    return declared if isinstance(declared, bool) else None


async def _ensure_schema(url: str, *, schema: str | None, create_if_empty: bool) -> None:
    revision, has_tables = await inspect_database(url, schema=schema)
    if revision is None and not has_tables and create_if_empty:
        # Several proxies may start at once on a blank database: one migrates, the others find it done.
        await create_schema_if_empty(url, schema=schema)
        revision, has_tables = await inspect_database(url, schema=schema)
    if revision == HEAD_REVISION:
        return
    where = describe(parse_url(url)) + (f" (schema {schema})" if schema else "")
    if revision is None and not has_tables:
        raise SchemaOutdated(
            f"the audit database {where} is empty; run `stackpin db upgrade` to create its schema "
            f"(revision {HEAD_REVISION})"
        )
    if revision is None:
        raise SchemaOutdated(
            f"the audit database {where} holds tables but no stackpin schema revision; point the proxy at an "
            "empty database, or run `stackpin db upgrade` if it is an audit database"
        )
    if revision not in known_revisions():
        raise SchemaTooNew(
            f"the audit database {where} is at schema revision {revision}, newer than this stackpin knows "
            f"({HEAD_REVISION}); upgrade stackpin"
        )
    raise SchemaOutdated(
        f"the audit database {where} is at schema revision {revision}, this stackpin needs {HEAD_REVISION}: "
        "run `stackpin db upgrade`"
    )


def _view(row: RowMapping) -> EntryView:
    content, payload = load_canonical(row["content"]), None
    if row["payload_sha256"] is not None:
        kept = row["payload_text"]
        payload = "erased" if kept is None else "kept"
        if kept is not None:
            content = {**content, **load_canonical(kept)}
    return EntryView(
        seq=row["seq"],
        index=row["leaf_index"],
        part=row["part"],
        created_at=row["created_at"],
        status=row["status"],
        replica=row["replica"],
        model=row["model"],
        fingerprint=row["fingerprint"],
        stack_declared=_declared(row),
        content=content,
        payload=payload,
        sha256=row["sha256"],
        receipt=row["receipt"],
    )


def _summary(start: RowMapping, later: list[RowMapping]) -> RecordSummary:
    closed = [row for row in later if row["part"] == "closed"]
    return RecordSummary(
        id=start["record_id"],
        seq=start["seq"],
        tenant=start["tenant"],
        created_at=start["created_at"],
        model=start["model"],
        fingerprint=start["fingerprint"],
        status=closed[-1]["status"] if closed else start["status"],
        replay_of=start["replay_of"],
        part="closed" if closed else start["part"],
        flagged=any(row["part"] == "flag" and row["status"] != ERASED for row in later),
        erased=any(row["part"] == "flag" and row["status"] == ERASED for row in later),
    )
