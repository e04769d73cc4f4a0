"""The values the audit store hands back: committed entries, records, listings, proofs and verification reports.

What the proxy hands in is a `SealedEntry`, made by `sealed.seal`, which checks it; the store (`store.py`,
`commit.py`) trusts it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from proxy.audit.checks import LogProblem
from proxy.audit.header import Part


class StoredEntry(BaseModel):
    """An entry after its commit: durable, sequenced, and in the tree from the next checkpoint on."""

    record_id: str
    part: Part
    seq: int = Field(description="its place in the sequence: unique, increasing, with gaps")
    sha256: str
    leaf_hash: str = Field(description="hex SHA-256(0x00 || entry bytes), the leaf it becomes")
    created_at: datetime
    receipt: str | None = Field(
        default=None, description="the log's signed promise to integrate it (receipts.py); None without a key"
    )


class EntryView(BaseModel):
    seq: int
    index: int | None = Field(description="its leaf index in the log's tree; None until it is integrated")
    part: Part
    created_at: datetime
    status: str
    replica: str | None
    model: str | None
    fingerprint: str | None
    stack_declared: bool | None
    content: dict[str, Any] = Field(description="what its bytes hold, and its payload while that is kept")
    payload: Literal["kept", "erased"] | None = Field(
        default=None,
        description="its payload kept apart, or erased; None: it holds none apart (older entries)",
    )
    sha256: str
    receipt: str | None = Field(default=None, description="the log's receipt for it, as its client got it")


class AuditRecord(BaseModel):
    """A record: its entries in log order, its stack and prompt, and the flags set on it later.

    Everything here comes from hashed bytes: the entries' own, the stack's (its fingerprint), the prompt's.
    """

    id: str
    tenant: str
    created_at: datetime
    model: str | None
    fingerprint: str | None
    replica: str | None
    replay_of: str | None
    status: str = Field(description="the status of the record's latest entry that is not a flag")
    stack: dict[str, Any] | None
    stack_declared: bool | None = Field(description="as the record's first entry says; None if it does not")
    prompt_sha256: str | None
    prompt_text: str | None
    entries: list[EntryView]
    flags: list[EntryView] = Field(description="later marks on it, erasures aside")
    erasures: list[EntryView] = Field(default_factory=list, description="the entries that erased its payload")

    @property
    def erased(self) -> bool:
        """Whether any of its entries' payloads (request, answer) is erased."""
        return any(entry.payload == "erased" for entry in self.entries)

    def erasure(self) -> str:
        """When and by which policy its request and answer were erased, in words."""
        said = self.erasures[-1].content if self.erasures else {}
        return (
            f"request and answer were erased at {said.get('erased_at', 'an unknown time')} by "
            f"{said.get('policy', 'an unknown')} policy ({said.get('why', 'no reason kept')}); the log still proves "
            "its entries, stack and timings"
        )


class OpenStream(BaseModel):
    """A stream's `opened` entry that no `closed` entry follows yet."""

    record_id: str
    tenant: str
    created_at: datetime
    replica: str | None
    model: str | None
    fingerprint: str | None


class StreamCounts(BaseModel):
    """Streams still open, and streams closed as interrupted by a proxy's start (`marked_at_start`)."""

    open: int
    marked_at_start: int


class RecordSummary(BaseModel):
    """One line of a listing; `part` is the record's latest non-flag part (`opened`: a stream not closed)."""

    id: str
    seq: int = Field(description="the sequence number of the record's first entry")
    tenant: str
    created_at: datetime
    model: str | None
    fingerprint: str | None
    status: str
    replay_of: str | None
    part: Part
    flagged: bool
    erased: bool = False


class RecordCounts(BaseModel):
    """How many records a filter selects; of those, how many are replays and how many carry a flag."""

    total: int
    replays: int
    flagged: int


class SignedCheckpoint(BaseModel):
    """A checkpoint as the log stores and serves it: the signed note, and what it says."""

    tree_size: int
    root_hash: str = Field(description="base64, as in the note")
    note: str


class EntryProof(BaseModel):
    """One entry of a record with its inclusion proof in a checkpoint (hashes in base64)."""

    seq: int
    part: Part
    index: int | None
    entry: str = Field(description="the entry's bytes, whose SHA-256 after 0x00 is its leaf hash")
    leaf_hash: str
    proof: list[str] | None = Field(description="None when the entry is not in the checkpoint's tree")
    payload: str | None = Field(
        default=None,
        description="its payload's canonical JSON, kept apart, which `payload_sha256` commits to",
    )
    salt: str | None = Field(default=None, description="hex; SHA-256(salt || payload) is its payload_sha256")
    payload_erased: bool = Field(
        default=False, description="its payload was erased; the entry is proven all the same"
    )
    receipt: str | None = Field(default=None, description="the log's receipt for the entry")


class RecordProof(BaseModel):
    record: str
    checkpoint: SignedCheckpoint
    entries: list[EntryProof]


class ConsistencyProof(BaseModel):
    old_size: int = Field(serialization_alias="from")
    new_size: int = Field(serialization_alias="to")
    proof: list[str]


class EntryCheck(BaseModel):
    """One entry of a record checked against the log: its bytes, its leaf, and its proof in the checkpoint."""

    seq: int
    index: int | None
    part: Part
    sha256: str
    recomputes: bool = Field(description="its bytes hash to its sha256 and to the leaf the tree holds")
    included: bool | None = Field(
        description="its inclusion proof verifies; None while it is not in the checkpoint's tree"
    )
    payload: Literal["matches", "differs", "erased"] | None = Field(
        default=None,
        description="its payload kept apart hashes to what its bytes commit to; None: none apart",
    )

    @property
    def ok(self) -> bool:
        return self.recomputes and self.included is not False and self.payload != "differs"


class VerifyReport(BaseModel):
    ok: bool
    entries_checked: int = Field(description="leaves rebuilt from their entries' bytes")
    pending: int = Field(description="entries committed but not yet integrated into the tree")
    nodes_checked: int
    checkpoints_checked: int
    signatures_checked: bool = Field(description="False when no trusted log key was given")
    witnessed_checked: int = Field(description="checkpoints held by witnesses or kept elsewhere, matched")
    stacks_checked: int
    prompts_checked: int
    stored_receipts_checked: int = Field(
        default=0, description="receipts rows keep, each the log's for its entry"
    )
    receipts_checked: int = Field(
        default=0, description="receipts given whose entries are in the tree verified"
    )
    receipts_pending: int = Field(default=0, description="receipts given whose entries wait to be integrated")
    payloads_checked: int = Field(
        default=0, description="payloads kept apart, each hashing to its entry's hash"
    )
    payloads_erased: int = Field(default=0, description="payloads erased, each named by an erasure entry")
    tree_size: int
    root_hash: str = Field(description="base64 root of the rebuilt tree")
    checkpoint: str | None = Field(description="the latest signed checkpoint, to keep elsewhere")
    problem: LogProblem | None
