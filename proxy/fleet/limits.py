"""Per-tenant rate limits: requests and tokens per minute, counted across every proxy of a fleet.

A tenant's limits come from its `[[tenants]]` entry (`requests_per_minute`, `tokens_per_minute`). Minutes are
fixed windows of the proxy's clock (the epoch minute), so every proxy counts into the same pair of counters: in
Redis for a fleet, in this process for a single proxy, and in this process too while Redis is unreachable (the
limit then holds per proxy, which is looser by the number of proxies, rather than not at all).

A request is admitted, and counted, only while both counters are under their limits; the check and the count are
one Lua script, so two proxies cannot both take the last request of a minute. Tokens are known only when the
answer is, so they are charged afterwards (fire-and-forget): a minute's token limit can be overshot by the
requests already in flight when it is reached, never by new ones.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.errors import RateLimited
from proxy.fleet.documents import FleetKeys
from proxy.fleet.state import FleetUnavailable

WINDOW_S = 60

# KEYS: requests, tokens; ARGV: requests limit, tokens limit (-1: none), expiry in ms.
# Returns {refused (0 none, 1 requests, 2 tokens), requests used, tokens used}.
_TAKE = """
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if rpm >= 0 and requests >= rpm then return {1, requests, tokens} end
if tpm >= 0 and tokens >= tpm then return {2, requests, tokens} end
redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {0, requests + 1, tokens}
"""


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class Taken:
    refused: str | None  # "requests" or "tokens" when over that limit
    requests: int
    tokens: int


def window_of(now: datetime) -> tuple[int, int]:
    """The minute `now` falls in, and the whole seconds until the next one starts (at least 1)."""
    epoch_s = now.timestamp()
    window = int(epoch_s // WINDOW_S)
    return window, max(1, math.ceil((window + 1) * WINDOW_S - epoch_s))


def refusal(requests: int, tokens: int, limits: Limits) -> str | None:
    """Which limit a new request would break, given the minute's counts so far."""
    if limits.requests_per_minute is not None and requests >= limits.requests_per_minute:
        return "requests"
    if limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute:
        return "tokens"
    return None


class WindowCounters(Protocol):
    async def take(self, tenant: str, window: int, limits: Limits) -> Taken: ...

    async def charge(self, tenant: str, window: int, tokens: int) -> None: ...


class LocalCounters:
    """One process's counters: the whole truth for a single proxy, the fallback for a fleet."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], list[int]] = {}

    async def take(self, tenant: str, window: int, limits: Limits) -> Taken:
        self._forget_before(window)
        counts = self._counts.setdefault((tenant, window), [0, 0])
        refused = refusal(counts[0], counts[1], limits)
        if refused is None:
            counts[0] += 1
        return Taken(refused, counts[0], counts[1])

    async def charge(self, tenant: str, window: int, tokens: int) -> None:
        self._counts.setdefault((tenant, window), [0, 0])[1] += tokens

    def _forget_before(self, window: int) -> None:
        for key in [key for key in self._counts if key[1] < window]:
            del self._counts[key]


class RedisCounters:
    def __init__(self, client: aioredis.Redis, keys: FleetKeys) -> None:
        self.client = client
        self.keys = keys
        self._take = client.register_script(_TAKE)

    async def take(self, tenant: str, window: int, limits: Limits) -> Taken:
        keys = [self.keys.rate(tenant, window, "requests"), self.keys.rate(tenant, window, "tokens")]
        rpm = -1 if limits.requests_per_minute is None else limits.requests_per_minute
        tpm = -1 if limits.tokens_per_minute is None else limits.tokens_per_minute
        try:
            refused, requests, tokens = await self._take(keys=keys, args=[rpm, tpm, 2 * WINDOW_S * 1000])
        except RedisError as e:
            raise FleetUnavailable(f"counting requests of tenant {tenant}: {e}") from e
        return Taken({0: None, 1: "requests", 2: "tokens"}[int(refused)], int(requests), int(tokens))

    async def charge(self, tenant: str, window: int, tokens: int) -> None:
        key = self.keys.rate(tenant, window, "tokens")
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.incrby(key, tokens)
                pipe.pexpire(key, 2 * WINDOW_S * 1000)
                await pipe.execute()
        except RedisError as e:
            raise FleetUnavailable(f"charging tokens of tenant {tenant}: {e}") from e


class RateLimiter:
    def __init__(
        self,
        limits: dict[str, Limits],
        shared: WindowCounters | None,
        *,
        clock: Callable[[], datetime],
        shared_ok: Callable[[], bool] = lambda: True,
    ) -> None:
        self.limits = {tenant: limit for tenant, limit in limits.items() if limit != Limits()}
        self.shared = shared
        self.local = LocalCounters()
        self.clock = clock
        # While the fleet's sync finds Redis unreachable, count locally at once rather than wait on a timeout.
        self.shared_ok = shared_ok
        self._charges: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: str) -> None:
        """Counts the request, or raises RateLimited when the tenant's minute is used up."""
        limits = self.limits.get(tenant)
        if limits is None:
            return
        window, retry_after_s = window_of(self.clock())
        taken = await self._take(tenant, window, limits)
        if taken.refused is None:
            return
        limit = limits.requests_per_minute if taken.refused == "requests" else limits.tokens_per_minute
        used = taken.requests if taken.refused == "requests" else taken.tokens
        raise RateLimited(
            f"rate limit reached for tenant {tenant} on {taken.refused} per minute: limit {limit}, used {used}; "
            f"try again in {retry_after_s} s",
            limit=taken.refused,
            retry_after_s=retry_after_s,
        )

    def charge(self, tenant: str, tokens: int) -> None:
        """Adds an answer's tokens to the tenant's minute, without making the answer wait for it."""
        if tenant not in self.limits or tokens <= 0:
            return
        window, _ = window_of(self.clock())
        task = asyncio.get_running_loop().create_task(self._charge(tenant, window, tokens))
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def _take(self, tenant: str, window: int, limits: Limits) -> Taken:
        if self.shared is not None and self.shared_ok():
            try:
                return await self.shared.take(tenant, window, limits)
            except FleetUnavailable:
                pass  # counted here until Redis is back; the sync reports the outage
        return await self.local.take(tenant, window, limits)

    async def _charge(self, tenant: str, window: int, tokens: int) -> None:
        if self.shared is not None and self.shared_ok():
            try:
                await self.shared.charge(tenant, window, tokens)
                return
            except FleetUnavailable:
                pass
        await self.local.charge(tenant, window, tokens)

    async def drain(self) -> None:
        if self._charges:
            await asyncio.gather(*self._charges, return_exceptions=True)
