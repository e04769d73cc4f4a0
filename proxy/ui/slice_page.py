"""The slice replay page: the records of a time range (and model, stack) replayed on their own stacks or on a live
one, and how far the answers agreed, against a requirement.

It is `stackpin replay --since ...` run inside the proxy: the same walk and tally (proxy/evidence/slice_replay.py),
each record replayed through the API's own replay (`counted_replay`) as its own tenant's, so every replay is a
record linked to its original. The viewer replays only the records it may read. The form's bounds keep one click
from flooding a fleet; a longer slice is the command line's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from proxy.app_keys import PROXY, REGISTRY, STORE
from proxy.audit import AuditRecord, RecordFilter
from proxy.errors import StackpinError
from proxy.evidence.agreement import FAILED, LEVELS, Requirement, parse_requirement
from proxy.evidence.slice_replay import ReplayFailed, replay_slice
from proxy.pins import Pin
from proxy.serving.handlers import counted_replay
from proxy.serving.router import live_stacks
from proxy.ui.filters import moment
from proxy.ui.render import render
from proxy.ui.security import VIEWER, Viewer

BOUNDS = {"limit": (1, 500), "concurrency": (1, 8), "rate": (0, 50)}
DEFAULTS = {"since": "", "until": "", "model": "", "stack": "", "on": "", "require": "identical>=1.0",
            "limit": "100", "concurrency": "4", "rate": "10"}  # fmt: skip
STOPPING = frozenset({401, 403, 409})  # every other replay would be refused alike: the page says why


@dataclass(frozen=True)
class SliceForm:
    selected: RecordFilter
    on: str | None  # a live stack's fingerprint; None: each record's own
    requirement: Requirement
    limit: int
    concurrency: int
    rate: int


def read_form(form: Mapping[str, Any], viewer: Viewer, live: set[str]) -> tuple[SliceForm | None, list[str]]:
    text = {key: str(form.get(key, default)).strip() for key, default in DEFAULTS.items()}
    problems: list[str] = []
    since, until = moment(text["since"], "since", problems), moment(text["until"], "until", problems)
    if since is None and not problems:
        problems.append("since: the slice starts at a time (UTC), e.g. 2026-12-01T09:30")
    numbers: dict[str, int] = {}
    for key, (low, high) in BOUNDS.items():
        numbers[key] = int(text[key]) if text[key].isdigit() else -1
        if not low <= numbers[key] <= high:
            problems.append(f"{key}: a whole number from {low} to {high}")
    requirement = None
    try:
        requirement = parse_requirement(text["require"])
    except ValueError as e:
        problems.append(f"require: {e}")
    if text["on"] and text["on"] not in live:
        problems.append("on: the stack chosen to replay on is not live any more; choose one from the list")
    selected = None
    try:
        selected = RecordFilter(since=since, until=until, model=text["model"] or None,
                                fingerprint=text["stack"].lower() or None, tenant=viewer.scope)  # fmt: skip
    except ValidationError as e:
        problems.extend(str(error["msg"]).removeprefix("Value error, ") for error in e.errors())
    if problems or selected is None or requirement is None:
        return None, problems
    return SliceForm(selected, text["on"] or None, requirement, **numbers), []


async def slice_form(request: web.Request) -> web.Response:
    return _page(request, dict(DEFAULTS), [], None)


async def slice_replay(request: web.Request) -> web.Response:
    form = await request.post()
    shown = {key: str(form.get(key, default)) for key, default in DEFAULTS.items()}
    live = {s["fingerprint"] for s in live_stacks(request.config_dict[REGISTRY].all())}
    wanted, problems = read_form(form, request[VIEWER], live)
    if wanted is None:
        return _page(request, shown, problems, None, status=400)
    proxy = request.config_dict[PROXY]
    pin = Pin(stack=wanted.on) if wanted.on else None

    async def replay(record: AuditRecord) -> dict[str, Any]:
        try:
            # The replay belongs to the record's tenant, beside its original, whoever asked for it.
            replay_id, comparison, stack = await counted_replay(proxy, record, record.tenant, pin)
        except StackpinError as e:
            if e.status in STOPPING:
                raise
            raise ReplayFailed(e.message) from e
        return {"record": record.id, "replay_record": replay_id, "stack": stack, **comparison.as_json()}

    report = await replay_slice(
        request.config_dict[STORE],
        wanted.selected,
        replay,
        concurrency=wanted.concurrency,
        rate=wanted.rate or None,
        limit=wanted.limit,
    )
    return _page(request, shown, [], report.as_json(wanted.requirement))


def _page(
    request: web.Request,
    form: dict[str, str],
    problems: list[str],
    report: dict[str, Any] | None,
    *,
    status: int = 200,
) -> web.Response:
    live = live_stacks(request.config_dict[REGISTRY].all())
    return render(
        request,
        "slice.html",
        status=status,
        form=form,
        problems=problems,
        report=report,
        levels=[*LEVELS, FAILED],
        live=live,
    )
