"""`stackpin replay --batch ID`: replay every answered line of a batch through a running proxy, and report the
batch's agreement.

The batch's own record (`rec_<hex>` for `batch_<hex>`) names each line's record; each is replayed as
`stackpin replay RECORD` would replay it (`POST /v1/records/{id}/replay`), a few at a time. Lines that got an error
have no answer and are not replayed. Exit 0 when every answered line reproduced, 1 when one diverged, 2 when the
batch cannot be read, is not finished, or a line could not be replayed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp

from proxy.commands.proxy_client import EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, auth_headers
from proxy.evidence.compare import where
from proxy.pins import parse_pin_header
from proxy.state.batches import batch_record_id

CONCURRENCY = 4


class BatchUnreadable(Exception):
    pass


async def replay_batch(
    target: tuple[str, str | None], batch_id: str, *, on: str | None, as_json: bool
) -> int:
    url, api_key = target
    body: dict[str, Any] = {"on": parse_pin_header(on).model_dump(exclude_none=True)} if on else {}
    try:
        async with aiohttp.ClientSession(headers=auth_headers(api_key)) as session:
            records = await _line_records(session, url, batch_id)
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(record_id: str) -> tuple[str, int, dict[str, Any]]:
                async with gate, session.post(f"{url}/v1/records/{record_id}/replay", json=body) as response:
                    return record_id, response.status, await response.json(content_type=None)

            results = await asyncio.gather(*(one(record_id) for record_id in records))
    except (aiohttp.ClientError, BatchUnreadable) as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR
    summary = _summary(batch_id, results)
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        _print(summary)
    if summary["errors"]:
        return EXIT_ERROR
    return EXIT_OK if not summary["diverged"] else EXIT_DIVERGED


async def _line_records(session: aiohttp.ClientSession, url: str, batch_id: str) -> list[str]:
    """The records of the batch's answered lines, in input order, from the batch's own record."""
    async with session.get(f"{url}/v1/batches/{batch_id}") as response:
        batch = await response.json(content_type=None)
        if response.status != 200:
            raise BatchUnreadable(_message(batch, f"batch {batch_id} cannot be read ({response.status})"))
    if batch.get("status") not in ("completed", "cancelled", "failed"):
        raise BatchUnreadable(f"batch {batch_id} is {batch.get('status')}; replay it once it has ended")
    record_id = batch_record_id(batch_id)
    async with session.get(f"{url}/v1/records/{record_id}") as response:
        record = await response.json(content_type=None)
        if response.status != 200:
            raise BatchUnreadable(_message(record, f"batch {batch_id} has no record ({response.status})"))
    answer = next((e for e in record["entries"] if e["part"] == "answer"), None)
    if answer is None:
        raise BatchUnreadable(f"batch {batch_id}'s record holds no lines")
    return [line["record"] for line in answer["content"]["lines"] if line["record"] is not None]


def _message(body: Any, fallback: str) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message")) if isinstance(error, dict) else fallback


def _summary(batch_id: str, results: list[tuple[str, int, dict[str, Any]]]) -> dict[str, Any]:
    identical = [r for r, status, body in results if status == 200 and body.get("outcome") == "reproduced"]
    diverged = [
        {"record": r, "replay_record": body["replay_record"], "at": where(body), "reason": body.get("reason")}
        for r, status, body in results
        if status == 200 and body.get("outcome") != "reproduced"
    ]
    errors = [
        {"record": r, "error": _message(body, f"status {status}")}
        for r, status, body in results
        if status != 200
    ]
    return {"batch": batch_id, "replayed": len(results), "identical": len(identical), "diverged": diverged,
            "errors": errors}  # fmt: skip


def _print(summary: dict[str, Any]) -> None:
    print(
        f"batch {summary['batch']}: {summary['replayed']} answered lines replayed, {summary['identical']} identical, "
        f"{len(summary['diverged'])} diverged, {len(summary['errors'])} could not be replayed"
    )
    for item in summary["diverged"]:
        print(
            f"  diverged: {item['record']} (replay {item['replay_record']}) at {item['at']} ({item['reason']})"
        )
    for item in summary["errors"]:
        print(f"  error: {item['record']}: {item['error']}")
