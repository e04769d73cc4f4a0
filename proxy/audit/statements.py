"""The log's bulk writes for the drivers' own APIs, compiled from the models once per dialect: the group commit's
statements, and the integrator's rows of leaves and nodes.

The commit path runs on raw `sqlite3` and raw asyncpg, because going through SQLAlchemy's execution layer cost
about twenty times the transaction's own work; the integrator inserts thousands of rows a round, where
SQLAlchemy's per-row parameter handling was most of the round's CPU. The schema still has one owner: every statement here is a
SQLAlchemy construct over the models (`models.py`), compiled by SQLAlchemy for the dialect, and every value goes
through the column type's own bind processor, so a row written here is exactly the row SQLAlchemy would have
written. A column added to a model appears in these statements without an edit here; a test compares them.
This module knows nothing of batches, futures or connections.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from sqlalchemy import BigInteger, any_, bindparam, delete, func, insert, literal_column, select, true
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement

from proxy.audit.models import ENTRY_SEQUENCE, Entry, LogLeaf, LogQueue, Payload, Prompt, Stack, TreeNode

DialectName = Literal["sqlite", "postgresql"]
Processor = Callable[[Any], Any]


@dataclass(frozen=True)
class Prepared:
    """One statement's text in the driver's parameter style, and how a row of named values becomes its
    positional parameters."""

    sql: str
    columns: tuple[str, ...]
    processors: tuple[Processor | None, ...]

    def row(self, values: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(
            value if process is None or value is None else process(value)
            for process, value in zip(self.processors, (values[c] for c in self.columns), strict=True)
        )


@dataclass(frozen=True)
class CommitStatements:
    insert_entry: Prepared
    insert_payload: Prepared
    # Deletes payloads: one `seq` on SQLite (run once per entry erased), an array of them (`seqs`) on PostgreSQL.
    erase_payloads: Prepared
    insert_queue: Prepared
    insert_stack: Prepared  # leaves an existing row alone: rows are content-addressed, so it is the same
    insert_prompt: Prepared
    stored_stack: Prepared  # one fingerprint, if stored
    next_seq: Prepared  # the first number of a block (PostgreSQL) or after the largest (SQLite)
    # PostgreSQL: a whole batch in one statement, so in one round trip (see _batch_insert); None on SQLite, where
    # statements cost no round trip.
    insert_batch: Prepared | None


def _dialect(name: DialectName) -> Dialect:
    # numeric_dollar is asyncpg's own style ($1, $2 ...), the one SQLAlchemy's asyncpg dialect compiles to.
    return (
        PGDialect_asyncpg(paramstyle="numeric_dollar") if name == "postgresql" else SQLiteDialect_pysqlite()
    )


def _prepare(statement: ClauseElement, dialect: Dialect, *, literal: bool = False) -> Prepared:
    compiled = statement.compile(dialect=dialect, compile_kwargs={"literal_binds": literal})
    columns = tuple(compiled.positiontup or ())
    # The dialect's own implementation of each type: on SQLite a timestamp becomes SQLAlchemy's text form (always
    # with microseconds), where the generic type would leave it to sqlite3's adapter, which drops ".000000" and
    # so breaks the text comparisons SQLite does on timestamps.
    processors = tuple(
        compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect) for name in columns
    )
    return Prepared(str(compiled), columns, processors)


PAYLOAD_ARRAYS = ("payload_salt", "payload_text")  # the batch statement's payload columns, null for none


def _batch_insert() -> ClauseElement:
    """One statement that takes a block of numbers, inserts every entry of a batch at its place in the block with
    its payload beside it, and queues the batch: the entries' columns come as one array each (parameters named
    after the columns), their payloads' salts and texts as two more (`PAYLOAD_ARRAYS`, null where an entry has
    none), plus `count` and `leaf_hashes` for the queue. It returns the block's first number. A single statement
    runs in a transaction of its own, so it needs no BEGIN and COMMIT round trips either; it is also valid inside
    one."""
    entries, payloads = Entry.__table__, Payload.__table__
    columns = [column for column in entries.columns if column.name != "seq"]
    kinds = [*(c.type for c in columns), payloads.c.salt.type, payloads.c.payload.type]
    names = [*(c.name for c in columns), *PAYLOAD_ARRAYS]
    block = select(ENTRY_SEQUENCE.next_value().label("first_seq")).cte("block")
    rows = (
        func.unnest(
            *(bindparam(name, type_=postgresql.ARRAY(kind)) for name, kind in zip(names, kinds, strict=True))
        )
        .table_valued(*names, with_ordinality="ordinal")
        .render_derived(name="new_rows")
    )
    placed = (
        select(
            (block.c.first_seq + rows.c.ordinal - literal_column("1")).label("seq"),
            *(rows.c[n] for n in names),
        )
        .select_from(block.join(rows, true()))
        .cte("placed")
    )
    inserted = (
        insert(Entry)
        .from_select(
            ["seq", *(c.name for c in columns)], select(placed.c.seq, *(placed.c[c.name] for c in columns))
        )
        .cte("inserted")
    )
    kept = (
        insert(Payload)
        .from_select(
            ["seq", "tenant", "created_at", "salt", "payload"],
            select(
                placed.c.seq, placed.c.tenant, placed.c.created_at, *(placed.c[n] for n in PAYLOAD_ARRAYS)
            ).where(placed.c.payload_text.is_not(None)),
        )
        .cte("kept")
    )
    queue = LogQueue.__table__
    queued = (
        insert(LogQueue)
        .from_select(
            ["first_seq", "count", "leaf_hashes"],
            select(
                block.c.first_seq,
                bindparam("count", type_=queue.c["count"].type),
                bindparam("leaf_hashes", type_=queue.c.leaf_hashes.type),
            ),
        )
        .cte("queued")
    )
    return select(block.c.first_seq).add_cte(inserted).add_cte(kept).add_cte(queued)


@cache
def commit_statements(name: DialectName) -> CommitStatements:
    dialect = _dialect(name)
    upsert = postgresql.insert if name == "postgresql" else sqlite.insert
    if name == "postgresql":
        next_seq = select(ENTRY_SEQUENCE.next_value())
    else:
        next_seq = select(func.coalesce(func.max(Entry.seq), 0) + 1)
    if name == "postgresql":
        erase = delete(Payload).where(
            Payload.seq == any_(bindparam("seqs", type_=postgresql.ARRAY(BigInteger())))
        )
    else:
        erase = delete(Payload).where(Payload.seq == bindparam("seq"))
    return CommitStatements(
        insert_entry=_prepare(insert(Entry), dialect),
        insert_payload=_prepare(insert(Payload), dialect),
        erase_payloads=_prepare(erase, dialect),
        insert_queue=_prepare(insert(LogQueue), dialect),
        insert_stack=_prepare(upsert(Stack).on_conflict_do_nothing(index_elements=["fingerprint"]), dialect),
        insert_prompt=_prepare(upsert(Prompt).on_conflict_do_nothing(index_elements=["sha256"]), dialect),
        stored_stack=_prepare(
            select(Stack.fingerprint).where(Stack.fingerprint == bindparam("fingerprint")), dialect
        ),
        next_seq=_prepare(next_seq, dialect, literal=True),
        insert_batch=_prepare(_batch_insert(), dialect) if name == "postgresql" else None,
    )


@dataclass(frozen=True)
class IntegrationStatements:
    insert_leaf: Prepared
    insert_node: Prepared


@cache
def integration_statements(name: DialectName) -> IntegrationStatements:
    dialect = _dialect(name)
    return IntegrationStatements(
        insert_leaf=_prepare(insert(LogLeaf), dialect), insert_node=_prepare(insert(TreeNode), dialect)
    )
