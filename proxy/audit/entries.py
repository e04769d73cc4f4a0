"""An entry's bytes: canonical JSON of its fields, which the log's Merkle tree hashes as one leaf.

Everything here is a pure function of its arguments. An entry written by this log is

    JCS({...its header, "content": ...})

where the header is every field header.py declares, written as declared (docs/audit.md lists them), and JCS is RFC
8785 canonical JSON; its leaf hash is SHA-256(0x00 || those bytes) and its `sha256` is SHA-256(those bytes). An
entry with a payload (the request and the answer, kept beside the log so that they can be erased) holds
`payload_sha256` in its header, SHA-256(salt || JCS(payload)), and not the payload itself. Entries written before
the log was a tree (the hash chain, schema revisions 0001 to 0003) keep their chain envelope, JCS({"position",
"prev", "entry": {...the header they held, "content"}}), as their bytes: their leaf hash covers their chain link,
so they stay verifiable as they were. Which form a stored row uses is told by its `prev_sha256`, present only on
chained entries; a row that lies about it no longer hashes to its leaf.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.audit.header import EntryHeader
from proxy.audit.header import format_timestamp as format_timestamp  # how the bytes write created_at
from proxy.canonical import NotCanonicalizable, canonical_json

GENESIS_SHA256 = "0" * 64


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def payload_sha256(salt: bytes, payload: str) -> str:
    """What an entry's bytes commit to instead of its payload: SHA-256 of its salt (32 bytes, so the two parts
    cannot be told apart otherwise) and the payload's canonical JSON. The salt keeps a short payload (`"yes"`)
    from being found by trying guesses against the hash once the payload is erased."""
    return hashlib.sha256(salt + payload.encode("utf-8")).hexdigest()


def stack_fingerprint(stack: Mapping[str, Any]) -> str:
    """The stack fingerprint of docs/protocol.md: SHA-256 of the stack's canonical JSON."""
    return hashlib.sha256(canonical_json(dict(stack))).hexdigest()


def prompt_sha256(text: str) -> str:
    """How a prompt text is addressed: SHA-256 of its UTF-8 bytes."""
    return sha256_hex(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryFields(EntryHeader):
    """What an entry's bytes hold: its header (header.py) and its content."""

    # The canonical JSON text of the content object: computed once when the entry is made, and hashed as
    # stored when it is verified, so that neither side canonicalizes the (large) content again.
    content_json: str


def entry_text(fields: EntryFields) -> str:
    """JCS of the entry object, built around the content: "content" sorts before every other key."""
    return '{"content":' + fields.content_json + "," + _text(fields.header())[1:]


def entry_bytes(fields: EntryFields, content: bytes) -> bytes:
    """`entry_text(fields)` in UTF-8, spliced from `content`, the canonical bytes `fields.content_json` was decoded
    from: a long stream's content is not encoded a second time."""
    return b'{"content":' + content + b"," + canonical_json(fields.header())[1:]


def envelope_text(position: int, prev_sha256: str, fields: EntryFields) -> str:
    """A chained entry's bytes: JCS({"position": p, "prev": prev, "entry": {...header, "content": ...}}).

    "content" sorts before every other key of an entry, and "entry" before "position" and "prev", so the
    canonical text is the content member followed by the header's members; a test holds this equal to
    canonicalizing the whole object.
    """
    header = _text(fields.header(chained=True))
    entry = '{"content":' + fields.content_json + "," + header[1:]
    tail = ',"position":' + _text(position) + ',"prev":' + _text(prev_sha256) + "}"
    return '{"entry":' + entry + tail


def _text(value: Any) -> str:
    return canonical_json(value).decode("utf-8")


def chain_hash(position: int, prev_sha256: str, fields: EntryFields) -> str:
    """A chained entry's `sha256`: SHA-256 of its envelope."""
    return sha256_hex(envelope_text(position, prev_sha256, fields))


@dataclass(frozen=True)
class StoredFields:
    """An entry as a row holds it: its fields, its `sha256`, and for a chained entry its link."""

    fields: EntryFields
    sha256: str
    chained_at: tuple[int, str] | None = None  # (position, prev_sha256) of a chained entry

    def text(self) -> str:
        if self.chained_at is None:
            return entry_text(self.fields)
        return envelope_text(*self.chained_at, self.fields)


SAFE_INTEGER = 2**53 - 1


def _parse_int(literal: str) -> int | float:
    # JCS writes an integral float such as 2.0**53 without a fraction; only floats reach past 2**53 - 1 there,
    # so reading such a literal back as an int would make it uncanonicalizable.
    value = int(literal)
    return value if -SAFE_INTEGER <= value <= SAFE_INTEGER else float(value)


def load_canonical(text: str) -> Any:
    """Reads JSON written by `canonical_json` back into the value it came from."""
    return json.loads(text, parse_int=_parse_int)


def parse_content(text: str) -> tuple[dict[str, Any] | None, bool]:
    """The content object stored as `text`, and whether `text` is its canonical form."""
    try:
        value = load_canonical(text)
    except (json.JSONDecodeError, ValueError):
        return None, False
    if not isinstance(value, dict):
        return None, False
    try:
        return value, _text(value) == text
    except NotCanonicalizable:
        return value, False


def is_json_object(text: str) -> bool:
    """Splicing a content text into an entry's bytes is unambiguous only for one complete JSON object."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
