"""What fleet mode keeps in Redis, and under which keys: the one place that knows the layout.

    {prefix}replicas               set of replica names that ever registered
    {prefix}lease:{name}           JSON Lease; expires with the lease (PX), renewed by the heartbeat sidecar
    {prefix}registered:{name}      the fingerprint a replica first proved; never expires
    {prefix}good:{name}            ISO time of the last heartbeat that proved the registered fingerprint
    {prefix}quarantine:{name}      JSON Quarantine; written once (SET NX), never lifted by a proxy or a sidecar
    {prefix}flagged:{name}         the proxy that claimed marking the quarantined replica's records (SET NX)
    {prefix}proxies                sorted set: proxy id -> the time its outstanding counts expire
    {prefix}outstanding:{proxy}    hash: replica name -> requests this proxy has in flight to it
    {prefix}rate:{{tenant}}:{window}:requests|tokens   per-tenant counters of one minute

An operator lifts a quarantine with `stackpin fleet lift NAME`, which deletes `quarantine:{name}`, `flagged:{name}`,
`registered:{name}` and `lease:{name}` in one step; proxies follow at their next sync, and never lift one on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

DEFAULT_PREFIX = "stackpin:"


class Lease(BaseModel):
    """A replica's proof of life: the stack it described (a pinned_backend at `GET /v1/stack`, an engine as its
    kind reads it), when, and its kind, which the proxies serve it as."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    url: str
    stack: dict[str, Any]
    fingerprint: str
    registered: str
    proved_at: datetime
    lease_s: float
    kind: str = "stackpin"


class Quarantine(BaseModel):
    """Why a replica left rotation for every proxy, and since when its records are suspect."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str
    registered: str | None
    observed: str | None
    last_good_check: datetime | None
    at: datetime
    by: str


@dataclass(frozen=True)
class FleetKeys:
    prefix: str = DEFAULT_PREFIX

    @property
    def replicas(self) -> str:
        return f"{self.prefix}replicas"

    def lease(self, name: str) -> str:
        return f"{self.prefix}lease:{name}"

    def registered(self, name: str) -> str:
        return f"{self.prefix}registered:{name}"

    def good(self, name: str) -> str:
        return f"{self.prefix}good:{name}"

    def quarantine(self, name: str) -> str:
        return f"{self.prefix}quarantine:{name}"

    def flagged(self, name: str) -> str:
        return f"{self.prefix}flagged:{name}"

    @property
    def proxies(self) -> str:
        return f"{self.prefix}proxies"

    def outstanding(self, proxy_id: str) -> str:
        return f"{self.prefix}outstanding:{proxy_id}"

    def rate(self, tenant: str, window: int, what: str) -> str:
        # The hash tag keeps one tenant's counters in one Redis Cluster slot, so one script can touch both.
        return f"{self.prefix}rate:{{{tenant}}}:{window}:{what}"
