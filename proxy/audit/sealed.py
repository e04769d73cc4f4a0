"""The entries the store commits, sealed: every byte they will be hashed as, and both hashes, made once.

An entry's canonical bytes and hashes do not depend on any other entry, so they are made before the group commit
(commit.py), never inside its transaction, and never twice. `seal` is the request path's door: it takes values the
proxy built itself (a stack already canonicalised and addressed by its fingerprint, a prompt already hashed),
checks only what such values can still get wrong (content with no canonical form, NUL characters, lengths) with
messages naming the field, and skips the validation `NewEntry` (values.py) gives whatever it is handed. This module
knows nothing of the database.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, get_args

from proxy.audit.entries import EntryFields, Part, entry_bytes, sha256_hex
from proxy.audit.merkle import leaf_hash
from proxy.canonical import CanonicalDocument, NotCanonicalizable, canonical_json


@dataclass(frozen=True, slots=True)
class SealedEntry:
    """An entry ready to commit: its fields, the canonical texts the store keeps, its bytes and their hashes,
    each made once, outside the commit, since no other entry changes them."""

    record_id: str
    part: Part
    tenant: str
    created_at: datetime
    replica: str | None
    model: str | None
    fingerprint: str | None
    stack_declared: bool | None  # as its bytes hold it: None without a fingerprint
    prompt_sha256: str | None
    prompt_text: str | None
    replay_of: str | None
    status: str
    content_json: str
    stack_json: str | None  # the stack's canonical JSON, for the store to keep if it has not yet
    encoded: bytes  # the entry's bytes (entries.py)
    sha256: str
    leaf_hash: bytes

    @property
    def content(self) -> dict[str, Any]:
        """The content as a reader of the stored entry gets it back (never on the request path)."""
        decoded: dict[str, Any] = json.loads(self.content_json)
        return decoded

    @property
    def stack(self) -> dict[str, Any] | None:
        """The stack document this entry carries to the store, if it carries one."""
        return None if self.stack_json is None else json.loads(self.stack_json)


def sealed_from(
    fields: EntryFields, content: bytes, stack_json: str | None, prompt_text: str | None
) -> SealedEntry:
    encoded = entry_bytes(fields, content)
    return SealedEntry(
        record_id=fields.record_id,
        part=fields.part,  # type: ignore[arg-type]  (checked by the door that made the fields)
        tenant=fields.tenant,
        created_at=fields.created_at,
        replica=fields.replica,
        model=fields.model,
        fingerprint=fields.fingerprint,
        stack_declared=fields.stack_declared,
        prompt_sha256=fields.prompt_sha256,
        prompt_text=prompt_text,
        replay_of=fields.replay_of,
        status=fields.status,
        content_json=fields.content_json,
        stack_json=stack_json,
        encoded=encoded,
        sha256=hashlib.sha256(encoded).hexdigest(),
        leaf_hash=leaf_hash(encoded),
    )


class InvalidEntry(ValueError):
    """An entry `seal` refuses, with the field and what is wrong with it."""


_PARTS = frozenset(get_args(Part))
# The bounds NewEntry's fields declare, for the values the proxy built itself; a NUL or an overlong value from a
# replica (its stack's model name) must fail its own entry, not a group commit shared with others.
_BOUNDS = {"record_id": 100, "tenant": 200, "replica": 200, "model": 200, "replay_of": 100, "status": 64}


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
) -> SealedEntry:
    """The request path's entry: values the proxy built, checked for what they can still get wrong; InvalidEntry
    saying which field is wrong. `stack` is trusted to be the document its `sha256` addresses, and
    `prompt_sha256` (when given) to be the address of `prompt_text`."""
    if part not in _PARTS:
        raise InvalidEntry(f"part must be one of {sorted(_PARTS)}, got {part!r}")
    if created_at.tzinfo is None:
        raise InvalidEntry("created_at must carry a time zone")
    given = {"record_id": record_id, "tenant": tenant, "replica": replica, "model": model}
    given |= {"replay_of": replay_of, "status": status}
    for name, value in given.items():
        if value is not None and not 0 < len(value) <= _BOUNDS[name]:
            raise InvalidEntry(f"{name} must be 1 to {_BOUNDS[name]} characters long")
        if value is not None and "\x00" in value:
            raise InvalidEntry(f"{name} must not contain NUL characters")
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
    fields = EntryFields(
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
        content_json=content_bytes.decode("utf-8"),
        stack_declared=stack_declared if fingerprint is not None else None,
    )
    try:
        return sealed_from(fields, content_bytes, None if stack is None else stack.json, prompt_text)
    except NotCanonicalizable as exc:  # a lone surrogate in a name: it has no UTF-8, so no entry bytes
        raise InvalidEntry(f"the entry's fields: {exc}") from exc
