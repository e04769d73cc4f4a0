"""Reading a study back from the audit log: its measured answers, found by their tags, as the tally a study
continues from and the report is made of.

Every request a study sends is recorded with its tag (proxy/evidence/study.py), so the log holds the whole study:
which side and load each answer was measured at, the prompt it answers, the pin that served it. Reading it back
walks the records since the study began (the tag lives in a record's content, which the listing does not index),
keeps those tagged with the study's id and leaves out its background load. What the records cannot say, they
leave to the caller: how many repeats were planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from proxy.audit import AuditRecord, AuditStore, RecordFilter, RecordSummary
from proxy.errors import BadRequest
from proxy.evidence.log_walk import read_records
from proxy.evidence.prompt_set import label_of
from proxy.evidence.replay import recorded
from proxy.evidence.study import Load, Side, Tag, parse_tag
from proxy.evidence.study_report import Shape, StudyTally
from proxy.pins import Pin


@dataclass
class StudyFound:
    """A study as its records tell it."""

    tally: StudyTally = field(default_factory=StudyTally)
    pins: dict[str, str] = field(default_factory=dict)  # side -> the pin its records were served under
    loads: set[Load] = field(default_factory=set)
    labels: dict[int, str] = field(default_factory=dict)
    first: datetime | None = None
    last: datetime | None = None
    read: int = 0  # records read to find them

    def shape(self) -> Shape:
        sides = [Side(key, pin) for key, pin in sorted(self.pins.items())]
        return Shape(sides, sorted(self.loads), self.labels)


async def read_study(
    store: AuditStore,
    study: str,
    *,
    since: datetime | None,
    until: datetime | None = None,
    tenant: str | None = None,
) -> StudyFound:
    """The study's measured answers among the records from `since` to `until` (tenant None: every tenant's)."""
    found = StudyFound()
    selected = RecordFilter(since=since, until=until, tenant=tenant)
    async for record in read_records(store, selected, _answered):
        found.read += 1
        tag = _tag(record)
        if tag is not None and tag.study == study and tag.prompt is not None:
            _add(found, tag, record)
    return found


def _answered(summary: RecordSummary) -> bool:
    return summary.replay_of is None and summary.status == "complete"


def _tag(record: AuditRecord) -> Tag | None:
    text = record.entries[0].content.get("tag") if record.entries else None
    return parse_tag(text) if isinstance(text, str) else None


def _add(found: StudyFound, tag: Tag, record: AuditRecord) -> None:
    try:
        answer = recorded(record)
    except BadRequest:
        return
    assert tag.prompt is not None
    reply = (200, {"Stackpin-Record": record.id, "Stackpin-Stack": answer.fingerprint}, answer.answered.body)
    found.tally.add(tag.side, tag.load, tag.prompt, reply)
    opened = record.entries[0].content
    pin = opened.get("pin")
    found.pins.setdefault(tag.side, Pin(**pin).describe() if isinstance(pin, dict) else "")
    load = Load.from_label(tag.load)
    if load is not None:
        found.loads.add(load)
    found.labels.setdefault(tag.prompt, label_of(answer.endpoint, answer.client_request))
    found.first = min(found.first or record.created_at, record.created_at)
    found.last = max(found.last or record.created_at, record.created_at)
