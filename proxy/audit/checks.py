"""What verification judges: pure checks of entries, the tree rebuilt from them, and checkpoints.

No database and no clock: `verify.py` reads rows page by page and feeds them here. The walker rebuilds the
Merkle tree from the entries' own bytes (never from the stored nodes), so that whatever the database says its
tree is, the roots compared with signed checkpoints are those of the entries it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from proxy.audit.entries import (
    GENESIS_SHA256,
    NotCanonicalizable,
    StoredFields,
    is_json_object,
    parse_content,
    payload_sha256,
    prompt_sha256,
    sha256_hex,
)
from proxy.audit.merkle import EMPTY_ROOT, Node, fold, grow, leaf_hash, node_hash
from proxy.audit.note import Verifier
from proxy.audit.receipts import mismatch

ProblemKind = Literal[
    "gap",
    "entry_missing",
    "orphan_entry",
    "content_not_canonical",
    "hash_mismatch",
    "leaf_mismatch",
    "node_mismatch",
    "prev_mismatch",
    "root_mismatch",
    "signature_invalid",
    "unsigned_leaves",
    "witnessed_root_mismatch",
    "witnessed_beyond_log",
    "witness_signature_invalid",
    "stack_hash_mismatch",
    "stack_missing",
    "prompt_hash_mismatch",
    "prompt_missing",
    "receipt_mismatch",
    "receipt_invalid",
    "receipt_unfulfilled",
    "payload_mismatch",
    "payload_missing",
]


class LogProblem(BaseModel):
    """The first thing verification found wrong, and where (`position`: the leaf index)."""

    kind: ProblemKind
    message: str
    position: int | None = None
    record_id: str | None = None


@dataclass(frozen=True)
class Leaf:
    """One leaf of the stored tree as verification reads it: its entry (None when the row is gone) and the hash
    the stored tree holds for it (None when that node is gone)."""

    index: int
    entry: StoredFields | None
    stored_hash: bytes | None
    receipt: str | None = None  # the log's receipt the row keeps, if any


@dataclass(frozen=True)
class Claim:
    """A tree size and root that someone signed: the log (`source` "log") or a witness, which the rebuilt tree must
    match."""

    size: int
    root: bytes
    source: str


def entry_problem(leaf: Leaf) -> tuple[bytes | None, LogProblem | None]:
    """The leaf hash of the entry's own bytes, or what is wrong with the entry."""
    entry = leaf.entry
    if entry is None:
        return None, LogProblem(
            kind="entry_missing",
            message=f"leaf {leaf.index} is in the tree but its entry is gone (deleted)",
            position=leaf.index,
        )
    where = {"position": leaf.index, "record_id": entry.fields.record_id}
    if not is_json_object(entry.fields.content_json) or not parse_content(entry.fields.content_json)[1]:
        return None, LogProblem(
            kind="content_not_canonical",
            message=f"entry {leaf.index} stores content that is not the canonical JSON of an object (edited)",
            **where,
        )
    try:
        text = entry.text()
    except (NotCanonicalizable, ValueError) as exc:
        return None, LogProblem(
            kind="hash_mismatch", message=f"entry {leaf.index} cannot be hashed: {exc}", **where
        )
    if sha256_hex(text) != entry.sha256:
        return None, LogProblem(
            kind="hash_mismatch",
            message=f"entry {leaf.index} is stored with sha256 {entry.sha256} but its fields hash to "
            f"{sha256_hex(text)} (the entry or its hash was edited)",
            **where,
        )
    leaf_digest = leaf_hash(text.encode("utf-8"))
    if leaf.stored_hash != leaf_digest:
        return None, LogProblem(
            kind="leaf_mismatch",
            message=f"entry {leaf.index} does not hash to the leaf the stored tree holds at {leaf.index} "
            "(the entry was replaced, or the tree's leaves were moved)",
            **where,
        )
    return leaf_digest, None


class TreeWalker:
    """Rebuilds the tree from leaves fed to it page by page in index order, and holds it to every claim.

    Keeps only the tree's peaks (O(log n)). `feed` returns the first problem and the walker stops there.
    """

    def __init__(self, claims: list[Claim], receipt_keys: list[Verifier] | None = None) -> None:
        self.size = 0
        self.receipts = 0  # stored receipts checked
        self._receipt_keys = receipt_keys or []
        self.problem: LogProblem | None = None
        self._peaks: list[tuple[Node, bytes]] = []
        self._claims: list[Claim] = []
        self._chain: tuple[int, str] | None = (
            0,
            GENESIS_SHA256,
        )  # the last chained entry, while there are some
        self.add(claims)

    def add(self, claims: list[Claim]) -> LogProblem | None:
        """More claims to hold the tree to; each must be added before the walk passes its size."""
        if any(claim.size < self.size for claim in claims):
            raise ValueError("a claim was added after the walk passed its size")
        # At one size the log's own checkpoint is judged first: a mismatch there needs no witness to be seen.
        self._claims = sorted([*self._claims, *claims], key=lambda c: (c.size, c.source != "log"))
        if self.problem is None:
            self.problem = self._check_claims()
        return self.problem

    @property
    def root(self) -> bytes:
        return fold([h for _, h in self._peaks]) if self._peaks else EMPTY_ROOT

    def feed(self, leaves: list[Leaf]) -> LogProblem | None:
        for leaf in leaves:
            if self.problem is not None:
                break
            self.problem = self._check(leaf)
        return self.problem

    def _check(self, leaf: Leaf) -> LogProblem | None:
        if leaf.index != self.size:
            return LogProblem(
                kind="gap",
                message=f"the tree's leaves jump from {self.size - 1} to {leaf.index} (leaves deleted or renumbered)",
                position=self.size,
            )
        digest, problem = entry_problem(leaf)
        if problem is not None:
            return problem
        assert digest is not None and leaf.entry is not None
        problem = self._check_chain(leaf.index, leaf.entry) or self._check_receipt(leaf, digest)
        if problem is not None:
            return problem
        growth = grow(self.size, self._peaks, [digest])
        self._peaks, self.size = growth.peaks, self.size + 1
        return self._check_claims()

    def _check_receipt(self, leaf: Leaf, digest: bytes) -> LogProblem | None:
        """A receipt the row keeps must be the log's, for this very entry."""
        if leaf.receipt is None or leaf.entry is None:
            return None
        fields = leaf.entry.fields
        wrong = mismatch(leaf.receipt, fields.record_id, fields.part, digest, self._receipt_keys)
        if wrong is not None:
            return LogProblem(
                kind="receipt_mismatch",
                message=f"entry {leaf.index} keeps a receipt that is not the log's for it: {wrong}",
                position=leaf.index,
                record_id=fields.record_id,
            )
        self.receipts += 1
        return None

    def _check_chain(self, index: int, entry: StoredFields) -> LogProblem | None:
        """Chained entries come first, in their chain's order, each naming its predecessor's hash."""
        where = {"position": index, "record_id": entry.fields.record_id}
        if entry.chained_at is None:
            self._chain = None
            return None
        if self._chain is None:
            return LogProblem(
                kind="prev_mismatch", message=f"chained entry {index} follows unchained ones", **where
            )
        position, prev = entry.chained_at
        if (position, prev) != (self._chain[0] + 1, self._chain[1]):
            return LogProblem(
                kind="prev_mismatch",
                message=f"chained entry {index} (chain position {position}) does not follow chain position "
                f"{self._chain[0]} ({self._chain[1]})",
                **where,
            )
        self._chain = (position, entry.sha256)
        return None

    def _check_claims(self) -> LogProblem | None:
        while self._claims and self._claims[0].size <= self.size:
            claim = self._claims.pop(0)
            if claim.size == self.size and claim.root != self.root:
                return _root_problem(claim, self.size)
        return None

    def finish(self) -> LogProblem | None:
        """Call after the last page: a claim beyond the rebuilt tree means leaves were cut off its end."""
        if self.problem is None:
            self.problem = self._check_claims()
        if self.problem is None and self._claims:
            claim = self._claims[-1]
            kind = "witnessed_beyond_log" if claim.source != "log" else "root_mismatch"
            self.problem = LogProblem(
                kind=kind,
                message=f"{claim.source} signed a tree of size {claim.size}, but the log holds only {self.size} "
                "leaves (its tail was cut, and its checkpoints rewound)",
                position=self.size,
            )
        return self.problem


def _root_problem(claim: Claim, size: int) -> LogProblem:
    if claim.source == "log":
        return LogProblem(
            kind="root_mismatch",
            message=f"the log signed root {claim.root.hex()} at size {size}, but its entries make another tree "
            "(entries edited, replaced or reordered)",
            position=size - 1 if size else None,
        )
    return LogProblem(
        kind="witnessed_root_mismatch",
        message=f"{claim.source} holds root {claim.root.hex()} at size {size}, but the log's entries make another "
        "tree there (history rewritten)",
        position=size - 1 if size else None,
    )


def node_problem(node: Node, stored: bytes, left: bytes | None, right: bytes | None) -> LogProblem | None:
    """A stored inner node must be the hash of its stored children (else proofs from it would fail)."""
    level, index = node
    if left is None or right is None or node_hash(left, right) != stored:
        return LogProblem(
            kind="node_mismatch",
            message=f"the stored tree node at level {level}, index {index} is not the hash of its children "
            "(the stored tree was edited)",
            position=index << level,
        )
    return None


def check_stack_row(fingerprint: str, canonical_text: str) -> LogProblem | None:
    if sha256_hex(canonical_text) != fingerprint:
        return LogProblem(
            kind="stack_hash_mismatch",
            message=f"the stored stack {fingerprint} does not hash to its fingerprint (its JSON was edited)",
        )
    content, canonical = parse_content(canonical_text)
    if content is None or not canonical:
        return LogProblem(
            kind="stack_hash_mismatch",
            message=f"the stored stack {fingerprint} is not canonical JSON of an object",
        )
    return None


def check_payload_row(
    seq: int, record_id: str, committed: str | None, salt: str, text: str
) -> LogProblem | None:
    """A payload kept apart must be canonical JSON of an object and hash, with its salt, to what its entry's bytes
    commit to."""
    content, canonical = parse_content(text)
    try:
        digest = payload_sha256(bytes.fromhex(salt), text)
    except ValueError:
        digest = None
    if content is None or not canonical or committed is None or digest != committed:
        return LogProblem(
            kind="payload_mismatch",
            message=f"the payload kept for entry seq {seq} does not hash to what the entry commits to (the payload or "
            "its salt was edited, or the entry commits to none)",
            record_id=record_id,
        )
    return None


def check_prompt_row(sha256: str, text: str) -> LogProblem | None:
    if prompt_sha256(text) != sha256:
        return LogProblem(
            kind="prompt_hash_mismatch",
            message=f"the stored prompt {sha256} does not hash to its address (its text was edited)",
        )
    return None
