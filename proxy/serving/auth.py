"""Who is asking: the tenant behind a request's API key.

With no tenants configured the proxy binds to loopback only (config refuses otherwise) and every request belongs to
the tenant `local`. The key is compared by its SHA-256, so the proxy never holds client keys in memory after start.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from proxy.config import LOCAL_TENANT, Secrets
from proxy.errors import Unauthorized

__all__ = ["LOCAL_TENANT", "authenticate"]


def authenticate(headers: Mapping[str, str], secrets: Secrets) -> str:
    if not secrets.tenant_key_hashes:
        return LOCAL_TENANT
    authorization = headers.get("Authorization", "")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("send your API key as 'Authorization: Bearer <key>'")
    # Looking up the key's hash leaks nothing a timing attack could use: the hash is not the key.
    tenant = secrets.tenant_key_hashes.get(hashlib.sha256(key.strip().encode()).hexdigest())
    if tenant is None:
        raise Unauthorized("the API key is not known to this proxy")
    return tenant
