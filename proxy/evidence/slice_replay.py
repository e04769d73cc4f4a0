"""Replaying a slice of traffic: every record a filter selects, replayed (on its own stack or the one a pin names)
at a bounded concurrency and rate, and the agreement counted: how many came back identical, with the same tokens,
text or JSON, or diverged (proxy/evidence/agreement.py), overall, per route and per prompt version, with where
the first divergences were.

The slice is walked a page at a time (proxy/evidence/log_walk.py) and each record read when a worker is free to
replay it, so memory holds a page, the records in flight and the tally, however long the slice: each outcome is
handed to the caller (`on_outcome`) as it comes and only a few examples are kept. Replays are records of their own,
linked to their originals like any replay, and newer than the walk, so a slice never replays its own replays;
replays in the slice are left out. A record that holds no complete answer (a stream still open or interrupted) is
skipped, counted apart, as is a record the caller may not replay (`NotReplayable`). How one record is replayed is
the caller's (`replay`): `stackpin replay --since` posts to a proxy's `POST /v1/records/{id}/replay`, the audit
page calls the same code in process.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from proxy.audit import AuditRecord, AuditStore, RecordFilter, RecordSummary
from proxy.evidence.agreement import FAILED, LEVELS, Requirement, at_least
from proxy.evidence.compare import where
from proxy.evidence.log_walk import walk

EXAMPLES = 20  # divergences kept in the report; every outcome goes to `on_outcome`


class ReplayFailed(Exception):
    """One record's replay did not come back; the message says why."""


class NotReplayable(Exception):
    """One record cannot be replayed by this caller (another tenant's): skipped, not failed."""


@dataclass(frozen=True)
class Outcome:
    record: str
    route: str | None
    prompt: str | None  # "support@3"
    agreement: str  # one of LEVELS, or FAILED
    replay_record: str | None = None
    where: str | None = None  # the first divergence, in words
    position: int | None = None
    reason: str | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


Replay = Callable[[AuditRecord], Awaitable[dict[str, Any]]]  # the replay's JSON, as POST .../replay answers


@dataclass
class SliceReport:
    counts: Counter[str] = field(default_factory=Counter)  # LEVELS and FAILED
    skipped: Counter[str] = field(default_factory=Counter)  # why a record was not replayed
    by_route: dict[str, Counter[str]] = field(default_factory=dict)
    by_prompt: dict[str, Counter[str]] = field(default_factory=dict)
    positions: Counter[int] = field(default_factory=Counter)  # first divergence of each replay not identical
    examples: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.counts[outcome.agreement] += 1
        self.by_route.setdefault(outcome.route or "(none)", Counter())[outcome.agreement] += 1
        self.by_prompt.setdefault(outcome.prompt or "(none)", Counter())[outcome.agreement] += 1
        if outcome.agreement != "identical":
            if outcome.position is not None:
                self.positions[outcome.position] += 1
            if len(self.examples) < EXAMPLES:
                self.examples.append(outcome)

    @property
    def replayed(self) -> int:
        return sum(self.counts.values())

    def as_json(self, requirement: Requirement | None = None) -> dict[str, Any]:
        report: dict[str, Any] = {
            "replayed": self.replayed,
            "counts": {name: self.counts.get(name, 0) for name in (*LEVELS, FAILED)},
            "at_least": {name: at_least(self.counts, name) for name in LEVELS[:-1]},
            "skipped": dict(self.skipped),
            "by_route": {name: _shares(c) for name, c in sorted(self.by_route.items())},
            "by_prompt": {name: _shares(c) for name, c in sorted(self.by_prompt.items())},
            "positions": dict(sorted(self.positions.items())),
            "divergences": [example.as_json() for example in self.examples],
        }
        if requirement is not None:
            report["requirement"] = {"level": requirement.level, "share": requirement.share,
                                     "met": requirement.met(self.counts)}  # fmt: skip
        return report


def _shares(counts: Counter[str]) -> dict[str, Any]:
    return {
        "replayed": sum(counts.values()),
        "counts": {name: counts.get(name, 0) for name in (*LEVELS, FAILED) if counts.get(name)},
        "identical": at_least(counts, "identical"),
    }


def describe(record: AuditRecord) -> tuple[str | None, str | None]:
    """The route a record was asked under and its prompt version (`name@N`), from its first entry."""
    content = record.entries[0].content if record.entries else {}
    route = content.get("route")
    prompt = content.get("prompt")
    version = f"{prompt.get('name')}@{prompt.get('version')}" if isinstance(prompt, dict) else None
    return (route if isinstance(route, str) else None), version


def outcome_of(record: AuditRecord, result: dict[str, Any]) -> Outcome:
    route, prompt = describe(record)
    level = result.get("agreement")
    if level not in LEVELS:  # a proxy that does not say: its outcome is all there is to go by
        level = "identical" if result.get("outcome") == "reproduced" else "diverged"
    diverged = result.get("outcome") == "diverged"
    return Outcome(
        record=record.id,
        route=route,
        prompt=prompt,
        agreement=level,
        replay_record=result.get("replay_record"),
        where=where(result) if diverged else None,
        position=result.get("position") if diverged else None,
        reason=result.get("reason") if diverged else None,
    )


class Pacer:
    """At most `rate` starts a second: each start waits for its slot."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = 1 / rate if rate else 0.0
        self._clock = clock
        self._next: float | None = None

    async def wait(self) -> None:
        if not self._interval:
            return
        now = self._clock()
        at = max(now, self._next if self._next is not None else now)
        self._next = at + self._interval
        if at > now:
            await asyncio.sleep(at - now)


async def replay_slice(
    store: AuditStore,
    selected: RecordFilter,
    replay: Replay,
    *,
    concurrency: int = 4,
    rate: float | None = None,
    limit: int | None = None,
    on_outcome: Callable[[Outcome], None] = lambda _: None,
) -> SliceReport:
    """Replays the slice, `concurrency` at a time and at most `rate` a second (None: unbounded), up to `limit`
    records (None: all); what `replay` raises but ReplayFailed ends the run."""
    report = SliceReport()
    summaries = _originals(walk(store, selected), report, limit)
    taking = asyncio.Lock()
    pacer = Pacer(rate)

    async def worker() -> None:
        while True:
            async with taking:
                summary = await anext(summaries, None)
            if summary is None:
                return
            record = await store.get_record(summary.id, selected.tenant)
            if record is None:
                report.skipped["no longer readable"] += 1
                continue
            await pacer.wait()
            try:
                outcome = outcome_of(record, await replay(record))
            except NotReplayable as e:
                report.skipped[str(e)] += 1
                continue
            except ReplayFailed as e:
                route, prompt = describe(record)
                outcome = Outcome(record.id, route, prompt, FAILED, error=str(e))
            report.add(outcome)
            on_outcome(outcome)

    try:
        async with asyncio.TaskGroup() as workers:  # one that fails stops the others
            for _ in range(max(1, concurrency)):
                workers.create_task(worker())
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return report


async def _originals(
    summaries: AsyncIterator[RecordSummary], report: SliceReport, limit: int | None
) -> AsyncIterator[RecordSummary]:
    """The slice's records that can be replayed, up to `limit`; the others counted as skipped."""
    taken = 0
    async for summary in summaries:
        if limit is not None and taken >= limit:
            return
        if summary.replay_of is not None:
            continue
        if summary.status != "complete":
            report.skipped[f"{summary.status}: no complete answer"] += 1
            continue
        taken += 1
        yield summary
