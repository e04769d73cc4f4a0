"""The fleet's shared state in Redis, as the proxies and the heartbeat sidecar read and write it.

Every method is one short round trip (or a pipeline) and raises `FleetUnavailable` when Redis cannot be reached,
so that callers decide what an outage means: the sync step serves from its last view, the sidecar retries, the
rate limiter falls back to local counting. Nothing here decides who is in rotation; `sync.py` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.fleet.documents import FleetKeys, Lease, Quarantine


class FleetUnavailable(Exception):
    """Redis could not be reached or answered an error; the message says which call."""


def connect(url: str, *, timeout_s: float) -> aioredis.Redis:
    """A client that fails fast: an outage must show up within `timeout_s`, not after minutes of retries."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


@dataclass(frozen=True)
class FleetView:
    """One consistent-enough read of the shared state (leases expire on their own, so it can only be recent)."""

    names: frozenset[str]
    leases: dict[str, Lease]
    quarantines: dict[str, Quarantine]
    outstanding: dict[str, int] = field(default_factory=dict)  # summed over the other live proxies


class FleetState:
    def __init__(self, client: aioredis.Redis, keys: FleetKeys) -> None:
        self.client = client
        self.keys = keys

    async def close(self) -> None:
        await self.client.aclose()

    # The heartbeat sidecar's side.

    async def register(self, name: str, fingerprint: str) -> str:
        """The fingerprint `name` registered with: the first one it ever proved."""
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.set(self.keys.registered(name), fingerprint, nx=True)
                pipe.get(self.keys.registered(name))
                _, registered = await pipe.execute()
        except RedisError as e:
            raise FleetUnavailable(f"registering {name}: {e}") from e
        return str(registered)

    async def renew(self, lease: Lease, *, good: bool) -> None:
        """Writes the lease; `good` (it proved its registered stack) also moves its last good check."""
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.sadd(self.keys.replicas, lease.name)
                pipe.set(self.keys.lease(lease.name), lease.model_dump_json(), px=int(lease.lease_s * 1000))
                if good:
                    pipe.set(self.keys.good(lease.name), lease.proved_at.isoformat())
                await pipe.execute()
        except RedisError as e:
            raise FleetUnavailable(f"renewing the lease of {lease.name}: {e}") from e

    async def last_good(self, name: str) -> datetime | None:
        try:
            value = await self.client.get(self.keys.good(name))
        except RedisError as e:
            raise FleetUnavailable(f"reading the last good check of {name}: {e}") from e
        return datetime.fromisoformat(value) if value else None

    # Quarantines: written once, by whoever sees the change first.

    async def quarantine(self, name: str, note: Quarantine) -> bool:
        """True when this call placed the quarantine, False when one was already there."""
        try:
            placed = await self.client.set(self.keys.quarantine(name), note.model_dump_json(), nx=True)
            await self.client.sadd(self.keys.replicas, name)
        except RedisError as e:
            raise FleetUnavailable(f"quarantining {name}: {e}") from e
        return bool(placed)

    async def lift(self, name: str) -> str | None:
        """An operator's act: removes the quarantine on `name` with its flagging claim, its registered fingerprint
        and its lease, so that the replica stays out until its sidecar registers and leases the stack it serves
        now. Returns the note that was lifted (raw), or None when there was none, in which case nothing is removed."""
        keys = self.keys
        script = (
            "local note = redis.call('GET', KEYS[1]) "
            "if note then redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4]) end "
            "return note"
        )
        try:
            note = await self.client.eval(
                script, 4, keys.quarantine(name), keys.flagged(name), keys.registered(name), keys.lease(name)
            )
        except RedisError as e:
            raise FleetUnavailable(f"lifting the quarantine on {name}: {e}") from e
        return None if note is None else str(note)

    async def claim_flagging(self, name: str, proxy_id: str) -> bool:
        """Only one proxy marks a quarantined replica's records; the others leave them to it."""
        try:
            return bool(await self.client.set(self.keys.flagged(name), proxy_id, nx=True))
        except RedisError as e:
            raise FleetUnavailable(f"claiming the records of {name}: {e}") from e

    # The proxies' side.

    async def read(self, proxy_id: str, now: float) -> FleetView:
        """Leases, quarantines and the other proxies' outstanding counts; `now` is epoch seconds."""
        try:
            names = sorted(await self.client.smembers(self.keys.replicas))
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.zrangebyscore(self.keys.proxies, now, "+inf")
                if names:
                    pipe.mget([self.keys.lease(n) for n in names])
                    pipe.mget([self.keys.quarantine(n) for n in names])
                results = await pipe.execute()
            proxies = [p for p in results[0] if p != proxy_id]
            outstanding = await self._outstanding(proxies)
        except RedisError as e:
            raise FleetUnavailable(f"reading the fleet state: {e}") from e
        leases_raw, quarantines_raw = (results[1], results[2]) if names else ([], [])
        return FleetView(
            names=frozenset(names),
            leases=_leases(names, leases_raw),
            quarantines=_quarantines(names, quarantines_raw),
            outstanding=outstanding,
        )

    async def _outstanding(self, proxies: list[str]) -> dict[str, int]:
        if not proxies:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for proxy in proxies:
                pipe.hgetall(self.keys.outstanding(proxy))
            counts = await pipe.execute()
        total: dict[str, int] = {}
        for per_proxy in counts:
            for name, value in per_proxy.items():
                total[name] = total.get(name, 0) + max(0, int(value))
        return total

    async def publish_outstanding(
        self, proxy_id: str, counts: Mapping[str, int], *, expires_at: float, ttl_s: float
    ) -> None:
        """This proxy's in-flight counts, absolute: heals any increment that got lost on the way."""
        key = self.keys.outstanding(proxy_id)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                if counts:
                    pipe.hset(key, mapping=dict(counts))
                pipe.pexpire(key, int(ttl_s * 1000))
                pipe.zadd(self.keys.proxies, {proxy_id: expires_at})
                pipe.zremrangebyscore(self.keys.proxies, "-inf", expires_at - 10 * ttl_s)
                await pipe.execute()
        except RedisError as e:
            raise FleetUnavailable(f"publishing outstanding counts: {e}") from e

    async def move_outstanding(self, proxy_id: str, name: str, delta: int) -> None:
        # Fire-and-forget: a lost increment is healed by the next publish_outstanding, which writes true counts.
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            await self.client.hincrby(self.keys.outstanding(proxy_id), name, delta)


def _leases(names: list[str], raw: list[str | None]) -> dict[str, Lease]:
    leases: dict[str, Lease] = {}
    for name, value in zip(names, raw, strict=True):
        if value is None:
            continue
        try:
            leases[name] = Lease.model_validate_json(value)
        except ValidationError:
            continue  # a lease we cannot read is no lease: out of rotation, which is safe
    return leases


def _quarantines(names: list[str], raw: list[str | None]) -> dict[str, Quarantine]:
    quarantines: dict[str, Quarantine] = {}
    for name, value in zip(names, raw, strict=True):
        if value is None:
            continue
        try:
            quarantines[name] = Quarantine.model_validate_json(value)
        except ValidationError:
            # Something is there, so someone meant to quarantine: keep the replica out.
            quarantines[name] = Quarantine(
                reason="unreadable",
                registered=None,
                observed=None,
                last_good_check=None,
                at=datetime.fromtimestamp(0, UTC),
                by="unknown",
            )
    return quarantines
