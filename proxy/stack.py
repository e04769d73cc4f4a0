"""The stack: everything below a request that can change its answer, and its fingerprint.

A stack arrives either from a replica's `GET /v1/stack` (proved) or from configuration (declared, for upstream
APIs that cannot prove theirs). Canonical JSON (RFC 8785) and the SHA-256 fingerprint are pure functions of the
stack's content; the backend computes the same fingerprint independently, from its own code (docs/protocol.md).
This module knows nothing of replicas, pins or HTTP.
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785
from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
SOFTWARE_KEYS = ("backend", "torch", "cuda", "triton", "driver")
UNKNOWN = "unknown"


class Stack(BaseModel):
    """Schema 1 of the stack object; every key is always present so both sides hash the same document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: int = Field(default=SCHEMA_VERSION, alias="schema")
    model: str
    weights_sha256: str | None = None
    quantisation: str = UNKNOWN
    hardware: str = UNKNOWN
    hardware_detail: dict[str, Any] = Field(default_factory=dict)
    kernel_mode: str = UNKNOWN
    software: dict[str, str | None] = Field(default_factory=lambda: dict.fromkeys(SOFTWARE_KEYS))
    batching: dict[str, Any] = Field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        """The JSON object that is hashed: the wire names, every key present."""
        return self.model_dump(by_alias=True, mode="json")

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.document())


def canonical_json(document: dict[str, Any]) -> bytes:
    """RFC 8785 canonical form: the same bytes whatever the key order or the process."""
    return rfc8785.dumps(document)


def fingerprint(document: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(document)).hexdigest()


def short(fingerprint_hex: str) -> str:
    """The prefix people read in tables and logs; records always keep the full fingerprint."""
    return fingerprint_hex[:12]
