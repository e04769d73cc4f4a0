"""Choosing a replica: the pure decision, from the pin and the registry's view, of who may serve a request.

Only replicas in rotation whose stack matches the pin, and that serve the request's route, are candidates. A model
that no known stack has is a 404 `model_not_found`, as OpenAI answers it; a pin that no known stack matches, or
none that serves the route, a 409; matches none of whose replicas is in rotation, a 503. The first choice is the
least-outstanding candidate; retries go only to replicas of that first choice's exact fingerprint (invariant 2),
so a request can never drift to another stack because a replica failed.
"""

from __future__ import annotations

from typing import Any

from proxy.endpoints import ENDPOINTS
from proxy.errors import ModelNotFound, NoLiveReplica, NoMatchingStack
from proxy.pins import Pin
from proxy.replicas.registry import Replica
from proxy.stack import short


def choose(
    replicas: list[Replica],
    pin: Pin,
    *,
    endpoint: str | None = None,
    exclude: set[str] = frozenset(),
    fingerprint: str | None = None,
) -> Replica:  # type: ignore[assignment]
    """The replica to try next; `fingerprint` restricts a retry to the first choice's exact stack, `endpoint` the
    candidates to replicas that serve that route."""
    known = [r for r in replicas if r.stack is not None and r.fingerprint is not None]
    if pin.model is not None and pin.model not in {r.stack.model for r in known if r.stack is not None}:
        raise _model_not_found(pin.model, replicas, unproved=len(replicas) - len(known))
    matching = [r for r in known if pin.matches(r.stack, r.fingerprint)]  # type: ignore[arg-type]
    if fingerprint is not None:
        matching = [r for r in matching if r.fingerprint == fingerprint]
    if not matching:
        raise NoMatchingStack(
            f"no stack matches the pin {pin.describe()}; live stacks are listed in 'live_stacks'",
            extra={"live_stacks": live_stacks(replicas)},
        )
    if endpoint is not None:
        matching = [r for r in matching if r.serves(endpoint)]
        if not matching:
            raise NoMatchingStack(
                f"no stack that matches the pin {pin.describe()} serves {endpoint}; live stacks and the routes "
                "they serve are listed in 'live_stacks'",
                extra={"live_stacks": live_stacks(replicas)},
            )
    candidates = [r for r in matching if r.in_rotation and r.name not in exclude]
    if not candidates:
        raise NoLiveReplica(
            f"stacks match the pin {pin.describe()} but none of their replicas is in rotation"
            + (f" (tried {', '.join(sorted(exclude))})" if exclude else ""),
            extra={"live_stacks": live_stacks(replicas)},
        )
    # Ties go to the name so that the choice is a function of its inputs.
    return min(candidates, key=lambda r: (r.outstanding, r.name))


def _model_not_found(model: str, replicas: list[Replica], *, unproved: int) -> ModelNotFound:
    live = sorted({s["stack"]["model"] for s in live_stacks(replicas)})
    waiting = f"; {unproved} replica(s) have not proved their stack yet" if unproved else ""
    return ModelNotFound(
        f"the model {model!r} does not exist here: no replica serves it (live models: "
        f"{', '.join(live) or 'none'}{waiting}); live stacks are listed in 'live_stacks'",
        param="model",
        extra={"live_stacks": live_stacks(replicas)},
    )


def live_stacks(replicas: list[Replica]) -> list[dict[str, Any]]:
    """What a client can pin today: every stack in rotation, with its replicas."""
    stacks: dict[str, dict[str, Any]] = {}
    for replica in replicas:
        if not replica.in_rotation or replica.stack is None or replica.fingerprint is None:
            continue
        entry = stacks.setdefault(
            replica.fingerprint,
            {
                "fingerprint": replica.fingerprint,
                "short": short(replica.fingerprint),
                "declared": replica.stack_source == "declared",
                "stack_source": replica.stack_source.value,
                "stack": replica.stack.document(),
                "replicas": [],
                "serves": [e for e in ENDPOINTS if replica.serves(e)],
            },
        )
        entry["replicas"].append(replica.name)
    return sorted(stacks.values(), key=lambda s: s["fingerprint"])
