"""Reading proofs out of the stored log: a record's entries with their inclusion proofs, consistency proofs between
two tree sizes, and one record's entries checked against the latest checkpoint.

Synchronous functions over a `Connection`, which the store runs through `AsyncConnection.run_sync`. Which nodes
a proof needs is `merkle.py`'s business, fetching them `tree.py`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import Connection, select

from proxy.audit.entries import payload_sha256, sha256_hex
from proxy.audit.merkle import ProofError, leaf_hash, verify_inclusion
from proxy.audit.models import Entry, Payload
from proxy.audit.note import Verifier, open_checkpoint, parse_checkpoint, parse_note
from proxy.audit.tree import (
    b64,
    checkpoint_of_size,
    consistency_proof,
    inclusion_proof,
    latest_checkpoint,
    leaf_indexes,
    read_nodes,
    stored_fields,
)
from proxy.audit.values import ConsistencyProof, EntryCheck, EntryProof, RecordProof, SignedCheckpoint

ENTRIES = Entry.__table__
PAYLOADS = Payload.__table__


def _record_rows(connection: Connection, record_id: str) -> list[Any]:
    """The record's entries in log order, each with its payload and salt while they are kept."""
    query = (
        select(ENTRIES, PAYLOADS.c.payload.label("payload_text"), PAYLOADS.c.salt.label("payload_salt"))
        .select_from(ENTRIES.outerjoin(PAYLOADS, PAYLOADS.c.seq == ENTRIES.c.seq))
        .where(ENTRIES.c.record_id == record_id)
        .order_by(ENTRIES.c.seq)
    )
    return list(connection.execute(query).mappings().all())


def payload_state(row: Any) -> Literal["matches", "differs", "erased"] | None:
    """Whether an entry's payload, kept apart, still hashes to what its bytes commit to."""
    if row["payload_sha256"] is None:
        return None if row["payload_text"] is None else "differs"
    if row["payload_text"] is None:
        return "erased"
    try:
        digest = payload_sha256(bytes.fromhex(row["payload_salt"]), row["payload_text"])
    except ValueError:
        return "differs"
    return "matches" if digest == row["payload_sha256"] else "differs"


def record_proof(
    connection: Connection, record_id: str, tenant: str | None, size: int | None
) -> RecordProof | None:
    rows = _record_rows(connection, record_id)
    main = [row for row in rows if row["part"] != "flag"]
    if not main or (tenant is not None and main[0]["tenant"] != tenant):
        return None
    checkpoint = checkpoint_of_size(connection, size)
    indexes = leaf_indexes(connection, [int(row["seq"]) for row in rows])
    proofs = []
    for row in rows:
        text_ = stored_fields(row).text()
        index = indexes.get(int(row["seq"]))
        proof = None
        if index is not None and index < checkpoint.tree_size:
            proof = [b64(h) for h in inclusion_proof(connection, index, checkpoint.tree_size)]
        proofs.append(
            EntryProof(
                seq=row["seq"],
                part=row["part"],
                index=index,
                entry=text_,
                leaf_hash=b64(leaf_hash(text_.encode("utf-8"))),
                proof=proof,
                payload=row["payload_text"],
                salt=row["payload_salt"],
                payload_erased=row["payload_sha256"] is not None and row["payload_text"] is None,
                receipt=row["receipt"],
            )
        )
    return RecordProof(record=record_id, checkpoint=checkpoint, entries=proofs)


def consistency(connection: Connection, old: int, new: int | None) -> ConsistencyProof:
    latest = latest_checkpoint(connection)
    signed = latest.tree_size if latest is not None else 0
    new = signed if new is None else new
    if new > signed:
        raise ProofError(f"the log's latest checkpoint has tree size {signed}; no proof reaches size {new}")
    proof = consistency_proof(connection, old, new)
    return ConsistencyProof(old_size=old, new_size=new, proof=[b64(h) for h in proof])


def check_record(
    connection: Connection, record_id: str, verifiers: list[Verifier]
) -> tuple[list[EntryCheck], SignedCheckpoint | None]:
    rows = _record_rows(connection, record_id)
    latest = latest_checkpoint(connection)
    checkpoint = None
    if latest is not None:
        note = latest.note
        checkpoint = (
            open_checkpoint(note, verifiers)[0] if verifiers else parse_checkpoint(parse_note(note).text)
        )
    indexes = leaf_indexes(connection, [int(row["seq"]) for row in rows])
    stored = read_nodes(connection, [(0, index) for index in indexes.values()])
    checks = []
    for row in rows:
        fields, index = stored_fields(row), indexes.get(int(row["seq"]))
        try:
            text_ = fields.text()
        except ValueError:  # fields that have no canonical form any more: edited
            text_ = ""
        leaf = leaf_hash(text_.encode("utf-8"))
        recomputes = (
            bool(text_) and sha256_hex(text_) == fields.sha256 and stored.get((0, index), leaf) == leaf
        )
        included: bool | None = None
        if index is not None:
            # An index past the checkpoint read is an entry integrated since (each statement here sees commits as
            # they land): not in that checkpoint's tree yet, so unproven rather than disproved.
            included = None if checkpoint is not None and index >= checkpoint.size else checkpoint is not None
            if included:
                assert checkpoint is not None
                try:
                    proof = inclusion_proof(connection, index, checkpoint.size)
                    verify_inclusion(index, checkpoint.size, leaf, proof, checkpoint.root)
                except ProofError:
                    included = False
        checks.append(
            EntryCheck(
                seq=row["seq"],
                index=index,
                part=row["part"],
                sha256=row["sha256"],
                recomputes=recomputes,
                included=included,
                payload=payload_state(row),
            )
        )
    return checks, latest
