"""`stackpin erase`: erase records' payloads (their requests and answers) on request, or every tenant's expired
ones now (`--expired`), straight in the audit store; the log keeps each record's entries and their proofs, and an
entry saying what was erased, when and why (proxy/audit/erasure.py).

Like the auditor's commands it needs the store's URL and no key: the store it opens holds none, so the erasure
entries it appends carry no receipt.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from proxy.audit import AuditStore, NotErasable
from proxy.audit.erasure import Policy
from proxy.audit.retention import apply_retention
from proxy.config import Settings

EXIT_OK, EXIT_NOT_ERASED = 0, 1


async def erase(settings: Settings, record_ids: list[str], reason: str, clock: Callable[[], datetime]) -> int:
    """Erases each record named; exit 1 when one could not be (each says why)."""
    store = await AuditStore.open(settings.store.url, schema=settings.store.postgres_schema)
    failed = 0
    try:
        for record_id in record_ids:
            try:
                stored = await store.erase(record_id, Policy("request", reason), clock())
            except (NotErasable, LookupError) as e:
                print(f"{record_id}: not erased: {e}")
                failed += 1
                continue
            print(f"{record_id}: erased (the erasure is entry seq {stored.seq}); its proofs stay valid")
    finally:
        await store.close()
    return EXIT_NOT_ERASED if failed else EXIT_OK


async def erase_expired(settings: Settings, clock: Callable[[], datetime]) -> int:
    """Applies every tenant's retention policy now."""
    days = settings.retention_days()
    if not days:
        print("no retention policy: set [[tenants]] retention_days, or [store] retention_days")
        return EXIT_OK
    store = await AuditStore.open(settings.store.url, schema=settings.store.postgres_schema)
    try:
        erased = await apply_retention(store, days, clock())
    finally:
        await store.close()
    policies = ", ".join(f"{tenant} {kept} days" for tenant, kept in sorted(days.items()))
    print(f"erased the payloads of {len(erased)} records past their retention ({policies})")
    for entry in erased:
        print(f"  {entry.record_id} (erasure entry seq {entry.seq})")
    return EXIT_OK
