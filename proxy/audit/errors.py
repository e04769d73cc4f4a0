"""The audit store's exceptions, in one tree; the proxy maps them to its own errors.

    AuditError
    ├── DatabaseUrlError   the URL names no supported database (says which forms are)
    ├── SchemaError        the database's schema is not the one this stackpin needs
    │   ├── SchemaOutdated older (or absent): `stackpin db upgrade` fixes it
    │   └── SchemaTooNew   newer than this stackpin knows: upgrade stackpin
    ├── UnknownStack       an entry names a fingerprint whose stack was never stored
    ├── DuplicateEntry     the record already has an entry of that part
    ├── StoreUnavailable   the database failed a commit or a read (down, unreachable, restarting); try again
    ├── StoreClosed        append after close()
    ├── NoSuchCheckpoint   the log signed no checkpoint of the size asked for (or none yet)
    ├── LogDiverged        the stored tree no longer matches what the log signed: it will not sign more
    └── NotErasable        a record whose payload cannot be erased: none, already erased, or hashed into its entry

Invalid entries are refused earlier, when `seal` makes them (`proxy.audit.sealed.InvalidEntry`, a ValueError naming
the field); a proof that cannot exist (a leaf beyond the tree, sizes out of order) is
`proxy.audit.merkle.ProofError`, a ValueError.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError


class AuditError(Exception):
    """Base of everything the audit store raises on purpose."""


class DatabaseUrlError(AuditError, ValueError):
    pass


class SchemaError(AuditError):
    pass


class SchemaOutdated(SchemaError):
    pass


class SchemaTooNew(SchemaError):
    pass


class UnknownStack(AuditError, ValueError):
    pass


class DuplicateEntry(AuditError, ValueError):
    pass


class StoreUnavailable(AuditError):
    """Each failed caller gets an exception of its own, so that no traceback grows across callers."""


class StoreClosed(AuditError):
    pass


class NoSuchCheckpoint(AuditError, LookupError):
    pass


class LogDiverged(AuditError):
    pass


class NotErasable(AuditError, ValueError):
    pass


def failure_reason(exc: BaseException) -> str:
    """One short line on a database failure: the driver's error, without SQLAlchemy's statement and
    parameters, which would carry request content into a log line or an error message."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(cause).__name__}: {first}"[:300] if first else type(cause).__name__
