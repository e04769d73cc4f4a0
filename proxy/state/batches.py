"""The Batch API's pure parts: a batch request and its input file read and checked, the ids a batch gives its lines'
records, its output and error files, the batch object the API shows, and the batch's own entry in the log.

A batch's id is `batch_<hex>`, and its own record `rec_<hex>`: one `answer` entry, appended when it ends, naming its
input and output files by SHA-256 and every line's record. Each line's record id is derived from the batch's id and
the line's place (`line_record_id`), so a line answered before a proxy stopped is found again by its record, and
never answered twice. Lines are served through the ordinary serving path (proxy/state/batch_run.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proxy.audit import SealedEntry, seal
from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, check_request
from proxy.errors import BadRequest, NotFound
from proxy.state.batch_lines import DoneLine
from proxy.state.files import StoredFile
from proxy.state.jobs import Job

BATCH_ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
BATCHES = "/v1/batches"
COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    body: dict[str, Any]


def batch_hex(batch_id: str) -> str:
    hex_id = batch_id.removeprefix("batch_")
    if len(hex_id) != 32 or not all(c in "0123456789abcdef" for c in hex_id) or hex_id == batch_id:
        raise NotFound(f"no batch {batch_id!r} (batch ids look like batch_<32 hex>)", param="batch_id")
    return hex_id


def batch_record_id(batch_id: str) -> str:
    return f"rec_{batch_hex(batch_id)}"


def line_record_id(batch_id: str, line: int) -> str:
    """The record id of a line's answer: unguessable as the batch's id is, and the same on every proxy."""
    return "rec_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:32]


def output_file_id(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def create_options(body: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """`input_file_id`, `endpoint` and `metadata` of `POST /v1/batches`; a 400 naming what is wrong."""
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    if not isinstance(file_id, str) or not file_id:
        raise BadRequest(
            "input_file_id must name a file you uploaded with purpose 'batch'", param="input_file_id"
        )
    if endpoint not in BATCH_ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    if body.get("completion_window", COMPLETION_WINDOW) != COMPLETION_WINDOW:
        raise BadRequest(f"completion_window must be {COMPLETION_WINDOW!r}", param="completion_window")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadRequest("metadata must be an object of strings", param="metadata")
    return file_id, endpoint, metadata


def read_lines(content: bytes, endpoint: str, *, max_lines: int) -> list[BatchLine]:
    """The requests of an input file (JSON Lines: custom_id, method, url, body); a 400 naming the first bad line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the input file is not UTF-8 text (JSON Lines)", param="input_file_id") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = _read_line(raw, number, endpoint)
        if line.custom_id in seen:
            raise BadRequest(
                f"input line {number}: custom_id {line.custom_id!r} appears twice", param="input_file_id"
            )
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > max_lines:
            raise BadRequest(f"the input file has more than {max_lines} requests ([batches] max_lines)",
                             param="input_file_id")  # fmt: skip
    if not lines:
        raise BadRequest("the input file holds no request", param="input_file_id")
    return lines


def _read_line(raw: str, number: int, endpoint: str) -> BatchLine:
    def bad(why: str) -> BadRequest:
        return BadRequest(f"input line {number}: {why}", param="input_file_id")

    try:
        value = json.loads(raw)
    except ValueError:
        raise bad("not a JSON object") from None
    if not isinstance(value, dict):
        raise bad("not a JSON object")
    custom_id, body = value.get("custom_id"), value.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad("custom_id must be a non-empty string")
    if value.get("method", "POST") != "POST":
        raise bad("method must be POST")
    if value.get("url") != endpoint:
        raise bad(f"url must be the batch's endpoint, {endpoint}")
    if not isinstance(body, dict):
        raise bad("body must be a JSON object")
    if body.get("stream") or body.get("background"):
        raise bad("a batch's requests are neither streamed nor run in the background")
    try:
        check_request(endpoint, body, False)
    except BadRequest as e:
        raise bad(e.message) from None
    return BatchLine(custom_id, body)


def output_line(batch_id: str, done: DoneLine) -> dict[str, Any]:
    """One line of the output (an answer) or error file, as OpenAI writes it; `request_id` is the answer's record."""
    line_hex = line_record_id(batch_id, done.line).removeprefix("rec_")
    return {"id": f"batch_req_{line_hex}", "custom_id": done.custom_id, "error": None,
            "response": {"status_code": done.status_code, "request_id": done.record_id, "body": done.body}}  # fmt: skip


def output_contents(batch_id: str, done: list[DoneLine]) -> tuple[bytes, bytes]:
    """The output file (every line answered) and the error file (every line that got an error), in input order."""
    answered = [output_line(batch_id, d) for d in done if d.status_code < 300]
    failed = [output_line(batch_id, d) for d in done if d.status_code >= 300]
    return _jsonl(answered), _jsonl(failed)


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()


def batch_object(job: Job, counts: tuple[int, int]) -> dict[str, Any]:
    """The batch as `GET /v1/batches/{id}` shows it."""
    detail, request = job.detail, job.request
    created = int(job.created_at.timestamp())
    status = _status(job)
    completed, failed = counts
    return {
        "id": job.id, "object": "batch", "endpoint": request["endpoint"], "errors": None,
        "input_file_id": request["input_file_id"], "completion_window": COMPLETION_WINDOW, "status": status,
        "output_file_id": detail.get("output_file_id"), "error_file_id": detail.get("error_file_id"),
        "created_at": created, "in_progress_at": _when(job.started_at), "expires_at": created + WINDOW_S,
        "finalizing_at": detail.get("finalizing_at"), "completed_at": _when(job.finished_at, job.outcome == "completed"),
        "failed_at": _when(job.finished_at, job.outcome == "failed"), "expired_at": None,
        "cancelling_at": detail.get("cancelling_at"), "cancelled_at": _when(job.finished_at, job.outcome == "cancelled"),
        "request_counts": {"total": request["lines"], "completed": completed, "failed": failed},
        "metadata": request.get("metadata") or {},
        **({"errors": {"object": "list", "data": [detail["error"]]}} if detail.get("error") else {}),
    }  # fmt: skip


def _status(job: Job) -> str:
    if job.state == "finished":
        return job.outcome or "failed"
    if job.cancel_requested:
        return "cancelling"
    if job.state == "queued":
        return "validating"
    return "finalizing" if job.detail.get("finalizing_at") else "in_progress"


def _when(moment: datetime | None, applies: bool = True) -> int | None:
    return int(moment.timestamp()) if moment is not None and applies else None


def batch_entry(
    job: Job,
    outcome: str,
    input_file: StoredFile,
    files: list[StoredFile],
    done: list[DoneLine],
    now: datetime,
) -> SealedEntry:
    """The batch's own record: its request, its files by SHA-256, and every line's record, in input order."""
    content = {
        "endpoint": BATCHES,
        "batch": {"id": job.id, "endpoint": job.request["endpoint"], "metadata": job.request.get("metadata") or {},
                  "created_at": job.created_at.isoformat(), "outcome": outcome},
        "input_file": _file_ref(input_file),
        "output_files": [_file_ref(f) for f in files],
        "lines": [{"line": d.line, "custom_id": d.custom_id, "record": d.record_id, "status_code": d.status_code}
                  for d in done],
        "answered_at": now.isoformat(),
    }  # fmt: skip
    return seal(record_id=batch_record_id(job.id), part="answer", tenant=job.tenant, created_at=now,
                status=outcome, content=content)  # fmt: skip


def _file_ref(stored: StoredFile) -> dict[str, Any]:
    return {"id": stored.id, "purpose": stored.purpose, "bytes": stored.bytes, "sha256": stored.sha256}
