"""`stackpin replay --since T [--until T] [--model M] [--stack FP] [--on PIN] [--require LEVEL>=SHARE]`: every
record of a slice of traffic replayed through a running proxy, and how far the answers agree.

The slice is listed from the audit store (`[store]`, as `stackpin records` reads it) a page at a time; each record
is replayed by the proxy's `POST /v1/records/{id}/replay`, so every replay is a record linked to its original.
Exit codes, for a rollout to be gated on: 0 when the agreement meets `--require` (default `identical>=1.0`: every
replay reproduced), 1 when it does not, 2 on an error (nothing in the slice to replay, a stack that nothing live
matches, a proxy or store that cannot be reached, a usage mistake).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import aiohttp
from pydantic import ValidationError

from proxy.audit import AuditError, AuditRecord, AuditStore, RecordFilter
from proxy.commands.progress import progress_on
from proxy.config import Settings
from proxy.errors import BadRequest, ConfigError
from proxy.evidence.agreement import FAILED, LEVELS, Requirement, parse_requirement
from proxy.evidence.slice_replay import NotReplayable, Outcome, ReplayFailed, SliceReport, replay_slice
from proxy.pins import parse_pin_header

EXIT_OK, EXIT_NOT_MET, EXIT_ERROR = 0, 1, 2
SLICE_FILTERS = ("since", "until", "model", "stack", "tenant")
STOPPING = frozenset({401, 403, 409})  # every other replay would meet them too
SHOWN = 10


class Stopped(Exception):
    """A refusal every replay would meet: the slice stops."""


def add_options(replay: argparse.ArgumentParser) -> None:
    slice_ = replay.add_argument_group("a slice of traffic, replayed whole (instead of RECORD)")
    slice_.add_argument("--since", help="ISO 8601 time with its zone, e.g. 2026-12-01T07:22:00+00:00")
    slice_.add_argument("--until", help="ISO 8601 time with its zone (exclusive)")
    slice_.add_argument("--model", help="records of this model")
    slice_.add_argument("--stack", help="records of this stack (a fingerprint or its first characters)")
    slice_.add_argument("--tenant", help="records of this tenant")
    slice_.add_argument(
        "--require",
        default="identical>=1.0",
        metavar="LEVEL>=SHARE",
        help=f"exit 0 only if this share agrees at least this well; LEVEL one of {', '.join(LEVELS[:-1])} "
        "(default identical>=1.0)",
    )
    slice_.add_argument("--concurrency", type=int, default=4, help="replays in flight at once (4)")
    slice_.add_argument(
        "--rate", type=float, default=10.0, help="most replays started a second (10; 0: no bound)"
    )
    slice_.add_argument("--limit", type=int, help="replay at most this many records of the slice")
    slice_.add_argument("--out", type=Path, help="write every replay's outcome here, one JSON line each")


def wants_slice(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in SLICE_FILTERS)


def run(
    args: argparse.Namespace,
    settings: Settings,
    target: tuple[str, str | None],
    moment: Callable[[str, str | None], datetime | None],
) -> int:
    """`moment` reads a time option (`--since`, `--until`), or raises ConfigError saying how to write one."""
    if args.record is not None:
        raise ConfigError("give a RECORD to replay, or a slice (--since, --model, ...), not both")
    try:
        requirement = parse_requirement(args.require)
        on = parse_pin_header(args.on).model_dump(exclude_none=True) if args.on else None
        selected = RecordFilter(
            since=moment("--since", args.since),
            until=moment("--until", args.until),
            model=args.model,
            fingerprint=args.stack,
            tenant=args.tenant,
        )
    except ValidationError as e:
        raise ConfigError(str(e.errors()[0]["msg"]).removeprefix("Value error, ")) from e
    except ValueError as e:
        raise ConfigError(str(e)) from e
    except BadRequest as e:
        raise ConfigError(e.message) from e
    if args.concurrency < 1 or args.rate < 0 or (args.limit is not None and args.limit < 1):
        raise ConfigError("--concurrency and --limit must be at least 1, and --rate not negative")
    try:
        report = asyncio.run(_replay(args, settings, target, selected, on))
    except Stopped as e:
        print(f"stackpin: the slice stopped: {e}", file=sys.stderr)
        return EXIT_ERROR
    except aiohttp.ClientConnectorError as e:
        print(f"stackpin: cannot reach the proxy at {target[0]}: {e}", file=sys.stderr)
        return EXIT_ERROR
    summary = report.as_json(requirement)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        _print(summary, requirement, args.on)
    if report.replayed == report.counts.get(FAILED, 0):
        print("stackpin: nothing in the slice was replayed" + (": every replay failed" if report.replayed else
              " (no complete original matches the filter)"), file=sys.stderr)  # fmt: skip
        return EXIT_ERROR
    return EXIT_OK if summary["requirement"]["met"] else EXIT_NOT_MET


async def _replay(
    args: argparse.Namespace,
    settings: Settings,
    target: tuple[str, str | None],
    selected: RecordFilter,
    on: dict[str, Any] | None,
) -> SliceReport:
    url, api_key = target
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        store = await AuditStore.open(settings.store.url, schema=settings.store.postgres_schema)
    except AuditError as e:
        raise ConfigError(f"the slice is listed from the audit store, which cannot be opened: {e}") from e
    out = args.out.open("w", encoding="utf-8") if args.out else None
    try:
        counts = await store.count_records(selected)
        total = counts.total - counts.replays
        total = min(total, args.limit) if args.limit else total
        progress = progress_on(sys.stderr, total, "replaying the slice")
        timeout = aiohttp.ClientTimeout(total=settings.server.replica_timeout_s + 30)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def replay(record: AuditRecord) -> dict[str, Any]:
                body = {"on": on} if on else {}
                try:
                    async with session.post(
                        f"{url}/v1/records/{record.id}/replay", json=body, headers=headers
                    ) as response:
                        result = await response.json(content_type=None)
                        status = response.status
                except aiohttp.ClientConnectorError:
                    raise
                except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                    raise ReplayFailed(f"{type(e).__name__}: {e}") from e
                if status == 200 and isinstance(result, dict):
                    return result
                message = _message(result, status)
                if status in STOPPING:
                    raise Stopped(message)
                if status == 404:  # another tenant's record, for this key: not this slice's to judge
                    raise NotReplayable(
                        "not yours to replay (another tenant's; narrow the slice with --tenant)"
                    )
                raise ReplayFailed(message)

            def seen(outcome: Outcome) -> None:
                progress.advance(outcome.agreement)
                _line(out, outcome)

            try:
                return await replay_slice(
                    store,
                    selected,
                    replay,
                    concurrency=args.concurrency,
                    rate=args.rate or None,
                    limit=args.limit,
                    on_outcome=seen,
                )
            finally:
                progress.close()
    finally:
        if out is not None:
            out.close()
        await store.close()


def _line(out: IO[str] | None, outcome: Outcome) -> None:
    if out is not None:
        out.write(json.dumps(outcome.as_json(), sort_keys=True) + "\n")


def _message(result: Any, status: int) -> str:
    error = result.get("error") if isinstance(result, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {status}: {message or result}"


def _print(summary: dict[str, Any], requirement: Requirement, on: str | None) -> None:
    print(f"replayed {summary['replayed']} records on {on or 'their own stacks'}")
    for name in (*LEVELS, FAILED):
        count = summary["counts"][name]
        share = summary["at_least"].get(name)
        shown = f"   at least this: {share:.2%}" if share is not None else ""
        print(f"  {name:<12} {count:>7}{shown}")
    for reason, count in summary["skipped"].items():
        print(f"  skipped      {count:>7}   {reason}")
    for title, key in (("route", "by_route"), ("prompt version", "by_prompt")):
        groups = summary[key]
        if len(groups) > 1 or "(none)" not in groups:
            print(f"by {title}:")
            for name, group in groups.items():
                print(f"  {name:<24} {group['replayed']:>7} replayed, {group['identical']:.2%} identical")
    if summary["divergences"]:
        print("first divergences:")
        for outcome in summary["divergences"][:SHOWN]:
            detail = (
                outcome.get("error")
                or f"{outcome['agreement']} at {outcome.get('where')} ({outcome.get('reason')})"
            )
            print(f"  {outcome['record']} -> {outcome.get('replay_record', '(none)')}: {detail}")
    met = summary["requirement"]["met"]
    share = summary["at_least"].get(requirement.level)
    print(
        f"{requirement}: {'met' if met else 'NOT MET'} ({'no replays' if share is None else f'{share:.4f}'})"
    )
