"""The stacks page: the live stacks, every replica and whether it is in rotation (or quarantined, and why), and
the diff of two stacks' descriptions.

The live stacks are the router's (`live_stacks`), the replicas the registry's, as `GET /v1/stacks` shows them;
replica URLs are not shown (they are the operator's, and a URL can carry credentials). A stack that is not live
can be diffed when it served one of the viewer's records (any record, for an operator): its description is then
read from the audit store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.app_keys import REGISTRY, STORE
from proxy.audit import RecordFilter
from proxy.replicas.registry import Replica
from proxy.serving.router import live_stacks
from proxy.ui.render import render
from proxy.ui.security import VIEWER
from proxy.ui.stackdiff import diff

FINGERPRINT = re.compile(r"^[0-9a-f]{4,64}$")
WHY = {
    "stack_changed": "the stack it proves changed after it was registered",
    "fingerprint_mismatch": "it answered under another fingerprint than the one it proved",
}


@dataclass(frozen=True)
class ReplicaRow:
    name: str
    fingerprint: str | None
    model: str | None
    kernel_mode: str | None
    state: str  # "in rotation", "quarantined", "unreachable", "waiting for its stack"
    why: str | None
    declared: bool
    stack_source: str  # proven, reported or declared
    leased: bool
    outstanding: int
    last_good_check: Any


def replica_row(replica: Replica) -> ReplicaRow:
    if replica.quarantined is not None:
        state, why = "quarantined", f"{replica.quarantined}: {WHY.get(replica.quarantined, 'see the log')}"
    elif replica.in_rotation:
        state, why = "in rotation", None
    elif replica.stack is None:
        state, why = "waiting for its stack", "it has not proved a stack yet"
    else:
        state, why = "unreachable", "its last health check failed"
    return ReplicaRow(
        name=replica.name,
        fingerprint=replica.fingerprint,
        model=replica.stack.model if replica.stack else None,
        kernel_mode=replica.stack.kernel_mode if replica.stack else None,
        state=state,
        why=why,
        declared=replica.stack_source == "declared",
        stack_source=replica.stack_source.value,
        leased=replica.leased,
        outstanding=replica.outstanding,
        last_good_check=replica.last_good_check,
    )


async def stacks(request: web.Request) -> web.Response:
    registry = request.config_dict[REGISTRY]
    live = live_stacks(registry.all())
    chosen = {side: request.query.get(side, "").strip().lower() for side in ("a", "b")}
    if not chosen["a"] and len(live) >= 2:
        chosen = {"a": live[0]["fingerprint"], "b": live[1]["fingerprint"]}
    problems: list[str] = []
    documents = {side: await _document(request, live, fp, problems) for side, fp in chosen.items() if fp}
    rows = diff(documents["a"], documents["b"]) if documents.get("a") and documents.get("b") else []
    return render(
        request,
        "stacks.html",
        live=live,
        replicas=[replica_row(r) for r in sorted(registry.all(), key=lambda r: r.name)],
        chosen=chosen,
        rows=rows,
        problems=problems,
    )


async def _document(
    request: web.Request, live: list[dict[str, Any]], wanted: str, problems: list[str]
) -> dict[str, Any] | None:
    if not FINGERPRINT.match(wanted):
        problems.append(f"{wanted!r} is not a stack fingerprint (4 to 64 lowercase hex digits)")
        return None
    matching = [s for s in live if s["fingerprint"].startswith(wanted)]
    if len(matching) == 1:
        return dict(matching[0]["stack"])
    if len(matching) > 1:
        problems.append(f"{wanted} is the prefix of {len(matching)} live stacks; give more of it")
        return None
    store = request.config_dict[STORE]
    viewer = request[VIEWER]
    if len(wanted) == 64:
        served = await store.count_records(RecordFilter(tenant=viewer.scope, fingerprint=wanted))
        if viewer.operator or served.total:
            document = await store.get_stack(wanted)
            if document is not None:
                return document
    problems.append(f"no live stack, nor a stack that served your records, has the fingerprint {wanted}")
    return None
