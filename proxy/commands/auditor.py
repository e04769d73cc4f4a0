"""The auditor's commands: `verify`, `audit` and `records` read the audit store directly, not through the proxy.

They need the database URL, not an API key: whoever can read the database can read every tenant's records, so
these commands are for operators and auditors. Trust comes from outside the database: the log's public keys,
and the checkpoints witnesses hold or someone kept.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pydantic import ValidationError

from proxy.audit import AuditError, AuditRecord, AuditStore, NoteError, Verifier, Witnessed
from proxy.audit.receipts import Receipt
from proxy.audit.store import LIST_LIMIT_MAX
from proxy.config import StoreSettings

EXIT_OK, EXIT_BROKEN, EXIT_ERROR = 0, 1, 2


@asynccontextmanager
async def _store(settings: StoreSettings) -> AsyncIterator[AuditStore]:
    store = await AuditStore.open(settings.url, schema=settings.postgres_schema)
    try:
        yield store
    finally:
        await store.close()


async def verify(
    store_settings: StoreSettings,
    log_keys: list[Verifier],
    witnessed: list[Witnessed],
    receipts: list[Receipt] | None = None,
) -> int:
    async with _store(store_settings) as store:
        report = await store.verify(verifiers=log_keys, witnessed=witnessed, receipts=receipts)
        streams = await store.stream_counts()
    print(
        f"checked {report.entries_checked} entries (the tree rebuilt from their bytes), {report.nodes_checked} "
        f"tree nodes, {report.checkpoints_checked} checkpoints, {report.stacks_checked} stacks, "
        f"{report.prompts_checked} prompts; {report.pending} entries wait to be integrated"
    )
    print(
        f"streams: {streams.marked_at_start} marked interrupted at a proxy's start (left open by a proxy that "
        f"stopped), {streams.open} open now"
    )
    if report.signatures_checked:
        print(f"signatures checked with {', '.join(key.vkey for key in log_keys)}")
    else:
        print("WARNING: signatures NOT checked: no trusted log key (--log-key, or [log] public_keys)")
    if witnessed:
        print(f"{report.witnessed_checked} checkpoints held outside the database matched")
    signed = "each signed by the log's key" if report.signatures_checked else "their signatures NOT checked"
    print(f"receipts the log keeps: {report.stored_receipts_checked} name their own entries, {signed}")
    print(
        f"payloads: {report.payloads_checked} kept, each hashing to what its entry commits to; "
        f"{report.payloads_erased} erased, each named by an erasure entry"
    )
    if receipts:
        print(
            f"receipts given: {report.receipts_checked} of {len(receipts)} fulfilled (their entries in the tree), "
            f"{report.receipts_pending} committed and waiting to be integrated"
        )
    print(f"tree: size {report.tree_size}, root {report.root_hash}")
    if report.ok:
        print("log intact")
        if report.checkpoint:
            print("latest checkpoint (keep it elsewhere, or have a witness keep it):")
            for line in report.checkpoint.splitlines():
                print(f"  {line}")
        return EXIT_OK
    problem = report.problem
    assert problem is not None
    print(f"LOG BROKEN: {problem.model_dump_json()}")
    return EXIT_BROKEN


async def audit(
    store_settings: StoreSettings, record_id: str, log_keys: list[Verifier], *, as_json: bool
) -> int:
    async with _store(store_settings) as store:
        record = await store.get_record(record_id, None)
        if record is None:
            print(f"no record {record_id!r}")
            return EXIT_ERROR
        try:
            checks, checkpoint = await store.check_record(record_id, log_keys)
        except NoteError as e:
            print(f"LOG BROKEN: the latest checkpoint does not verify: {e}")
            return EXIT_BROKEN
    entries_ok = all(check.ok for check in checks)
    if as_json:
        print(
            json.dumps(
                {
                    "record": record.model_dump(mode="json"),
                    "entries": [{**check.model_dump(mode="json"), "ok": check.ok} for check in checks],
                    "checkpoint": None if checkpoint is None else checkpoint.model_dump(mode="json"),
                    "signature_checked": bool(log_keys),
                    "entries_ok": entries_ok,
                },
                indent=2,
                sort_keys=True,
            )
        )
        return EXIT_OK if entries_ok else EXIT_BROKEN
    print(f"record   {record.id}")
    print(f"tenant   {record.tenant}")
    print(f"created  {record.created_at.isoformat()}")
    print(f"status   {record.status}" + (f"   replay of {record.replay_of}" if record.replay_of else ""))
    print(f"replica  {record.replica}")
    print(
        f"stack    {record.fingerprint}"
        + ("  (declared by configuration, not proved)" if record.stack_declared else "")
    )
    for line in json.dumps(record.stack, indent=2, sort_keys=True).splitlines():
        print(f"  {line}")
    if record.prompt_sha256:
        print(f"prompt   sha256 {record.prompt_sha256}")
        for line in (record.prompt_text or "").splitlines():
            print(f"  | {line}")
    for line in answer_lines(record):
        print(line)
    size = "no checkpoint yet" if checkpoint is None else f"checkpoint of size {checkpoint.tree_size}"
    signed = "signature checked" if log_keys else "signature NOT checked: no trusted log key"
    for check in checks:
        where = "not yet in the tree" if check.index is None else f"leaf {check.index}"
        verdict = {True: f"proven in the {size}", False: f"NOT proven in the {size}", None: "pending"}[
            check.included
        ]
        payload = {None: "", "matches": ", payload matches", "erased": ", payload erased"}.get(
            check.payload, ", PAYLOAD DOES NOT MATCH"
        )
        print(
            f"entry    seq {check.seq} {check.part} ({where}) {check.sha256}: "
            f"{'recomputes' if check.recomputes else 'DOES NOT RECOMPUTE'}, {verdict}{payload}"
        )
    print(f"log      {size}, {signed}")
    for flag in record.flags:
        print(f"FLAGGED  seq {flag.seq} {flag.status}: {json.dumps(flag.content, sort_keys=True)}")
    return EXIT_OK if entries_ok else EXIT_BROKEN


def answer_lines(record: AuditRecord) -> list[str]:
    """What the client got, choice by choice (or embedding, or output item), for reading."""
    if record.erased:
        return [f"answer   (none: its {record.erasure()})"]
    parts = {entry.part: entry.content for entry in record.entries}
    opened = parts.get("answer") or parts.get("opened") or {}
    endpoint = opened.get("endpoint", "")
    if "answer" in parts:
        body, lines = parts["answer"].get("response") or {}, []
    elif "closed" in parts:
        closed = parts["closed"]
        body = closed.get("answer") or {}
        lines = (
            [f"stream   {len(closed.get('events') or [])} events kept byte for byte"]
            if "events" in closed
            else []
        )
        if "tokens" in closed:  # recorded before records kept every choice
            body = {
                "choices": [
                    {
                        "index": 0,
                        "text": closed["tokens"].get("text"),
                        "finish_reason": closed["tokens"].get("finish_reason"),
                    }
                ]
            }
    else:
        return ["answer   (none yet: the stream has not closed)"]
    lines.append(f"endpoint {endpoint}")
    if isinstance(body.get("data"), list):
        for item in body["data"]:
            vector = item.get("embedding") if isinstance(item, dict) else None
            size = f"{len(vector)} dimensions" if isinstance(vector, list) else "base64"
            lines.append(f"data[{item.get('index')}]  embedding, {size}")
    for choice in body.get("choices") or []:
        lines += _choice_lines(choice)
    for i, item in enumerate(body.get("output") or []):
        lines += _output_lines(i, item)
    if body.get("usage") is not None:
        lines.append(f"usage    {json.dumps(body['usage'], sort_keys=True)}")
    return lines


def _choice_lines(choice: dict[str, Any]) -> list[str]:
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    lines = [f"choice   {choice.get('index')}  finish_reason={choice.get('finish_reason')}"]
    text = message.get("content") if message else choice.get("text")
    if text is not None:
        lines.append(f"  text     {_short(text)}")
    if message.get("refusal"):
        lines.append(f"  refusal  {_short(message['refusal'])}")
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        lines.append(f"  tool     {call.get('id')} {function.get('name')}({function.get('arguments')})")
    if message.get("function_call"):
        call = message["function_call"]
        lines.append(f"  function {call.get('name')}({call.get('arguments')})")
    return lines


def _output_lines(index: int, item: dict[str, Any]) -> list[str]:
    if item.get("type") == "function_call":
        return [
            f"output   {index}  function_call {item.get('call_id')} {item.get('name')}({item.get('arguments')})"
        ]
    texts = [
        p.get("text") or p.get("refusal") or "" for p in item.get("content") or [] if isinstance(p, dict)
    ]
    return [
        f"output   {index}  {item.get('type')} status={item.get('status')}",
        f"  text     {_short(''.join(texts))}",
    ]


def _short(text: Any, limit: int = 240) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


async def list_records(store_settings: StoreSettings, filters: dict[str, Any], *, as_json: bool) -> int:
    limit = filters["limit"]
    try:
        async with _store(store_settings) as store:
            # One more than shown, to know whether the listing stops short of the end.
            records = await store.list_records(**{**filters, "limit": min(limit + 1, LIST_LIMIT_MAX)})
    except AuditError as e:
        print(f"stackpin: {e}")
        return EXIT_ERROR
    except ValidationError as e:  # a filter the listing cannot use, e.g. a --stack that is not hex
        print(f"stackpin: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
        return EXIT_ERROR
    except ValueError as e:  # --before a record that is not there
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR
    more = len(records) > limit or len(records) == LIST_LIMIT_MAX
    records = records[:limit]
    if more:
        # On stderr, so that --json output stays one JSON document.
        print(
            f"stopped at the limit of {limit} records; the next page: --before {records[-1].id} "
            f"(or a larger --limit, up to {LIST_LIMIT_MAX})",
            file=sys.stderr,
        )
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in records], indent=2, sort_keys=True))
        return EXIT_OK
    for r in records:
        flag = " FLAGGED" if r.flagged else ""
        replay = f" replay-of={r.replay_of}" if r.replay_of else ""
        print(
            f"{r.id}  {r.created_at.isoformat(timespec='seconds')}  {r.tenant:<10} {r.model or '-':<20} "
            f"{(r.fingerprint or '-')[:12]}  {r.status}{replay}{flag}"
        )
    if not records:
        print("no records match")
    return EXIT_OK
