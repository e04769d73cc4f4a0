"""The log's Merkle tree (RFC 6962 / RFC 9162, SHA-256): hashing, incremental growth, proofs and their checks.

Pure functions over bytes; nothing here knows where nodes are stored. A tree of size n is addressed by its
*perfect nodes*: node (level, index) is the root of leaves [index * 2**level, (index + 1) * 2**level), and it
exists once all of those leaves do. Every hash that a tree head or a proof needs is either such a node or the
root of a suffix [a, n) of the tree, which is folded from at most log2(n) perfect nodes (its *peaks*). So a
store that keeps the perfect nodes answers any head or proof with O(log n) reads (`nodes_for`).

Verification follows RFC 9162 sections 2.1.3.2 and 2.1.4.2 and is checked against the transparency-dev/merkle
test vectors (tests/data/merkle).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()

Node = tuple[int, int]  # (level, index)
Range = tuple[int, int]  # leaves [start, end)


class ProofError(ValueError):
    """A proof that does not verify, or a request for one that cannot exist; the message says which."""


def leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(size: int) -> int:
    """The largest power of two smaller than `size` (size >= 2): where RFC 6962 splits a tree."""
    return 1 << ((size - 1).bit_length() - 1)


def peaks(start: int, end: int) -> list[Node]:
    """The perfect nodes that cover [start, end), left to right, each as large as its alignment allows."""
    nodes: list[Node] = []
    while start < end:
        level = (end - start).bit_length() - 1
        if start:
            level = min(level, (start & -start).bit_length() - 1)
        nodes.append((level, start >> level))
        start += 1 << level
    return nodes


def fold(hashes: Sequence[bytes]) -> bytes:
    """The root over consecutive peaks, left to right: H(p1, H(p2, ... H(pk-1, pk)))."""
    if not hashes:
        return EMPTY_ROOT
    root = hashes[-1]
    for left in reversed(hashes[:-1]):
        root = node_hash(left, root)
    return root


def inclusion_ranges(index: int, size: int) -> list[Range]:
    """PATH(index, D[0:size]) of RFC 9162 2.1.3.1, as the leaf ranges whose roots make up the proof."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of size {size}")
    ranges: list[Range] = []
    start, end = 0, size
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
    return ranges[::-1]


def consistency_ranges(old: int, new: int) -> list[Range]:
    """PROOF(old, D[0:new]) of RFC 9162 2.1.4.1 as leaf ranges; `old` must be in 1..new."""
    if not 0 < old <= new:
        raise ProofError(f"no consistency proof from size {old} to size {new}: need 0 < from <= to")
    ranges: list[Range] = []
    start, end, m, whole = 0, new, old, True
    while m != end - start:
        k = _split(end - start)
        if m <= k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start, m, whole = start + k, m - k, False
    if not whole:
        ranges.append((start, end))
    return ranges[::-1]


def nodes_for(ranges: Iterable[Range]) -> set[Node]:
    """The stored nodes to read for these ranges (each is perfect, or a suffix folded from its peaks)."""
    return {node for start, end in ranges for node in peaks(start, end)}


def range_hash(span: Range, nodes: Mapping[Node, bytes]) -> bytes:
    return fold([nodes[node] for node in peaks(*span)])


@dataclass(frozen=True)
class Growth:
    """What appending leaves did: every perfect node they completed, and the peaks of the new tree."""

    nodes: list[tuple[Node, bytes]]
    peaks: list[tuple[Node, bytes]]

    @property
    def root(self) -> bytes:
        return fold([h for _, h in self.peaks])


def grow(size: int, old_peaks: Sequence[tuple[Node, bytes]], leaves: Sequence[bytes]) -> Growth:
    """Appends leaf hashes to a tree of `size` leaves whose peaks (`peaks(0, size)` with hashes) are given."""
    if [node for node, _ in old_peaks] != peaks(0, size):
        raise ProofError(f"the peaks given are not those of a tree of size {size}")
    stack = list(old_peaks)
    made: list[tuple[Node, bytes]] = []
    for offset, leaf in enumerate(leaves):
        node, digest = (0, size + offset), leaf
        made.append((node, digest))
        while stack and stack[-1][0][0] == node[0]:
            (level, left_index), left = stack.pop()
            node, digest = (level + 1, left_index >> 1), node_hash(left, digest)
            made.append((node, digest))
        stack.append((node, digest))
    return Growth(made, stack)


def _check_hash(name: str, value: bytes) -> None:
    if len(value) != HASH_SIZE:
        raise ProofError(f"{name} is {len(value)} bytes long, not {HASH_SIZE}")


def root_from_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root that `proof` implies for `leaf` at `index` in a tree of `size` (RFC 9162 2.1.3.2)."""
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is not below the tree size {size}")
    _check_hash("the leaf hash", leaf)
    fn, sn, root = index, size - 1, leaf
    for sibling in proof:
        _check_hash("a proof hash", sibling)
        if sn == 0:
            raise ProofError("the proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            root = node_hash(sibling, root)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            root = node_hash(root, sibling)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError("the proof is shorter than the tree is deep")
    return root


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """Raises ProofError unless `proof` shows `leaf` at `index` in the tree of `size` with `root`."""
    if root_from_inclusion(index, size, leaf, proof) != root:
        raise ProofError(f"the inclusion proof for leaf {index} does not lead to the root of size {size}")


def verify_consistency(old: int, new: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> None:
    """Raises ProofError unless `proof` shows the tree (new, new_root) extends (old, old_root) (RFC 9162 2.1.4.2)."""
    if new < old:
        raise ProofError(f"the later tree ({new}) is smaller than the earlier one ({old})")
    if old == 0:
        raise ProofError("a consistency proof from the empty tree is meaningless: every tree extends it")
    if old == new:
        if proof:
            raise ProofError("trees of one size need an empty consistency proof")
        if old_root != new_root:
            raise ProofError(f"two different roots for one tree size {old}")
        return
    if not proof:
        raise ProofError("an empty consistency proof between two different sizes")
    for value in proof:
        _check_hash("a proof hash", value)
    _check_hash("the earlier root", old_root)
    path = list(proof)
    if old & (old - 1) == 0:  # a perfect earlier tree is its own first node
        path.insert(0, old_root)
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    first = second = path[0]
    for value in path[1:]:
        if sn == 0:
            raise ProofError("the consistency proof is longer than the trees need")
        if fn & 1 or fn == sn:
            first, second = node_hash(value, first), node_hash(value, second)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            second = node_hash(second, value)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError("the consistency proof is shorter than the trees need")
    if first != old_root:
        raise ProofError(f"the consistency proof does not lead to the earlier root (size {old})")
    if second != new_root:
        raise ProofError(f"the consistency proof does not lead to the later root (size {new})")
