"""The stack: everything below a request that can change its answer, and its fingerprint.

A stack arrives from a replica's `GET /v1/stack` (proven), from what a running engine says about itself (reported,
built by its kind in proxy/replicas/kinds/), or from configuration (declared, for upstream APIs). Canonical JSON (RFC 8785) and the SHA-256 fingerprint are pure functions of the
stack's content; the backend computes the same fingerprint independently, from its own code (docs/protocol.md).
This module knows nothing of replicas, pins or HTTP.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from proxy.canonical import CanonicalDocument, canonical_json

SCHEMA_VERSION = 1  # what a declared stack is unless it says otherwise: its fingerprint stays what it was
SOFTWARE_KEYS = ("backend", "torch", "cuda", "triton", "driver")
UNKNOWN = "unknown"
BATCH_INVARIANT = "batch_invariant"
# Serving features a backend names in its batching policy that change no bit of a batch_invariant answer
# (docs/protocol.md): replicas that differ only in them serve one stack.
UNFINGERPRINTED_BATCHING = ("prefix_cache", "speculation", "tensor_parallel")


class Stack(BaseModel):
    """The stack object, schema 1 or 2 (2 adds `embedding`); every key of its schema is always present, so both
    sides hash the same document."""

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
    embedding: dict[str, Any] | None = (
        None  # schema 2: how the replica pools an embedding (null: it does not)
    )
    # Only in a stack an engine reports (proxy/replicas/kinds/): what it says of itself that no other key holds,
    # and which keys it cannot report (`unreported`). Absent from every other stack's document.
    engine: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _keys_of_its_schema(self) -> Stack:
        if self.schema_ >= 2 and "embedding" not in self.model_fields_set:
            raise ValueError("a schema-2 stack names its 'embedding' (null when it serves none)")
        if self.schema_ < 2 and self.embedding is not None:
            raise ValueError("'embedding' is a key of schema 2; declare schema = 2 with it")
        return self

    def document(self) -> dict[str, Any]:
        """The JSON object that is hashed: the wire names, every key of its schema present."""
        document = self.model_dump(by_alias=True, mode="json")
        if self.schema_ < 2:
            del document["embedding"]
        if self.engine is None:
            del document["engine"]
        return document

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.document())

    @property
    def batch_invariant(self) -> bool:
        """Whether its answers are independent of the batch: batch-invariant kernels, and no routing that the
        batch decides (a mixture-of-experts capacity factor). A backend says so in `kernel_mode` (protocol.md);
        the routing is checked too, so that a stack claiming both is taken at its routing."""
        routing = self.batching.get("expert_routing")
        capped = isinstance(routing, dict) and routing.get("policy") == "capacity"
        return self.kernel_mode == BATCH_INVARIANT and not capped

    @cached_property
    def canonical(self) -> CanonicalDocument:
        """The document as records store it, canonicalised once for every entry that names this stack."""
        return CanonicalDocument.of(self.document())


def fingerprint(document: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(fingerprinted(document))).hexdigest()


def fingerprinted(document: Any) -> Any:
    """The part of a stack document its fingerprint covers: all of it but the batching keys that say how a backend
    computes, never what (`UNFINGERPRINTED_BATCHING`). The proxy keeps only this part, so that a stored stack's
    canonical JSON always hashes to its fingerprint. Anything but an object comes back as it is, for validation to
    refuse."""
    if not isinstance(document, dict) or not isinstance(document.get("batching"), dict):
        return document
    batching = {k: v for k, v in document["batching"].items() if k not in UNFINGERPRINTED_BATCHING}
    return {**document, "batching": batching}


def short(fingerprint_hex: str) -> str:
    """The prefix people read in tables and logs; records always keep the full fingerprint."""
    return fingerprint_hex[:12]
