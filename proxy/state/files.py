"""Files: a batch's input as a client uploads it (purpose `batch`) and the output and error files a batch writes
(purpose `batch_output`), kept whole in the audit database, tenant-scoped, with their SHA-256 (which a batch's
entry in the log names). Their size is bounded where they are uploaded (`[batches] max_file_bytes`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from proxy.state.database import StateDatabase
from proxy.state.tables import FILES

META = [FILES.c[name] for name in ("id", "tenant", "purpose", "filename", "bytes", "sha256", "created_at")]


@dataclass(frozen=True)
class StoredFile:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    sha256: str
    created_at: datetime

    def as_json(self) -> dict[str, Any]:
        """The file object, as OpenAI's API shows it."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at.timestamp()),
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None, "sha256": self.sha256}  # fmt: skip


class Files:
    def __init__(self, db: StateDatabase) -> None:
        self._db = db

    async def put(
        self, file_id: str, tenant: str, purpose: str, filename: str, content: bytes, now: datetime
    ) -> StoredFile:
        """Stores a file; one that exists under this id already (a batch's output written twice) is kept as it is."""
        stored = StoredFile(
            file_id, tenant, purpose, filename, len(content), hashlib.sha256(content).hexdigest(), now
        )
        try:
            async with self._db.write() as connection:
                await connection.execute(FILES.insert().values(**stored.__dict__, content=content))
        except IntegrityError:
            found = await self.get(file_id, tenant)
            assert found is not None, f"file {file_id} exists under another tenant"
            return found
        return stored

    async def get(self, file_id: str, tenant: str) -> StoredFile | None:
        async with self._db.read() as connection:
            row = (
                await connection.execute(select(*META).where(FILES.c.id == file_id, FILES.c.tenant == tenant))
            ).one_or_none()
        return None if row is None else StoredFile(*row)

    async def content(self, file_id: str, tenant: str) -> bytes | None:
        async with self._db.read() as connection:
            return (
                await connection.execute(
                    select(FILES.c.content).where(FILES.c.id == file_id, FILES.c.tenant == tenant)
                )
            ).scalar_one_or_none()

    async def listed(self, tenant: str, purpose: str | None, limit: int) -> list[StoredFile]:
        """The tenant's files, newest first."""
        query = select(*META).where(FILES.c.tenant == tenant)
        if purpose is not None:
            query = query.where(FILES.c.purpose == purpose)
        query = query.order_by(FILES.c.created_at.desc(), FILES.c.id.desc()).limit(limit)
        async with self._db.read() as connection:
            return [StoredFile(*row) for row in await connection.execute(query)]
