"""The stored tree: its nodes, leaves and checkpoints as tables, read in O(log n) rows for a head or a proof.

Synchronous functions over a SQLAlchemy `Connection`, so that the integrator (inside its transaction), the
store (through `AsyncConnection.run_sync`) and verification share them. Which nodes a proof needs is
`merkle.py`'s decision; this module only fetches them, in one query.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, func, select, tuple_

from proxy.audit.entries import EntryFields, StoredFields
from proxy.audit.errors import NoSuchCheckpoint
from proxy.audit.header import HEADER_NAMES
from proxy.audit.merkle import (
    Node,
    ProofError,
    consistency_ranges,
    inclusion_ranges,
    nodes_for,
    peaks,
    range_hash,
)
from proxy.audit.models import LogCheckpoint, LogLeaf, TreeNode
from proxy.audit.values import SignedCheckpoint

NODES = TreeNode.__table__
LEAVES = LogLeaf.__table__
CHECKPOINTS = LogCheckpoint.__table__
# Row-value IN lists stay well below every driver's limit on bound parameters.
NODE_QUERY_CHUNK = 2000


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def stored_fields(row: Mapping[str, Any]) -> StoredFields:
    """An `entries` row as the bytes it must hash to (entries.py)."""
    fields = EntryFields(**{name: row[name] for name in HEADER_NAMES}, content_json=row["content"])
    chained = None if row["prev_sha256"] is None else (int(row["seq"]), str(row["prev_sha256"]))
    return StoredFields(fields=fields, sha256=row["sha256"], chained_at=chained)


def read_nodes(connection: Connection, wanted: Iterable[Node]) -> dict[Node, bytes]:
    """The stored hashes of these nodes: level 0 from the leaves, the others from the inner nodes."""
    keys = sorted(set(wanted))
    leaves = [idx for level, idx in keys if level == 0]
    inner = [key for key in keys if key[0] > 0]
    found: dict[Node, bytes] = {}
    for start in range(0, len(leaves), NODE_QUERY_CHUNK):
        part = leaves[start : start + NODE_QUERY_CHUNK]
        rows = connection.execute(
            select(LEAVES.c.leaf_index, LEAVES.c.leaf_hash).where(LEAVES.c.leaf_index.in_(part))
        )
        found.update({(0, int(idx)): bytes.fromhex(digest) for idx, digest in rows})
    for start in range(0, len(inner), NODE_QUERY_CHUNK):
        chunk = inner[start : start + NODE_QUERY_CHUNK]
        rows = connection.execute(
            select(NODES.c.level, NODES.c.idx, NODES.c.hash).where(
                tuple_(NODES.c.level, NODES.c.idx).in_(chunk)
            )
        )
        found.update({(int(level), int(idx)): bytes.fromhex(digest) for level, idx, digest in rows})
    return found


def _complete(connection: Connection, wanted: set[Node]) -> dict[Node, bytes]:
    nodes = read_nodes(connection, wanted)
    missing = wanted - set(nodes)
    if missing:
        level, idx = min(missing)
        raise ProofError(f"the stored tree lacks node (level {level}, index {idx}); run stackpin verify")
    return nodes


def leaf_count(connection: Connection) -> int:
    last = connection.execute(select(func.max(LEAVES.c.leaf_index))).scalar()
    return 0 if last is None else int(last) + 1


def peak_hashes(connection: Connection, size: int) -> list[tuple[Node, bytes]]:
    wanted = peaks(0, size)
    nodes = _complete(connection, set(wanted))
    return [(node, nodes[node]) for node in wanted]


def inclusion_proof(connection: Connection, index: int, size: int) -> list[bytes]:
    ranges = inclusion_ranges(index, size)
    nodes = _complete(connection, nodes_for(ranges))
    return [range_hash(span, nodes) for span in ranges]


def consistency_proof(connection: Connection, old: int, new: int) -> list[bytes]:
    ranges = consistency_ranges(old, new)
    nodes = _complete(connection, nodes_for(ranges))
    return [range_hash(span, nodes) for span in ranges]


def _signed(row: Any) -> SignedCheckpoint:
    return SignedCheckpoint(
        tree_size=int(row.tree_size), root_hash=b64(bytes.fromhex(row.root_hash)), note=str(row.note)
    )


def latest_checkpoint(connection: Connection) -> SignedCheckpoint | None:
    row = connection.execute(
        select(CHECKPOINTS.c.tree_size, CHECKPOINTS.c.root_hash, CHECKPOINTS.c.note)
        .order_by(CHECKPOINTS.c.tree_size.desc())
        .limit(1)
    ).one_or_none()
    return None if row is None else _signed(row)


def checkpoint_of_size(connection: Connection, size: int | None) -> SignedCheckpoint:
    """The checkpoint of `size` (None: the latest); NoSuchCheckpoint when the log signed none of that size."""
    if size is None:
        found = latest_checkpoint(connection)
        if found is None:
            raise NoSuchCheckpoint("the log has signed no checkpoint yet; it signs one within a second")
        return found
    row = connection.execute(
        select(CHECKPOINTS.c.tree_size, CHECKPOINTS.c.root_hash, CHECKPOINTS.c.note).where(
            CHECKPOINTS.c.tree_size == size
        )
    ).one_or_none()
    if row is None:
        raise NoSuchCheckpoint(f"the log signed no checkpoint of tree size {size}")
    return _signed(row)


def leaf_indexes(connection: Connection, seqs: list[int]) -> dict[int, int]:
    """seq -> leaf index, for those of `seqs` that are in the tree."""
    if not seqs:
        return {}
    rows = connection.execute(select(LEAVES.c.seq, LEAVES.c.leaf_index).where(LEAVES.c.seq.in_(seqs)))
    return {int(seq): int(index) for seq, index in rows}
