"""The stored state a proxy holds, over one database: jobs, a background stream's events, files, a batch's done
lines, conversations. Opened after the audit store, which has checked the schema, on the same URL."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.state.batch_lines import BatchLines
from proxy.state.conversations import Conversations
from proxy.state.database import StateDatabase
from proxy.state.files import Files
from proxy.state.job_events import JobEvents
from proxy.state.jobs import Jobs


@dataclass(frozen=True)
class StateStore:
    db: StateDatabase
    jobs: Jobs
    files: Files
    lines: BatchLines
    events: JobEvents
    conversations: Conversations

    @classmethod
    def open(cls, url: str, *, schema: str | None = None) -> StateStore:
        db = StateDatabase.open(url, schema=schema)
        return cls(
            db=db,
            jobs=Jobs(db),
            files=Files(db),
            lines=BatchLines(db),
            events=JobEvents(db),
            conversations=Conversations(db),
        )

    async def close(self) -> None:
        await self.db.close()
