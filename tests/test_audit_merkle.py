"""The Merkle tree's pure functions: RFC 6962 hashing, proofs checked against transparency-dev/merkle's test
vectors (tests/data/merkle, with their negative cases), and proofs made here checked against those verifiers."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.audit.merkle import (
    EMPTY_ROOT,
    ProofError,
    consistency_ranges,
    grow,
    inclusion_ranges,
    leaf_hash,
    node_hash,
    nodes_for,
    peaks,
    range_hash,
    verify_consistency,
    verify_inclusion,
)

VECTORS = Path(__file__).parent / "data" / "merkle"


def _vectors(kind: str) -> list[Any]:
    files = sorted((VECTORS / kind).rglob("*.json"))
    return [pytest.param(json.loads(f.read_text()), id=str(f.relative_to(VECTORS))) for f in files]


def _b64(value: str | None) -> bytes:
    return base64.b64decode(value or "")


def _proof(values: list[str] | None) -> list[bytes]:
    return [_b64(v) for v in values or []]


@pytest.mark.parametrize("probe", _vectors("inclusion"))
def test_inclusion_vectors(probe: dict[str, Any]) -> None:
    def check() -> None:
        verify_inclusion(
            probe["leafIdx"],
            probe["treeSize"],
            _b64(probe["leafHash"]),
            _proof(probe["proof"]),
            _b64(probe["root"]),
        )

    if probe["wantErr"]:
        with pytest.raises(ProofError):
            check()
    else:
        check()


@pytest.mark.parametrize("probe", _vectors("consistency"))
def test_consistency_vectors(probe: dict[str, Any]) -> None:
    def check() -> None:
        verify_consistency(
            probe["size1"], probe["size2"], _b64(probe["root1"]), _b64(probe["root2"]), _proof(probe["proof"])
        )

    if probe["wantErr"]:
        with pytest.raises(ProofError):
            check()
    else:
        check()


def test_the_vectors_include_negative_cases_of_both_kinds() -> None:
    for kind in ("inclusion", "consistency"):
        probes = [p.values[0] for p in _vectors(kind)]
        assert len(probes) > 80
        assert sum(p["wantErr"] for p in probes) > len(probes) / 2, f"{kind}: the mutated cases are there"


def test_hashing_is_rfc_6962() -> None:
    assert leaf_hash(b"") == bytes.fromhex("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d")
    assert hashlib.sha256(b"").digest() == EMPTY_ROOT
    assert node_hash(b"a" * 32, b"b" * 32) == hashlib.sha256(b"\x01" + b"a" * 32 + b"b" * 32).digest()


def mth(leaves: list[bytes]) -> bytes:
    """MTH of RFC 6962, straight from its recursive definition."""
    if not leaves:
        return EMPTY_ROOT
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return node_hash(mth(leaves[:k]), mth(leaves[k:]))


def stored_tree(size: int) -> tuple[list[bytes], dict[tuple[int, int], bytes]]:
    """Leaves, and every perfect node of the tree grown from them a few leaves at a time."""
    leaves = [leaf_hash(f"entry {i}".encode()) for i in range(size)]
    nodes: dict[tuple[int, int], bytes] = {}
    current: list[tuple[tuple[int, int], bytes]] = []
    done = 0
    for step in (1, 3, 2, 7, 5) * 40:
        if done >= size:
            break
        growth = grow(done, current, leaves[done : done + step])
        nodes.update(growth.nodes)
        current, done = growth.peaks, min(size, done + step)
    return leaves, nodes


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 70), st.data())
def test_proofs_made_from_stored_nodes_verify(size: int, data: st.DataObject) -> None:
    leaves, nodes = stored_tree(size)
    root = range_hash((0, size), nodes)
    assert root == mth(leaves)
    index = data.draw(st.integers(0, size - 1), label="index")
    path = [range_hash(r, nodes) for r in inclusion_ranges(index, size)]
    verify_inclusion(index, size, leaves[index], path, root)
    old = data.draw(st.integers(1, size), label="old")
    proof = [range_hash(r, nodes) for r in consistency_ranges(old, size)]
    verify_consistency(old, size, mth(leaves[:old]), root, proof)
    with pytest.raises(ProofError):
        verify_inclusion(index, size, leaf_hash(b"forged"), path, root)
    if old < size:
        with pytest.raises(ProofError):
            verify_consistency(
                old, size, mth(leaves[:old]), mth([*leaves[: size - 1], leaf_hash(b"x")]), proof
            )


@given(st.integers(1, 5000), st.integers(0, 5000))
def test_a_proof_reads_at_most_two_nodes_per_level(size: int, index: int) -> None:
    index %= size
    depth = max(1, (size - 1).bit_length())
    assert len(nodes_for(inclusion_ranges(index, size))) <= 2 * depth
    assert len(nodes_for(consistency_ranges(index + 1, size))) <= 2 * depth
    assert len(peaks(0, size)) == bin(size).count("1")


def test_growth_refuses_peaks_of_another_size() -> None:
    _, nodes = stored_tree(5)
    with pytest.raises(ProofError, match="not those of a tree of size 6"):
        grow(6, [((2, 0), nodes[(2, 0)]), ((0, 4), nodes[(0, 4)])], [leaf_hash(b"x")])


def test_requests_for_impossible_proofs_say_why() -> None:
    with pytest.raises(ProofError, match="not in a tree of size 3"):
        inclusion_ranges(3, 3)
    with pytest.raises(ProofError, match="0 < from <= to"):
        consistency_ranges(0, 3)
    assert consistency_ranges(3, 3) == []
