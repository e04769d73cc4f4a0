"""The audit store: an append-only transparency log of every answer, on SQLite or PostgreSQL.

The proxy builds each record's content and hands it over as a `SealedEntry` (made by `seal`, which checks it
against the declaration of an entry's header, header.py); this package commits it (group commit), puts it in a
Merkle tree and signs checkpoints over it, reads records and proofs back, and verifies the log. See docs/audit.md.
"""

from proxy.audit.checks import LogProblem
from proxy.audit.commit import CommitObserver
from proxy.audit.entries import prompt_sha256, stack_fingerprint
from proxy.audit.errors import (
    AuditError,
    DatabaseUrlError,
    DuplicateEntry,
    LogDiverged,
    NoSuchCheckpoint,
    NotErasable,
    SchemaError,
    SchemaOutdated,
    SchemaTooNew,
    StoreClosed,
    StoreUnavailable,
    UnknownStack,
)
from proxy.audit.listing import RecordFilter
from proxy.audit.merkle import ProofError
from proxy.audit.note import NoteError, Signer, Verifier
from proxy.audit.schema import HEAD_REVISION, schema_revision, upgrade_database
from proxy.audit.sealed import InvalidEntry, SealedEntry, seal
from proxy.audit.store import AuditStore
from proxy.audit.values import (
    AuditRecord,
    ConsistencyProof,
    EntryCheck,
    EntryProof,
    EntryView,
    OpenStream,
    RecordCounts,
    RecordProof,
    RecordSummary,
    SignedCheckpoint,
    StoredEntry,
    StreamCounts,
    VerifyReport,
)
from proxy.audit.verify import Witnessed
from proxy.canonical import canonical_json

__all__ = [
    "HEAD_REVISION",
    "AuditError",
    "AuditRecord",
    "AuditStore",
    "CommitObserver",
    "ConsistencyProof",
    "DatabaseUrlError",
    "DuplicateEntry",
    "EntryCheck",
    "EntryProof",
    "EntryView",
    "InvalidEntry",
    "LogDiverged",
    "LogProblem",
    "NoSuchCheckpoint",
    "NotErasable",
    "NoteError",
    "OpenStream",
    "ProofError",
    "RecordCounts",
    "RecordFilter",
    "RecordProof",
    "RecordSummary",
    "SchemaError",
    "SchemaOutdated",
    "SchemaTooNew",
    "SealedEntry",
    "SignedCheckpoint",
    "Signer",
    "StoreClosed",
    "StoreUnavailable",
    "StoredEntry",
    "StreamCounts",
    "UnknownStack",
    "Verifier",
    "VerifyReport",
    "Witnessed",
    "canonical_json",
    "prompt_sha256",
    "schema_revision",
    "seal",
    "stack_fingerprint",
    "upgrade_database",
]
