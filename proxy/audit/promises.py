"""What verification holds the log to beyond its tree: the receipts it gave (kept by clients), the payloads it
keeps beside the tree, and the ones it erased.

Synchronous functions over a `Connection`, called by `verify.py` after the tree, page by page; each returns the
first problem it finds and counts what it checked in a `Kept`. What a receipt is, is `receipts.py`'s; what an
erasure says, `erasure.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, select

from proxy.audit.checks import LogProblem, check_payload_row
from proxy.audit.entries import load_canonical
from proxy.audit.erasure import erased_seqs
from proxy.audit.header import ERASED, storable
from proxy.audit.merkle import leaf_hash
from proxy.audit.models import Entry, LogLeaf, Payload
from proxy.audit.note import Verifier
from proxy.audit.receipts import Receipt, ReceiptError, signed_by
from proxy.audit.tree import stored_fields

ENTRIES = Entry.__table__
LEAVES = LogLeaf.__table__
PAYLOADS = Payload.__table__


@dataclass
class Kept:
    """What the checks found kept: receipts fulfilled (their entries in the tree verified) or pending (committed,
    not yet in it), payloads kept matching their hashes, payloads erased each by an erasure naming it."""

    receipts: int = 0
    receipts_pending: int = 0
    payloads: int = 0
    erased: int = 0


RECEIPT_CHUNK = 500  # records looked up per query


def payloads_kept(connection: Connection, tally: Kept, page_size: int) -> LogProblem | None:
    """Every payload kept apart hashes, with its salt, to what its entry's bytes commit to."""
    after = 0
    while True:
        rows = connection.execute(
            select(
                PAYLOADS.c.seq,
                PAYLOADS.c.salt,
                PAYLOADS.c.payload,
                ENTRIES.c.payload_sha256,
                ENTRIES.c.record_id,
            )
            .select_from(PAYLOADS.join(ENTRIES, ENTRIES.c.seq == PAYLOADS.c.seq))
            .where(PAYLOADS.c.seq > after)
            .order_by(PAYLOADS.c.seq)
            .limit(page_size)
        ).all()
        if not rows:
            return None
        for seq, salt, text, committed, record_id in rows:
            problem = check_payload_row(int(seq), record_id, committed, salt, text)
            if problem is not None:
                return problem
            tally.payloads += 1
        after = int(rows[-1][0])


def payloads_erased(connection: Connection, tally: Kept, page_size: int) -> LogProblem | None:
    """Every payload gone from an entry that committed to one was erased by an erasure entry of its record that
    names it; otherwise it was deleted behind the log's back."""
    kept = select(PAYLOADS.c.seq).where(PAYLOADS.c.seq == ENTRIES.c.seq).exists()
    after = 0
    while True:
        gone = connection.execute(
            select(ENTRIES.c.seq, ENTRIES.c.record_id)
            .where(ENTRIES.c.seq > after, ENTRIES.c.payload_sha256.is_not(None), ~kept)
            .order_by(ENTRIES.c.seq)
            .limit(page_size)
        ).all()
        if not gone:
            return None
        erasures = connection.execute(
            select(ENTRIES.c.content).where(
                ENTRIES.c.record_id.in_({record_id for _, record_id in gone}),
                ENTRIES.c.part == "flag",
                ENTRIES.c.status == ERASED,
            )
        ).scalars()
        named = set().union(*(erased_seqs(load_canonical(text)) for text in erasures))
        for seq, record_id in gone:
            if seq not in named:
                return LogProblem(
                    kind="payload_missing",
                    message=f"the payload of entry seq {seq} is gone and no erasure entry of record {record_id} "
                    "names it (deleted behind the log's back)",
                    record_id=record_id,
                )
            tally.erased += 1
        after = int(gone[-1][0])


def receipts_kept(
    connection: Connection, receipts: list[Receipt], verifiers: list[Verifier], size: int, tally: Kept
) -> LogProblem | None:
    """Each receipt given must be the log's (when keys are trusted) and name an entry the log holds: in the tree
    verified (of `size` leaves), or committed and waiting for it; otherwise the log broke its promise."""
    wanted: dict[str, list[Receipt]] = {}
    for receipt in receipts:
        try:
            if verifiers:
                signed_by(receipt, verifiers)
        except ReceiptError as exc:
            return LogProblem(
                kind="receipt_invalid",
                message=f"a receipt for record {receipt.record_id} ({receipt.part}) is not the log's: {exc}",
                record_id=receipt.record_id,
            )
        wanted.setdefault(receipt.record_id, []).append(receipt)
    names = sorted(name for name in wanted if storable(name, ENTRIES.c.record_id.type.length))
    held: dict[tuple[str, bytes], int | None] = {}
    for start in range(0, len(names), RECEIPT_CHUNK):
        rows = connection.execute(
            select(ENTRIES, LEAVES.c.leaf_index)
            .select_from(ENTRIES.outerjoin(LEAVES, LEAVES.c.seq == ENTRIES.c.seq))
            .where(ENTRIES.c.record_id.in_(names[start : start + RECEIPT_CHUNK]))
        ).mappings()
        for row in rows:
            try:
                leaf = leaf_hash(stored_fields(row).text().encode("utf-8"))
            except ValueError:  # an edited row, which the walk reports
                continue
            held[(row["record_id"], leaf)] = row["leaf_index"]
    for receipt in receipts:
        key = (receipt.record_id, receipt.leaf_hash)
        if key not in held:
            return LogProblem(
                kind="receipt_unfulfilled",
                message=f"the log's receipt promises leaf {receipt.leaf_b64} of record {receipt.record_id} "
                f"({receipt.part}, {receipt.time}, in the tree by {receipt.integrate_by}), and the log holds no "
                "such entry (dropped before it was integrated, or replaced)",
                record_id=receipt.record_id,
            )
        index = held[key]
        if index is not None and index < size:
            tally.receipts += 1
        else:
            tally.receipts_pending += 1
    return None
