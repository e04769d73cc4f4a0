"""The tamper-evident chain: canonical JSON, entry hashes, and the checks that verification runs.

Everything here is a pure function of its arguments: no database, no clock. The store (`store.py`) feeds rows
in and acts on the answers; this module does not know where rows come from or how they are paged.

An entry's hash is `SHA-256(JCS({"position": p, "prev": prev_sha256, "entry": {...fields, content}}))`, where
JCS is RFC 8785 canonical JSON. Because each hash covers its predecessor's, editing, reordering or deleting an
entry breaks every link after it; deleting the tail is visible only against a head kept elsewhere
(`expect_head`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import rfc8785
from pydantic import BaseModel

GENESIS_SHA256 = "0" * 64

ProblemKind = Literal[
    "gap",
    "prev_mismatch",
    "hash_mismatch",
    "content_not_canonical",
    "head_mismatch",
    "expect_head_mismatch",
    "stack_hash_mismatch",
    "stack_missing",
    "prompt_hash_mismatch",
    "prompt_missing",
]


class ChainProblem(BaseModel):
    """The first thing verification found wrong, and where."""

    kind: ProblemKind
    message: str
    position: int | None = None
    record_id: str | None = None


class NotCanonicalizable(ValueError):
    """A value has no RFC 8785 form: NaN or infinite floats, integers beyond 2**53, non-string keys."""


def canonical_json(value: Any) -> str:
    """RFC 8785 (JCS) text of a JSON value; raises NotCanonicalizable with the reason."""
    try:
        return rfc8785.dumps(value).decode("utf-8")
    except (rfc8785.CanonicalizationError, TypeError) as exc:
        raise NotCanonicalizable(f"value cannot be written as canonical JSON (RFC 8785): {exc}") from exc


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stack_fingerprint(stack: Mapping[str, Any]) -> str:
    """The stack fingerprint of docs/protocol.md: SHA-256 of the stack's canonical JSON."""
    return sha256_hex(canonical_json(dict(stack)))


def prompt_sha256(text: str) -> str:
    """How a prompt text is addressed: SHA-256 of its UTF-8 bytes."""
    return sha256_hex(text)


def format_timestamp(moment: datetime) -> str:
    """ISO 8601 in UTC with microseconds and a `Z`: one spelling per instant, whatever the input's zone."""
    if moment.tzinfo is None:
        raise ValueError("timestamps in the audit chain must carry a time zone")
    # isoformat, not strftime: strftime pads years below 1000 differently from one C library to another.
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


@dataclass(frozen=True)
class EntryFields:
    """What an entry's hash covers, besides its position and predecessor."""

    record_id: str
    part: str
    tenant: str
    created_at: datetime
    replica: str | None
    model: str | None
    fingerprint: str | None
    prompt_sha256: str | None
    replay_of: str | None
    status: str
    # The canonical JSON text of the content object: computed once when the entry is made, and hashed as
    # stored when it is verified, so that neither side canonicalizes the (large) content again.
    content_json: str

    def header(self) -> dict[str, Any]:
        """Every hashed field but the content."""
        return {
            "record_id": self.record_id,
            "part": self.part,
            "tenant": self.tenant,
            "created_at": format_timestamp(self.created_at),
            "replica": self.replica,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "prompt_sha256": self.prompt_sha256,
            "replay_of": self.replay_of,
            "status": self.status,
        }


def envelope_text(position: int, prev_sha256: str, fields: EntryFields) -> str:
    """JCS({"position": p, "prev": prev, "entry": {...header, "content": content}}), built around the content.

    "content" sorts before every other key of an entry, and "entry" before "position" and "prev", so the
    canonical text is the content member followed by the header's members; a test holds this equal to
    canonicalizing the whole object.
    """
    header = _header_text(fields.header())
    entry = '{"content":' + fields.content_json + "," + header[1:]
    tail = ',"position":' + canonical_json(position) + ',"prev":' + canonical_json(prev_sha256) + "}"
    return '{"entry":' + entry + tail


# For an object of strings and nulls under ASCII keys, the standard library's compact key-sorted output is
# exactly JCS (the same escapes), at C speed; verification hashes one header per entry.
_HEADER_ENCODER = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _header_text(header: dict[str, Any]) -> str:
    if all(value is None or type(value) is str for value in header.values()):
        text = _HEADER_ENCODER.encode(header)
        try:
            text.encode("utf-8")  # a lone surrogate has no JCS form; let canonical_json say so
        except UnicodeEncodeError:
            return canonical_json(header)
        return text
    return canonical_json(header)


def entry_hash(position: int, prev_sha256: str, fields: EntryFields) -> str:
    return sha256_hex(envelope_text(position, prev_sha256, fields))


@dataclass(frozen=True)
class Link:
    """One entry with its place in the chain; on verification, the content text is the one stored."""

    position: int
    prev_sha256: str
    sha256: str
    fields: EntryFields

    @property
    def record_id(self) -> str:
        return self.fields.record_id


def chain_links(head_position: int, head_sha256: str, batch: list[EntryFields]) -> list[Link]:
    """Positions and hashes for `batch`, appended after the given head, in order."""
    links: list[Link] = []
    position, prev = head_position, head_sha256
    for fields in batch:
        position += 1
        sha = entry_hash(position, prev, fields)
        links.append(Link(position=position, prev_sha256=prev, sha256=sha, fields=fields))
        prev = sha
    return links


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
        return value, canonical_json(value) == text
    except NotCanonicalizable:
        return value, False


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def check_link(expected_position: int, expected_prev: str, link: Link) -> ChainProblem | None:
    """What is wrong with `link` as successor of (`expected_position` - 1, `expected_prev`), if anything."""
    where = {"position": link.position, "record_id": link.record_id}
    if link.position != expected_position:
        missing = (
            f"positions {expected_position}..{link.position - 1} are missing"
            if link.position > expected_position + 1
            else f"position {expected_position} is missing"
        )
        if link.position < expected_position:
            missing = f"position {link.position} appears out of order after {expected_position - 1}"
        return ChainProblem(kind="gap", message=f"{missing} (entries deleted or renumbered)", **where)
    if link.prev_sha256 != expected_prev:
        return ChainProblem(
            kind="prev_mismatch",
            message=(
                f"entry {link.position} names {link.prev_sha256} as its predecessor, "
                f"but the entry before it hashes to {expected_prev} (entries reordered, replaced or deleted)"
            ),
            **where,
        )
    not_canonical = ChainProblem(
        kind="content_not_canonical",
        message=f"entry {link.position} stores content that is not the canonical JSON of an object (edited)",
        **where,
    )
    # Splicing the content text into the envelope is unambiguous only for a complete JSON object.
    if not _is_json_object(link.fields.content_json):
        return not_canonical
    try:
        recomputed = entry_hash(link.position, link.prev_sha256, link.fields)
    except (NotCanonicalizable, ValueError) as exc:
        return ChainProblem(
            kind="hash_mismatch", message=f"entry {link.position} cannot be hashed: {exc}", **where
        )
    if recomputed != link.sha256:
        if not parse_content(link.fields.content_json)[1]:
            return not_canonical
        return ChainProblem(
            kind="hash_mismatch",
            message=(
                f"entry {link.position} is stored with hash {link.sha256} "
                f"but its fields hash to {recomputed} "
                "(the entry or its hash was edited)"
            ),
            **where,
        )
    return None


class ChainWalker:
    """Checks a chain fed to it page by page in position order; keeps only the last link it saw.

    `feed` returns the first problem and the walker stops there: every later link would fail after a break.
    """

    def __init__(self, expect_head: tuple[int, str] | None = None) -> None:
        self.position = 0
        self.sha256 = GENESIS_SHA256
        self.problem: ChainProblem | None = None
        self.checked = 0
        self._expect_head = expect_head
        self._anchor_seen = expect_head is None or expect_head[0] == 0

    def feed(self, links: list[Link]) -> ChainProblem | None:
        for link in links:
            if self.problem is not None:
                break
            self.problem = check_link(self.position + 1, self.sha256, link)
            if self.problem is None:
                self.position, self.sha256 = link.position, link.sha256
                self.checked += 1
                self._check_anchor(link)
        return self.problem

    def _check_anchor(self, link: Link) -> None:
        if self._expect_head is None or link.position != self._expect_head[0]:
            return
        self._anchor_seen = True
        if link.sha256 != self._expect_head[1]:
            self.problem = ChainProblem(
                kind="expect_head_mismatch",
                message=(
                    f"the kept head says entry {link.position} hashes to {self._expect_head[1]}, "
                    f"the log holds {link.sha256} there (the chain was rewritten from here or earlier)"
                ),
                position=link.position,
                record_id=link.record_id,
            )

    def finish(self, head_position: int, head_sha256: str) -> ChainProblem | None:
        """Call after the last page: compares the walk's end with the stored head and the kept one."""
        if self.problem is not None:
            return self.problem
        if (self.position, self.sha256) != (head_position, head_sha256):
            self.problem = ChainProblem(
                kind="head_mismatch",
                message=(
                    f"the chain ends at position {self.position} ({self.sha256}) but the stored head is "
                    f"position {head_position} ({head_sha256}) "
                    "(entries at the tail were deleted or the head edited)"
                ),
                position=self.position or None,
            )
        elif not self._anchor_seen and self._expect_head is not None:
            self.problem = ChainProblem(
                kind="expect_head_mismatch",
                message=(
                    f"the kept head is position {self._expect_head[0]} but the chain ends at {self.position} "
                    "(entries at the tail were deleted)"
                ),
                position=self.position or None,
            )
        return self.problem


def check_stack_row(fingerprint: str, canonical_text: str) -> ChainProblem | None:
    if sha256_hex(canonical_text) != fingerprint:
        return ChainProblem(
            kind="stack_hash_mismatch",
            message=f"the stored stack {fingerprint} does not hash to its fingerprint (its JSON was edited)",
        )
    content, canonical = parse_content(canonical_text)
    if content is None or not canonical:
        return ChainProblem(
            kind="stack_hash_mismatch",
            message=f"the stored stack {fingerprint} is not canonical JSON of an object",
        )
    return None


def check_prompt_row(sha256: str, text: str) -> ChainProblem | None:
    if prompt_sha256(text) != sha256:
        return ChainProblem(
            kind="prompt_hash_mismatch",
            message=f"the stored prompt {sha256} does not hash to its address (its text was edited)",
        )
    return None
