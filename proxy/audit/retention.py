"""Retention: erasing the payloads of records older than their tenant's policy, once (`stackpin erase --expired`)
or every `store.retention_interval_s` in a proxy.

A policy is a number of days per tenant; a record whose payload is older than that is erased as erasure.py erases
(the log keeps its entries, their proofs, and an entry saying what was erased, when and by which rule). Several
proxies may apply it at once: a record erased by one is refused to the others (NotErasable), and skipped. What the
policies are is the configuration's business (`Settings.retention_days`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

import structlog

from proxy.audit.erasure import Policy
from proxy.audit.errors import AuditError, NotErasable
from proxy.audit.store import AuditStore
from proxy.audit.values import StoredEntry

log = structlog.get_logger(__name__)

ROUND = 256  # records erased at once: their erasure entries share group commits


def rule(tenant: str, days: int) -> Policy:
    return Policy("retention", f"tenant {tenant}: retention_days = {days}")


async def apply_retention(
    store: AuditStore, days: Mapping[str, int], now: datetime, *, round_size: int = ROUND
) -> list[StoredEntry]:
    """Erases every record whose payload is older than its tenant's days; the erasure entries appended."""
    erased: list[StoredEntry] = []
    for tenant, kept_days in sorted(days.items()):
        before, policy = now - timedelta(days=kept_days), rule(tenant, kept_days)
        while expired := await store.expired(tenant, before, round_size):
            done = await asyncio.gather(
                *(store.erase(record_id, policy, now) for record_id in expired), return_exceptions=True
            )
            for outcome in done:
                if isinstance(outcome, StoredEntry):
                    erased.append(outcome)
                elif not isinstance(outcome, NotErasable | LookupError):  # another proxy erased it first
                    raise outcome
            if len(expired) < round_size or not any(isinstance(o, StoredEntry) for o in done):
                break
    return erased


async def keep_retention(
    store: AuditStore, days: Mapping[str, int], clock: Callable[[], datetime], interval_s: float
) -> None:
    """Applies the policies now and every `interval_s`, until cancelled; a failed round is logged and retried at
    the next."""
    while True:
        try:
            erased = await apply_retention(store, days, clock())
            if erased:
                log.info("retention_erased", records=len(erased))
        except (AuditError, OSError) as exc:
            log.error("retention_failed", error=str(exc))
        await asyncio.sleep(interval_s)
