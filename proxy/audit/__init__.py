"""The audit store: an append-only, hash-chained log of every answer, on SQLite or PostgreSQL.

The proxy builds each record's content and hands it over as a `NewEntry`; this package commits it (group
commit), reads records back, and verifies the chain. See docs/audit.md.
"""

from proxy.audit.chain import ChainProblem, canonical_json, prompt_sha256, stack_fingerprint
from proxy.audit.commit import CommitObserver
from proxy.audit.errors import (
    AuditError,
    DatabaseUrlError,
    DuplicateEntry,
    SchemaError,
    SchemaOutdated,
    SchemaTooNew,
    StoreClosed,
    StoreUnavailable,
    UnknownStack,
)
from proxy.audit.listing import RecordFilter
from proxy.audit.schema import HEAD_REVISION, schema_revision, upgrade_database
from proxy.audit.store import AuditStore
from proxy.audit.values import (
    AuditRecord,
    EntryView,
    LinkCheck,
    NewEntry,
    OpenStream,
    RecordCounts,
    RecordSummary,
    StoredEntry,
    StreamCounts,
    VerifyReport,
)

__all__ = [
    "HEAD_REVISION",
    "AuditError",
    "AuditRecord",
    "AuditStore",
    "ChainProblem",
    "CommitObserver",
    "DatabaseUrlError",
    "DuplicateEntry",
    "EntryView",
    "LinkCheck",
    "NewEntry",
    "OpenStream",
    "RecordCounts",
    "RecordFilter",
    "RecordSummary",
    "SchemaError",
    "SchemaOutdated",
    "SchemaTooNew",
    "StoreClosed",
    "StoreUnavailable",
    "StoredEntry",
    "StreamCounts",
    "UnknownStack",
    "VerifyReport",
    "canonical_json",
    "prompt_sha256",
    "schema_revision",
    "stack_fingerprint",
    "upgrade_database",
]
