"""Dispatch: send one request to a replica that matches its pin, retrying only on the identical fingerprint.

Failures worth a retry (connection, timeout, 5xx, an answer from another stack than the replica proved) move on to
the next replica of the first choice's exact fingerprint until none is left or the deadline passes. A replica that
answers under another fingerprint than the one it proved is quarantined on the spot (invariant 3), and its answer
is thrown away, never served. An answer that is not an OpenAI response (`ReplicaGarbage`) is not retried: it
leaves dispatch as the client's 502. What the request was dispatched to is a `ReplicaSnapshot`, taken when the
replica is chosen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog

from proxy.errors import NoLiveReplica, ReplicaFailed, ReplicaUnavailable, StackMismatch
from proxy.pins import Pin
from proxy.replicas.registry import Registry, ReplicaSnapshot
from proxy.serving.router import choose
from proxy.stack import short

T = TypeVar("T")
log = structlog.get_logger("stackpin.dispatch")


@dataclass(frozen=True)
class Dispatched(Generic[T]):
    replica: ReplicaSnapshot  # as it was when chosen: what the record says served the request
    body: dict[str, Any]
    result: T


async def dispatch(
    registry: Registry,
    pin: Pin,
    body: dict[str, Any],
    send: Callable[[ReplicaSnapshot, dict[str, Any]], Awaitable[T]],
    *,
    endpoint: str | None = None,
    deadline_s: float,
    on_mismatch: Callable[[StackMismatch], Awaitable[None]],
) -> Dispatched[T]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    tried: set[str] = set()
    fingerprint: str | None = None
    last_failure = ""
    while True:
        try:
            replica = choose(
                registry.all(), pin, endpoint=endpoint, exclude=tried, fingerprint=fingerprint
            ).snapshot()
        except NoLiveReplica as e:
            if not tried:
                raise
            raise ReplicaFailed(
                f"every replica of stack {short(fingerprint or '')} failed ({', '.join(sorted(tried))}); "
                f"last failure: {last_failure}",
                extra=e.extra,
            ) from e
        fingerprint = replica.fingerprint
        forwarded = {**body, "model": replica.stack.model}
        try:
            result = await send(replica, forwarded)
        except ReplicaUnavailable as e:
            last_failure = f"{replica.name}: {e}"
            log.warning("replica_failed", replica=replica.name, error=str(e))
            # A self-described replica comes back when the health monitor reaches it again; a declared upstream
            # has no stack to describe, so no check would ever bring it back: it stays in rotation on its
            # declaration.
            if e.down and replica.self_described:
                registry.unreachable(replica.name)
        except StackMismatch as e:
            last_failure = str(e)
            await on_mismatch(e)
        else:
            return Dispatched(replica, forwarded, result)
        tried.add(replica.name)
        if loop.time() >= deadline:
            raise ReplicaFailed(
                f"no replica of stack {short(fingerprint or '')} answered in {deadline_s} s: {last_failure}"
            )
