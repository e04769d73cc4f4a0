"""`stackpin export`: the log's entries of a time window, with their proofs, for an auditor's own tools, as JSON
lines or Parquet, streamed page by page from the store (proxy/audit/export.py), so its memory is one page
whatever the window holds.

JSON lines: the first line is `{"checkpoint": {tree_size, root_hash, note}, "since", "until", "tenant"}` (the
checkpoint every proof is against, null when the log has signed none), then one line per entry. Parquet: one row
per entry, the checkpoint's note in the file's metadata (`stackpin.checkpoint`); it needs pyarrow (the `parquet`
extra). Like the auditor's commands it reads the store directly and needs no key.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal

from proxy.audit import AuditStore, NoSuchCheckpoint, SignedCheckpoint
from proxy.audit.export import COLUMNS, Window
from proxy.config import StoreSettings
from proxy.errors import ConfigError

try:  # an optional extra: only Parquet needs it
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - the dev extra installs it
    pa = pq = None

Format = Literal["jsonl", "parquet"]


def schema() -> Any:
    """The Parquet schema of an export's rows (COLUMNS, in their order)."""
    text, number = pa.string(), pa.int64()
    kinds = {"seq": number, "leaf_index": number, "tree_size": number, "proof": pa.list_(text)}
    kinds["payload_erased"] = pa.bool_()
    return pa.schema([(name, kinds.get(name, text)) for name in COLUMNS])


async def export(
    store_settings: StoreSettings,
    window: Window,
    form: Format,
    out: Path | None,
    *,
    page_size: int | None = None,
) -> int:
    """Writes the window's entries to `out` (JSON lines: default stdout); prints how many on stderr."""
    if form == "parquet" and pa is None:
        raise ConfigError("--format parquet needs pyarrow: pip install 'stackpin[parquet]'")
    if form == "parquet" and out is None:
        raise ConfigError("--format parquet writes a file: give it with --out FILE")
    store = await AuditStore.open(store_settings.url, schema=store_settings.postgres_schema)
    try:
        try:
            checkpoint: SignedCheckpoint | None = await store.checkpoint()
        except NoSuchCheckpoint:
            checkpoint = None
        options = {} if page_size is None else {"page_size": page_size}
        pages = store.export(window, checkpoint, **options)
        written = await (
            _parquet(pages, checkpoint, out) if form == "parquet" else _jsonl(pages, checkpoint, window, out)
        )
    finally:
        await store.close()
    size = (
        "no checkpoint yet" if checkpoint is None else f"the checkpoint of tree size {checkpoint.tree_size}"
    )
    print(f"exported {written} entries, proofs against {size}", file=sys.stderr)
    return 0


async def _jsonl(
    pages: AsyncIterator[list[dict[str, Any]]],
    checkpoint: SignedCheckpoint | None,
    window: Window,
    out: Path | None,
) -> int:
    sink: IO[str] = sys.stdout if out is None else out.open("w", encoding="utf-8")
    try:
        head = {
            "checkpoint": None if checkpoint is None else checkpoint.model_dump(mode="json"),
            "since": _moment(window.since),
            "until": _moment(window.until),
            "tenant": window.tenant,
        }
        sink.write(json.dumps(head, sort_keys=True) + "\n")
        written = 0
        async for rows in pages:
            sink.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
            written += len(rows)
        return written
    finally:
        if out is not None:
            sink.close()


async def _parquet(
    pages: AsyncIterator[list[dict[str, Any]]], checkpoint: SignedCheckpoint | None, out: Path | None
) -> int:
    assert out is not None
    metadata = {"stackpin.checkpoint": "" if checkpoint is None else checkpoint.note}
    written = 0
    with pq.ParquetWriter(out, schema().with_metadata(metadata)) as writer:
        async for rows in pages:
            writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=writer.schema))
            written += len(rows)
    return written


def _moment(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()
