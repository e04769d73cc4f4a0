"""The records pages: the list with its filters, one record in full, replaying it, and a replay's diff.

Reads go through the audit store's record queries, scoped to the viewer's tenant (an operator's scope is every
tenant); a replay goes through the API's own replay (`counted_replay`), on the record's stack or on a live stack
the form names. Another tenant's record is a 404, as on the API.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from proxy.app_keys import PROXY, REGISTRY, STORE
from proxy.audit import AuditRecord, RecordSummary
from proxy.errors import BadRequest, NotFound, PayloadErased
from proxy.evidence.answers import Tokens, tokens_of
from proxy.pins import Pin
from proxy.serving.handlers import counted_replay
from proxy.serving.router import live_stacks
from proxy.ui.answer import answer_body, token_pieces
from proxy.ui.filters import listing
from proxy.ui.record import record_view
from proxy.ui.render import render
from proxy.ui.security import VIEWER
from proxy.ui.stackdiff import distinguish
from proxy.ui.tokendiff import Side, replay_diff

REPLAYS_SHOWN = 20


async def records(request: web.Request) -> web.Response:
    store = request.config_dict[STORE]
    viewer = request[VIEWER]
    wanted = listing(request.query, viewer)
    try:
        rows = await store.list_records(
            wanted.selected, limit=wanted.limit + 1, before=wanted.before, after=wanted.after
        )
    except ValueError as e:  # a page cursor naming no record
        raise BadRequest(str(e)) from e
    older, newer, rows = _page(rows, wanted.limit, before=wanted.before, after=wanted.after)
    counts = await store.count_records(wanted.selected)
    live = live_stacks(request.config_dict[REGISTRY].all())
    return render(
        request,
        "records.html",
        status=400 if wanted.problems else 200,  # shown beside the form, which says what to fix
        rows=rows,
        counts=counts,
        form=wanted.form,
        problems=wanted.problems,
        older=older,
        newer=newer,
        page_query=_page_query(wanted.form),
        models=sorted({s["stack"]["model"] for s in live}),
        labels={s["fingerprint"]: f"{s['stack']['kernel_mode']} · {s['stack']['hardware']}" for s in live},
    )


def _page(
    rows: list[RecordSummary], limit: int, *, before: str | None, after: str | None
) -> tuple[bool, bool, list[RecordSummary]]:
    """(older pages exist, newer pages exist, the page), from a page fetched one row long, newest first."""
    if after is not None:  # the extra row is the newest
        return True, len(rows) > limit, rows[-limit:]
    return len(rows) > limit, before is not None, rows[:limit]


def _page_query(form: dict[str, str]) -> str:
    return urlencode({key: value for key, value in form.items() if value})


async def record(request: web.Request) -> web.Response:
    store = request.config_dict[STORE]
    viewer = request[VIEWER]
    found = await _record(request, request.match_info["record_id"])
    live = live_stacks(request.config_dict[REGISTRY].all())
    others = [s["stack"] for s in live if s["fingerprint"] != found.fingerprint]
    replays = await store.list_records(replay_of=found.id, tenant=viewer.scope, limit=REPLAYS_SHOWN)
    checks, checkpoint = await store.check_record(found.id)
    statuses = {entry.seq: entry.status for entry in [*found.entries, *found.flags]}
    return render(
        request,
        "record.html",
        view=record_view(found),
        checks=[(check, statuses.get(check.seq, "")) for check in checks],
        verified=all(check.ok for check in checks),
        checkpoint=checkpoint,
        live=live,
        is_live=any(s["fingerprint"] == found.fingerprint for s in live),
        stack_rows=distinguish(found.stack, others) if found.stack is not None else [],
        other_stacks=len(others),
        replays=[await _replay_outcome(request, summary) for summary in replays],
    )


async def _replay_outcome(request: web.Request, summary: RecordSummary) -> dict[str, Any]:
    found = await request.config_dict[STORE].get_record(summary.id, request[VIEWER].scope)
    view = record_view(found) if found is not None else None
    replay = (view.replay or {}) if view is not None else {}
    return {"summary": summary, "outcome": replay.get("outcome"), "comparison": replay.get("comparison", {})}


async def replay_record(request: web.Request) -> web.StreamResponse:
    found = await _record(request, request.match_info["record_id"])
    form = await request.post()
    on = form.get("on")
    pin = Pin(stack=on) if isinstance(on, str) and on and on != found.fingerprint else None
    live = live_stacks(request.config_dict[REGISTRY].all())
    if pin is not None and not any(s["fingerprint"] == on for s in live):
        raise BadRequest("the stack chosen to replay on is not live any more; choose one from the list")
    # The replay belongs to the record's tenant, beside its original, whoever asked for it.
    replay_id, _, _ = await counted_replay(request.config_dict[PROXY], found, found.tenant, pin)
    raise web.HTTPSeeOther(f"/ui/records/{replay_id}/diff")


async def diff(request: web.Request) -> web.Response:
    replayed = await _record(request, request.match_info["record_id"])
    view = record_view(replayed)
    if replayed.erased:
        raise PayloadErased(f"record {replayed.id}'s {replayed.erasure()}: nothing is left to compare")
    if view.replay is None or replayed.replay_of is None:
        raise NotFound(f"record {replayed.id} is not a replay; it has no diff")
    original = await _record(request, replayed.replay_of)
    comparison = view.replay.get("comparison") or {"outcome": view.replay.get("outcome")}
    return render(
        request,
        "diff.html",
        replayed=replayed,
        original=original,
        diff=replay_diff(comparison, _side(original), _side(replayed)),
    )


def _side(found: AuditRecord) -> Side:
    if found.erased:
        raise PayloadErased(f"record {found.id}'s {found.erasure()}: nothing is left to compare")
    body = answer_body(found)
    if body is None:
        raise BadRequest(f"record {found.id} holds no complete answer to compare")
    if not body.get("choices"):  # embeddings and responses: the comparison says where; no tokens to lay out
        return Side(Tokens(text=""))
    return Side(tokens_of(body), token_pieces(body["choices"][0]))


async def _record(request: web.Request, record_id: str) -> AuditRecord:
    found = await request.config_dict[STORE].get_record(record_id, request[VIEWER].scope)
    if found is None:
        raise NotFound(f"no record {record_id!r} that you may read")
    return found
