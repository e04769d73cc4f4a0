"""Verification of a stored chain: walks the database page by page and lets `chain.py` judge each link.

Never loads the whole table: entries are read in position order, `PAGE_SIZE` at a time, and only the last link
is kept. Stack and prompt rows are checked against their content addresses the same way. What counts as a
problem is decided in `chain.py`; this module only reads.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from proxy.audit.chain import (
    GENESIS_SHA256,
    ChainProblem,
    ChainWalker,
    EntryFields,
    Link,
    check_link,
    check_prompt_row,
    check_stack_row,
)
from proxy.audit.models import ChainHead, Entry, Prompt, Stack
from proxy.audit.values import LinkCheck, VerifyReport

PAGE_SIZE = 1000
ENTRIES = Entry.__table__
STACKS = Stack.__table__
PROMPTS = Prompt.__table__


def link_from_row(row: RowMapping) -> Link:
    fields = EntryFields(
        record_id=row["record_id"],
        part=row["part"],
        tenant=row["tenant"],
        created_at=row["created_at"],
        replica=row["replica"],
        model=row["model"],
        fingerprint=row["fingerprint"],
        prompt_sha256=row["prompt_sha256"],
        replay_of=row["replay_of"],
        status=row["status"],
        content_json=row["content"],
    )
    return Link(
        position=row["position"],
        prev_sha256=row["prev_sha256"],
        sha256=row["sha256"],
        fields=fields,
    )


async def read_head(connection: AsyncConnection) -> tuple[int, str]:
    row = (
        await connection.execute(select(ChainHead.position, ChainHead.sha256).where(ChainHead.id == 1))
    ).one()
    return int(row.position), str(row.sha256)


async def verify_chain(
    engine: AsyncEngine, *, expect_head: tuple[int, str] | None = None, page_size: int = PAGE_SIZE
) -> VerifyReport:
    """Checks every entry up to the head read at the start; later appends wait for the next run."""
    async with engine.connect() as connection:
        head = await read_head(connection)
    walker = ChainWalker(expect_head)
    checked, problem = await _walk_entries(engine, walker, head, page_size)
    if problem is None:
        problem = walker.finish(*head)
    if problem is None:
        problem = await _entries_beyond_head(engine)
    stacks, stack_problem = await _walk_rows(
        engine, STACKS, "fingerprint", "canonical_json", check_stack_row, page_size
    )
    prompts, prompt_problem = await _walk_rows(engine, PROMPTS, "sha256", "text", check_prompt_row, page_size)
    problem = problem or stack_problem or prompt_problem
    return VerifyReport(
        ok=problem is None,
        entries_checked=checked,
        stacks_checked=stacks,
        prompts_checked=prompts,
        head_position=head[0],
        head_sha256=head[1],
        problem=problem,
    )


async def _walk_entries(
    engine: AsyncEngine, walker: ChainWalker, head: tuple[int, str], page_size: int
) -> tuple[int, ChainProblem | None]:
    after = 0
    seen_stacks: set[str] = set()
    while True:
        async with engine.connect() as connection:
            rows = (
                (
                    await connection.execute(
                        select(ENTRIES)
                        .where(ENTRIES.c.position > after, ENTRIES.c.position <= head[0])
                        .order_by(ENTRIES.c.position)
                        .limit(page_size)
                    )
                )
                .mappings()
                .all()
            )
            if not rows:
                return walker.checked, None
            links = [link_from_row(row) for row in rows]
            problem = walker.feed(links)
            if problem is None:
                problem = await _missing_references(connection, links, seen_stacks)
            if problem is not None:
                return walker.checked, problem
        after = links[-1].position


async def _missing_references(
    connection: AsyncConnection, links: list[Link], seen: set[str]
) -> ChainProblem | None:
    """An entry whose stack or prompt row is gone: its hash still verifies, but what served it is lost."""
    wanted = {link.fields.fingerprint for link in links if link.fields.fingerprint is not None} - seen
    if not wanted:
        return None
    found = set(
        (
            await connection.execute(select(STACKS.c.fingerprint).where(STACKS.c.fingerprint.in_(wanted)))
        ).scalars()
    )
    seen.update(found)
    for link in links:
        if link.fields.fingerprint in wanted - found:
            return ChainProblem(
                kind="stack_missing",
                message=f"entry {link.position} names stack {link.fields.fingerprint}, which is not stored",
                position=link.position,
                record_id=link.record_id,
            )
    wanted_prompts = {link.fields.prompt_sha256 for link in links if link.fields.prompt_sha256 is not None}
    if wanted_prompts:
        found_prompts = set(
            (
                await connection.execute(select(PROMPTS.c.sha256).where(PROMPTS.c.sha256.in_(wanted_prompts)))
            ).scalars()
        )
        for link in links:
            if link.fields.prompt_sha256 is not None and link.fields.prompt_sha256 not in found_prompts:
                return ChainProblem(
                    kind="prompt_missing",
                    message=f"entry {link.position} names prompt {link.fields.prompt_sha256}, not stored",
                    position=link.position,
                    record_id=link.record_id,
                )
    return None


async def _entries_beyond_head(engine: AsyncEngine) -> ChainProblem | None:
    """Entries past the head can only have been inserted behind the store's back (appends move the head)."""
    # One statement, so one snapshot: under READ COMMITTED two statements could straddle a concurrent append.
    both = select(
        select(ChainHead.position).where(ChainHead.id == 1).scalar_subquery(),
        select(func.max(ENTRIES.c.position)).scalar_subquery(),
    )
    async with engine.connect() as connection:
        head_position, last = (await connection.execute(both)).one()
    if last is not None and last > head_position:
        return ChainProblem(
            kind="head_mismatch",
            message=f"entries exist up to position {last}, beyond the stored head at {head_position}",
            position=head_position + 1,
        )
    return None


async def _walk_rows(
    engine: AsyncEngine, table: Any, key: str, value: str, check: Any, page_size: int
) -> tuple[int, ChainProblem | None]:
    checked, after = 0, ""
    while True:
        async with engine.connect() as connection:
            rows = (
                await connection.execute(
                    select(table.c[key], table.c[value])
                    .where(table.c[key] > after)
                    .order_by(table.c[key])
                    .limit(page_size)
                )
            ).all()
        if not rows:
            return checked, None
        for row_key, row_value in rows:
            checked += 1
            problem = check(row_key, row_value)
            if problem is not None:
                return checked, problem
        after = rows[-1][0]


async def verify_record_links(engine: AsyncEngine, record_id: str) -> list[LinkCheck]:
    """Per entry of the record: does it recompute, name its predecessor, and does its successor name it."""
    async with engine.connect() as connection:
        # The head first: every entry up to it is committed, so a successor missing below it is really gone.
        head_position, _ = await read_head(connection)
        own = (
            (
                await connection.execute(
                    select(ENTRIES).where(ENTRIES.c.record_id == record_id).order_by(ENTRIES.c.position)
                )
            )
            .mappings()
            .all()
        )
        if not own:
            return []
        neighbours = {p - 1 for p in (r["position"] for r in own)} | {r["position"] + 1 for r in own}
        rows = (
            await connection.execute(
                select(ENTRIES.c.position, ENTRIES.c.sha256, ENTRIES.c.prev_sha256).where(
                    ENTRIES.c.position.in_(neighbours)
                )
            )
        ).all()
    by_position = {int(r.position): (str(r.sha256), str(r.prev_sha256)) for r in rows}
    return [_check_one(link_from_row(row), by_position, head_position) for row in own]


def _check_one(link: Link, by_position: dict[int, tuple[str, str]], head_position: int) -> LinkCheck:
    if link.position == 1:
        expected_prev: str | None = GENESIS_SHA256
    else:
        expected_prev = by_position.get(link.position - 1, (None, None))[0]
    successor = by_position.get(link.position + 1)
    if successor is not None:
        next_links: bool | None = successor[1] == link.sha256
    else:
        next_links = None if link.position >= head_position else False
    own_problem = check_link(link.position, link.prev_sha256, link)
    return LinkCheck(
        position=link.position,
        part=link.fields.part,  # type: ignore[arg-type]
        sha256=link.sha256,
        recomputes=own_problem is None,
        prev_matches=expected_prev is not None and link.prev_sha256 == expected_prev,
        next_links=next_links,
    )
