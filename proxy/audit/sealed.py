"""The entries the store commits, sealed: every byte they will be hashed as, and both hashes, made once.

An entry's canonical bytes and hashes do not depend on any other entry, so they are made before the group commit
(commit.py), never inside its transaction, and never twice. `seal` is the door: it takes values the proxy
built itself (a stack already canonicalised and addressed by its fingerprint, a prompt already hashed) and checks
what such values can still get wrong (content with no canonical form, NUL characters, lengths, a part that is
none of the parts), with messages naming the field; which fields there are, and their bounds, is header.py's
declaration. This module knows nothing of the database.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import InitVar, dataclass, field
from datetime import UTC, datetime
from typing import Any

from proxy.audit.entries import EntryFields, entry_bytes, sha256_hex
from proxy.audit.header import Part, out_of_bounds
from proxy.audit.merkle import leaf_hash
from proxy.canonical import CanonicalDocument, NotCanonicalizable, canonical_json


class InvalidEntry(ValueError):
    """An entry `seal` refuses, with the field and what is wrong with it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SealedEntry(EntryFields):
    """An entry ready to commit: its fields (header.py, entries.py), the texts the store keeps beside it, its
    bytes and their hashes, checked and made once, when it is made, outside the commit, since no other entry
    changes them. Its `stack_declared` is as its bytes hold it: None without a fingerprint."""

    stack_json: str | None = None  # the stack's canonical JSON, for the store to keep if it has not yet
    prompt_text: str | None = None
    # The payload's canonical JSON and its salt, kept beside the log (table `payloads`); `payload_sha256` commits
    # to both.
    payload_json: str | None = None
    salt: bytes | None = None
    # The entries whose payloads this entry erases, in its own transaction (an erasure, erasure.py).
    erases: tuple[int, ...] = ()
    # The canonical bytes content_json was decoded from, spliced into the entry's: not encoded a second time.
    content_bytes: InitVar[bytes | None] = None
    encoded: bytes = field(init=False)  # the entry's bytes (entries.py)
    sha256: str = field(init=False)
    leaf_hash: bytes = field(init=False)

    def __post_init__(self, content_bytes: bytes | None) -> None:
        # On values the proxy built itself: a NUL or an overlong value from a replica (its stack's model name)
        # must fail its own entry, not a group commit shared with others.
        if not self.within_bounds():
            raise InvalidEntry(out_of_bounds(self) or "a field is out of its declared bounds")
        content = self.content_json.encode("utf-8") if content_bytes is None else content_bytes
        try:
            encoded = entry_bytes(self, content)
        except NotCanonicalizable as exc:  # a lone surrogate in a name: it has no UTF-8, so no entry bytes
            raise InvalidEntry(f"the entry's fields: {exc}") from exc
        object.__setattr__(self, "encoded", encoded)
        object.__setattr__(self, "sha256", hashlib.sha256(encoded).hexdigest())
        object.__setattr__(self, "leaf_hash", leaf_hash(encoded))

    @property
    def content(self) -> dict[str, Any]:
        """The content as a reader of the stored entry gets it back while its payload is kept: what its bytes hold
        and its payload, as one object (never on the request path)."""
        decoded: dict[str, Any] = json.loads(self.content_json)
        return decoded | (self.payload or {})

    @property
    def payload(self) -> dict[str, Any] | None:
        return None if self.payload_json is None else json.loads(self.payload_json)

    @property
    def stack(self) -> dict[str, Any] | None:
        """The stack document this entry carries to the store, if it carries one."""
        return None if self.stack_json is None else json.loads(self.stack_json)


def seal(
    *,
    record_id: str,
    part: Part,
    tenant: str,
    created_at: datetime,
    status: str,
    content: dict[str, Any],
    replica: str | None = None,
    model: str | None = None,
    fingerprint: str | None = None,
    stack: CanonicalDocument | None = None,
    stack_declared: bool = False,
    prompt_text: str | None = None,
    prompt_sha256: str | None = None,
    replay_of: str | None = None,
    payload: dict[str, Any] | None = None,
    salt: bytes | None = None,
    erases: tuple[int, ...] = (),
) -> SealedEntry:
    """An entry from values the proxy built, checked for what they can still get wrong; InvalidEntry saying
    which field is wrong. `stack` is trusted to be the document its `sha256` addresses, and `prompt_sha256`
    (when given) to be the address of `prompt_text`. `payload` (the request and the answer) is kept beside the
    log under a new random `salt` (given only by tests), its keys none of `content`'s: a reader gets both as one
    content while the payload is kept, and the content alone once it is erased."""
    if created_at.tzinfo is None:
        raise InvalidEntry("created_at must carry a time zone")
    if prompt_text is not None:
        if "\x00" in prompt_text:
            raise InvalidEntry("prompt_text must not contain NUL characters")
        if prompt_sha256 is None:
            prompt_sha256 = sha256_hex(prompt_text)
    if stack is not None:
        if fingerprint is None:
            fingerprint = stack.sha256
        elif fingerprint != stack.sha256:
            raise InvalidEntry(
                f"fingerprint {fingerprint} does not match the stack given, whose canonical JSON "
                f"hashes to {stack.sha256}"
            )
    try:
        content_bytes = canonical_json(content)
    except ValueError as exc:
        raise InvalidEntry(f"content: {exc}") from exc
    payload_json, payload_hash = None, None
    if payload is not None:
        if content.keys() & payload.keys():
            raise InvalidEntry(f"payload: {sorted(content.keys() & payload.keys())} are in the content too")
        try:
            payload_bytes = canonical_json(payload)
        except ValueError as exc:
            raise InvalidEntry(f"payload: {exc}") from exc
        salt = secrets.token_bytes(32) if salt is None else salt
        if len(salt) != 32:
            raise InvalidEntry("salt must be 32 bytes")
        digest = hashlib.sha256(salt)
        digest.update(payload_bytes)  # payload_sha256 (entries.py), from the bytes already encoded
        payload_json, payload_hash = payload_bytes.decode("utf-8"), digest.hexdigest()
    return SealedEntry(
        record_id=record_id,
        part=part,
        tenant=tenant,
        created_at=created_at.astimezone(UTC),
        replica=replica,
        model=model,
        fingerprint=fingerprint,
        prompt_sha256=prompt_sha256,
        replay_of=replay_of,
        status=status,
        stack_declared=stack_declared if fingerprint is not None else None,
        payload_sha256=payload_hash,
        content_json=content_bytes.decode("utf-8"),
        content_bytes=content_bytes,
        stack_json=None if stack is None else stack.json,
        prompt_text=prompt_text,
        payload_json=payload_json,
        salt=None if payload is None else salt,
        erases=erases,
    )
