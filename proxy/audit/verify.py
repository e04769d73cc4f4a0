"""Verification of a stored log: reads it page by page and lets `checks.py` judge what it reads.

Never loads a whole table. In order: the snapshot (the latest checkpoint's size, the leaves, the queue, and
entries that are neither, in one statement), then the leaves in index order with their entries and stored leaf
hashes, rebuilding the tree from the entries' bytes and holding it to every checkpoint the log signed (each
signature checked with the trusted log keys) and every checkpoint a witness holds or someone kept; then every
stored inner node against its children, then what the log promised beyond its tree (promises.py: the receipts
clients kept, the payloads kept and erased), then the stacks and prompts against their content addresses. A
receipt a row keeps must be the log's for that entry. The first problem is reported with its leaf index and
record id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, exists, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.audit import promises
from proxy.audit.checks import (
    Claim,
    Leaf,
    LogProblem,
    TreeWalker,
    check_prompt_row,
    check_stack_row,
    node_problem,
)
from proxy.audit.models import Entry, LogCheckpoint, LogLeaf, LogQueue, Prompt, Stack, TreeNode
from proxy.audit.note import NoteError, Verifier, cosigned_at, open_checkpoint, parse_checkpoint, parse_note
from proxy.audit.receipts import Receipt
from proxy.audit.tree import b64, read_nodes, stored_fields
from proxy.audit.values import VerifyReport

PAGE_SIZE = 1000
ENTRIES = Entry.__table__
LEAVES = LogLeaf.__table__
NODES = TreeNode.__table__
QUEUE = LogQueue.__table__
CHECKPOINTS = LogCheckpoint.__table__
STACKS = Stack.__table__
PROMPTS = Prompt.__table__


@dataclass(frozen=True)
class Witnessed:
    """A checkpoint held outside the database: by a witness (checked against its `cosigners`), or kept by
    someone (no cosigners)."""

    source: str
    note: str
    cosigners: list[Verifier] = field(default_factory=list)


@dataclass
class _Tally:
    checkpoints: int = 0
    witnessed: int = 0
    nodes: int = 0
    latest: str | None = None


def _snapshot(connection: Connection) -> tuple[int, int, int, int]:
    """(latest checkpoint's size, leaves, queued entries, entries neither in the tree nor queued), at one instant."""
    in_tree = exists().where(LEAVES.c.seq == ENTRIES.c.seq)
    queued = exists().where(
        ENTRIES.c.seq >= QUEUE.c.first_seq, ENTRIES.c.seq < QUEUE.c.first_seq + QUEUE.c.count
    )
    row = connection.execute(
        select(
            select(func.coalesce(func.max(CHECKPOINTS.c.tree_size), -1)).scalar_subquery(),
            select(func.count()).select_from(LEAVES).scalar_subquery(),
            select(func.coalesce(func.sum(QUEUE.c.count), 0)).scalar_subquery(),
            select(func.count()).select_from(ENTRIES).where(~in_tree, ~queued).scalar_subquery(),
        )
    ).one()
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


def _log_claims(
    connection: Connection, low: int, high: int, verifiers: list[Verifier], tally: _Tally
) -> tuple[list[Claim], LogProblem | None]:
    """The log's checkpoints of sizes in [low, high), each signature checked when keys are trusted."""
    rows = connection.execute(
        select(CHECKPOINTS.c.tree_size, CHECKPOINTS.c.root_hash, CHECKPOINTS.c.note)
        .where(CHECKPOINTS.c.tree_size >= low, CHECKPOINTS.c.tree_size < high)
        .order_by(CHECKPOINTS.c.tree_size)
    ).all()
    claims = []
    for size, root_hex, note in rows:
        try:
            if verifiers:
                checkpoint, _ = open_checkpoint(note, verifiers)
            else:
                checkpoint = parse_checkpoint(parse_note(note).text)
        except NoteError as exc:
            return claims, _signature_problem(int(size), str(exc))
        if (checkpoint.size, checkpoint.root.hex()) != (int(size), root_hex):
            return claims, _signature_problem(
                int(size), "the row's size or root differs from its signed note"
            )
        tally.checkpoints += 1
        tally.latest = note
        claims.append(Claim(checkpoint.size, checkpoint.root, "log"))
    return claims, None


def _signature_problem(size: int, why: str) -> LogProblem:
    return LogProblem(
        kind="signature_invalid",
        message=f"the stored checkpoint of size {size} is not one the log signed: {why} (forged or edited)",
        position=size - 1 if size else None,
    )


def _witnessed_claims(
    witnessed: list[Witnessed], verifiers: list[Verifier], tally: _Tally
) -> tuple[list[Claim], LogProblem | None]:
    claims = []
    for held in witnessed:
        try:
            checkpoint, note = (
                open_checkpoint(held.note, verifiers)
                if verifiers
                else (parse_checkpoint(parse_note(held.note).text), None)
            )
            if held.cosigners:
                note = note or parse_note(held.note)
                _cosigned_by_one(note, held.cosigners)
        except NoteError as exc:
            return claims, LogProblem(
                kind="witness_signature_invalid",
                message=f"{held.source}: a checkpoint it holds does not verify: {exc}",
            )
        tally.witnessed += 1
        claims.append(Claim(checkpoint.size, checkpoint.root, held.source))
    return claims, None


def _cosigned_by_one(note: Any, cosigners: list[Verifier]) -> None:
    errors = []
    for cosigner in cosigners:
        try:
            cosigned_at(note, cosigner)
            return
        except NoteError as exc:
            errors.append(str(exc))
    raise NoteError("; ".join(errors))


def _leaf_page(connection: Connection, after: int, end: int, limit: int) -> list[Leaf]:
    query = (
        select(LEAVES.c.leaf_index, LEAVES.c.leaf_hash.label("leaf_node"), ENTRIES)
        .select_from(LEAVES.outerjoin(ENTRIES, ENTRIES.c.seq == LEAVES.c.seq))
        .where(LEAVES.c.leaf_index > after, LEAVES.c.leaf_index < end)
        .order_by(LEAVES.c.leaf_index)
        .limit(limit)
    )
    return [
        Leaf(
            index=int(row["leaf_index"]),
            entry=None if row["seq"] is None else stored_fields(row),
            stored_hash=None if row["leaf_node"] is None else bytes.fromhex(row["leaf_node"]),
            receipt=row["receipt"],
        )
        for row in connection.execute(query).mappings()
    ]


def _missing_references(connection: Connection, leaves: list[Leaf], seen: set[str]) -> LogProblem | None:
    """An entry whose stack or prompt row is gone: its hash still verifies, but what served it is lost."""
    entries = [(leaf.index, leaf.entry.fields) for leaf in leaves if leaf.entry is not None]
    for kind, table, key, attribute in (
        ("stack_missing", STACKS, "fingerprint", "fingerprint"),
        ("prompt_missing", PROMPTS, "sha256", "prompt_sha256"),
    ):
        wanted = {getattr(f, attribute) for _, f in entries if getattr(f, attribute) is not None} - seen
        if not wanted:
            continue
        found = set(connection.execute(select(table.c[key]).where(table.c[key].in_(wanted))).scalars())
        seen.update(found)
        for index, fields in entries:
            if getattr(fields, attribute) in wanted - found:
                what = "stack" if kind == "stack_missing" else "prompt"
                return LogProblem(
                    kind=kind,  # type: ignore[arg-type]
                    message=f"entry {index} names {what} {getattr(fields, attribute)}, which is not stored",
                    position=index,
                    record_id=fields.record_id,
                )
    return None


def _walk(
    connection: Connection,
    size: int,
    walker: TreeWalker,
    verifiers: list[Verifier],
    tally: _Tally,
    page_size: int,
) -> LogProblem | None:
    after, low, seen = -1, 0, set[str]()
    while True:
        leaves = _leaf_page(connection, after, size, page_size)
        high = (leaves[-1].index + 2) if leaves else size + 1
        claims, problem = _log_claims(connection, low, high, verifiers, tally)
        problem = walker.add(claims) or problem
        low = high
        if problem is not None or not leaves:
            return problem or walker.finish()
        problem = walker.feed(leaves) or _missing_references(connection, leaves, seen)
        if problem is not None:
            return problem
        after = leaves[-1].index


def _inner_nodes(connection: Connection, size: int, tally: _Tally, page_size: int) -> LogProblem | None:
    level = 1
    while (1 << level) <= size:
        after = -1
        while True:
            rows = connection.execute(
                select(NODES.c.idx, NODES.c.hash)
                .where(NODES.c.level == level, NODES.c.idx > after, NODES.c.idx < (size >> level))
                .order_by(NODES.c.idx)
                .limit(page_size)
            ).all()
            if not rows:
                break
            children = read_nodes(connection, [(level - 1, 2 * int(i) + k) for i, _ in rows for k in (0, 1)])
            for idx, digest in rows:
                node = (level, int(idx))
                left, right = (
                    children.get((level - 1, 2 * node[1])),
                    children.get((level - 1, 2 * node[1] + 1)),
                )
                problem = node_problem(node, bytes.fromhex(digest), left, right)
                if problem is not None:
                    return problem
                tally.nodes += 1
            after = int(rows[-1][0])
        level += 1
    return None


def _walk_rows(
    connection: Connection, table: Any, key: str, value: str, check: Any, page_size: int
) -> tuple[int, LogProblem | None]:
    checked, after = 0, ""
    while True:
        rows = connection.execute(
            select(table.c[key], table.c[value])
            .where(table.c[key] > after)
            .order_by(table.c[key])
            .limit(page_size)
        ).all()
        if not rows:
            return checked, None
        for row_key, row_value in rows:
            checked += 1
            problem = check(row_key, row_value)
            if problem is not None:
                return checked, problem
        after = rows[-1][0]


def _verify(
    connection: Connection,
    verifiers: list[Verifier],
    witnessed: list[Witnessed],
    receipts: list[Receipt],
    page_size: int,
) -> VerifyReport:
    tally = _Tally()
    signed, leaves, pending, orphans = _snapshot(connection)
    size = max(signed, 0)
    outside, problem = _witnessed_claims(witnessed, verifiers, tally)
    walker = TreeWalker(outside, verifiers)
    if problem is None and orphans:
        problem = LogProblem(
            kind="orphan_entry",
            message=f"{orphans} entries are neither in the tree nor queued for it (inserted behind the log's back, "
            "or their leaves deleted)",
        )
    if problem is None and leaves > size:
        problem = LogProblem(
            kind="unsigned_leaves",
            message=f"the tree holds {leaves} leaves but the latest signed checkpoint covers {size} "
            "(leaves appended without the log's key)",
            position=size,
        )
    problem = problem or _walk(connection, size, walker, verifiers, tally, page_size)
    problem = problem or _inner_nodes(connection, size, tally, page_size)
    kept = promises.Kept()
    problem = problem or promises.receipts_kept(connection, receipts, verifiers, size, kept)
    problem = problem or promises.payloads_kept(connection, kept, page_size)
    problem = problem or promises.payloads_erased(connection, kept, page_size)
    stacks, stack_problem = _walk_rows(
        connection, STACKS, "fingerprint", "canonical_json", check_stack_row, page_size
    )
    prompts, prompt_problem = _walk_rows(connection, PROMPTS, "sha256", "text", check_prompt_row, page_size)
    problem = problem or stack_problem or prompt_problem
    return VerifyReport(
        ok=problem is None,
        entries_checked=walker.size,
        pending=pending,
        nodes_checked=tally.nodes,
        checkpoints_checked=tally.checkpoints,
        signatures_checked=bool(verifiers),
        witnessed_checked=tally.witnessed,
        stacks_checked=stacks,
        prompts_checked=prompts,
        stored_receipts_checked=walker.receipts,
        receipts_checked=kept.receipts,
        receipts_pending=kept.receipts_pending,
        payloads_checked=kept.payloads,
        payloads_erased=kept.erased,
        tree_size=walker.size,
        root_hash=b64(walker.root),
        checkpoint=tally.latest,
        problem=problem,
    )


async def verify_log(
    engine: AsyncEngine,
    *,
    verifiers: list[Verifier],
    witnessed: list[Witnessed],
    receipts: list[Receipt] | None = None,
    page_size: int = PAGE_SIZE,
) -> VerifyReport:
    """Checks the log up to its latest signed checkpoint; later appends wait for the next run.

    One read-only connection, one snapshot per statement: what a concurrent integration adds lies past the
    checkpoint read first, and is left alone.
    """
    async with engine.connect() as connection:
        return await connection.run_sync(_verify, verifiers, witnessed, receipts or [], page_size)
