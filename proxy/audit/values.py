"""The values that cross the audit store's interface: what the proxy hands in and what it reads back.

`NewEntry` validates whatever it is given (pydantic), when it is built, so that one bad entry fails its own caller
with a message saying what to fix, before it can reach a group commit shared with others. It is the door for
callers outside the proxy's request path, whose own door is `sealed.seal`; both end in a `SealedEntry`, which
the store (`store.py`, `commit.py`) trusts.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.audit.checks import LogProblem
from proxy.audit.entries import EntryFields, Part, prompt_sha256, sha256_hex
from proxy.audit.sealed import SealedEntry, sealed_from
from proxy.canonical import canonical_json

HEX64 = r"^[0-9a-f]{64}$"


class NewEntry(BaseModel):
    """One entry the proxy asks to append. `stack` may be left out when its fingerprint was stored before."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    record_id: str = Field(min_length=1, max_length=100)
    part: Part
    tenant: str = Field(min_length=1, max_length=200)
    created_at: AwareDatetime
    replica: str | None = Field(default=None, max_length=200)
    model: str | None = Field(default=None, max_length=200)
    fingerprint: str | None = Field(default=None, pattern=HEX64)
    stack: dict[str, Any] | None = None
    stack_declared: bool = False
    prompt_text: str | None = None
    replay_of: str | None = Field(default=None, min_length=1, max_length=100)
    status: str = Field(min_length=1, max_length=64)
    content: dict[str, Any]

    _content_json: str = PrivateAttr(default="")
    _stack_json: str | None = PrivateAttr(default=None)
    _sealed: SealedEntry | None = PrivateAttr(default=None)

    @field_validator("created_at")
    @classmethod
    def _in_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @field_validator("record_id", "tenant", "replica", "model", "replay_of", "status", "prompt_text")
    @classmethod
    def _no_nul(cls, value: str | None, info: ValidationInfo) -> str | None:
        # PostgreSQL text cannot hold NUL: refused here, such a value would fail a whole group commit instead of
        # its own caller. (Lone surrogates pydantic refuses itself.)
        if value is not None and "\x00" in value:
            raise ValueError(f"{info.field_name} must not contain NUL characters")
        return value

    @model_validator(mode="after")
    def _canonical_forms(self) -> NewEntry:
        try:
            self._content_json = canonical_json(self.content).decode("utf-8")
        except ValueError as exc:
            raise ValueError(f"content: {exc}") from exc
        if self.stack is not None:
            try:
                self._stack_json = canonical_json(self.stack).decode("utf-8")
            except ValueError as exc:
                raise ValueError(f"stack: {exc}") from exc
            computed = sha256_hex(self._stack_json)
            if self.fingerprint is None:
                object.__setattr__(self, "fingerprint", computed)
            elif self.fingerprint != computed:
                raise ValueError(
                    f"fingerprint {self.fingerprint} does not match the stack given, whose canonical JSON "
                    f"hashes to {computed}"
                )
        return self

    @property
    def content_json(self) -> str:
        return self._content_json

    @property
    def stack_json(self) -> str | None:
        return self._stack_json

    @property
    def prompt_sha256(self) -> str | None:
        return None if self.prompt_text is None else prompt_sha256(self.prompt_text)

    def fields(self) -> EntryFields:
        return EntryFields(
            record_id=self.record_id,
            part=self.part,
            tenant=self.tenant,
            created_at=self.created_at,
            replica=self.replica,
            model=self.model,
            fingerprint=self.fingerprint,
            prompt_sha256=self.prompt_sha256,
            replay_of=self.replay_of,
            status=self.status,
            content_json=self.content_json,
            stack_declared=self.stack_declared if self.fingerprint is not None else None,
        )

    def sealed(self) -> SealedEntry:
        """The entry's bytes and both hashes, made once (entries.py, sealed.py)."""
        if self._sealed is None:
            self._sealed = sealed_from(
                self.fields(), self.content_json.encode("utf-8"), self.stack_json, self.prompt_text
            )
        return self._sealed

    @property
    def text(self) -> str:
        return self.sealed().encoded.decode("utf-8")

    @property
    def sha256(self) -> str:
        return self.sealed().sha256

    @property
    def leaf_hash(self) -> bytes:
        return self.sealed().leaf_hash


class StoredEntry(BaseModel):
    """An entry after its commit: durable, sequenced, and in the tree from the next checkpoint on."""

    record_id: str
    part: Part
    seq: int = Field(description="its place in the sequence: unique, increasing, with gaps")
    sha256: str
    leaf_hash: str = Field(description="hex SHA-256(0x00 || entry bytes), the leaf it becomes")
    created_at: datetime


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
    content: dict[str, Any]
    sha256: str


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
    flags: list[EntryView]


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

    @property
    def ok(self) -> bool:
        return self.recomputes and self.included is not False


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
    tree_size: int
    root_hash: str = Field(description="base64 root of the rebuilt tree")
    checkpoint: str | None = Field(description="the latest signed checkpoint, to keep elsewhere")
    problem: LogProblem | None
