"""`stackpin prove`'s check, against a checkpoint the client kept: proven, not proven (a rewritten log), or an error
(inputs that do not belong together)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.audit import AuditStore
from proxy.audit.note import generate_signer
from proxy.commands.cli import main as stackpin
from proxy.commands.prove import ProveError, check_proof, read_checkpoint
from tests.support.audit_databases import LOG_SIGNER, audit_database, entry


async def _log(folder: Path, contents: list[str]) -> tuple[dict[str, Any], str]:
    """A log of one entry per content: the proof of record r0 as the proxy serves it, and the latest checkpoint."""
    folder.mkdir()
    async with audit_database("sqlite", folder) as database:
        await database.migrate()
        store: AuditStore = await database.open(checkpoint_interval_s=3600)
        try:
            for i, said in enumerate(contents):
                await store.append(entry(f"r{i}", content={"said": said}))
            await store.integrate()
            proof = await store.record_proof("r0", None)
            note = (await store.checkpoint()).note
        finally:
            await store.close()
    assert proof is not None
    return proof.model_dump(mode="json"), note


async def test_a_proof_is_checked_against_the_checkpoint_kept_and_a_rewrite_is_not_proven(
    tmp_path: Path,
) -> None:
    kept_proof, kept_note = await _log(tmp_path / "kept", ["a", "b", "c"])
    rewritten_proof, _ = await _log(
        tmp_path / "rewritten", ["a", "B", "c"]
    )  # one entry changed, all rehashed
    kept = read_checkpoint(kept_note, [LOG_SIGNER.verifier])

    assert [v.proven for v in check_proof("r0", kept_proof, kept)] == [True]
    verdicts = check_proof("r0", rewritten_proof, kept)
    assert [v.proven for v in verdicts] == [False], (
        "a tree of the checkpoint's size with another root proves nothing"
    )
    assert "the roots differ" in verdicts[0].why and "size 3" in verdicts[0].why

    smaller, smaller_note = await _log(tmp_path / "smaller", ["a", "b"])
    with pytest.raises(ProveError, match="size 2, the checkpoint is of size 3"):
        check_proof("r0", smaller, kept)
    assert read_checkpoint(smaller_note, [LOG_SIGNER.verifier]).size == 2


async def test_prove_exits_1_saying_the_roots_differ_when_the_log_was_rewritten_since_the_kept_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, kept_note = await _log(tmp_path / "kept", ["a", "b", "c"])
    rewritten_proof, _ = await _log(tmp_path / "rewritten", ["a", "B", "c"])
    (tmp_path / "checkpoint").write_text(kept_note)
    (tmp_path / "proof.json").write_text(json.dumps(rewritten_proof))
    files = ["--proof", str(tmp_path / "proof.json"), "--checkpoint", str(tmp_path / "checkpoint")]
    assert stackpin(["prove", "r0", *files, "--log-key", LOG_SIGNER.verifier.vkey]) == 1
    assert "NOT PROVEN: the roots differ" in capsys.readouterr().out


async def _receipted(folder: Path, contents: list[str]) -> tuple[str, dict[str, Any]]:
    """A log of one entry per content: the receipt the log gave for r0's entry, and r0's proof once integrated."""
    folder.mkdir()
    async with audit_database("sqlite", folder) as database:
        await database.migrate()
        store: AuditStore = await database.open(checkpoint_interval_s=3600)
        try:
            receipts = [
                (await store.append(entry(f"r{i}", content={"said": said}))).receipt
                for i, said in enumerate(contents)
            ]
            await store.integrate()
            proof = await store.record_proof("r0", None)
        finally:
            await store.close()
    assert proof is not None and receipts[0] is not None
    return receipts[0], proof.model_dump(mode="json")


async def test_a_receipt_is_checked_offline_with_the_logs_key_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    receipt, _ = await _receipted(tmp_path / "log", ["a"])
    (tmp_path / "receipt").write_text(receipt + "\n")
    offline = ["prove", "--receipt", str(tmp_path / "receipt"), "--offline"]
    assert stackpin([*offline, "--log-key", LOG_SIGNER.verifier.vkey]) == 0
    out = capsys.readouterr().out
    assert "record r0 answer" in out and "VALID: the log promised this entry" in out
    other = generate_signer(LOG_SIGNER.name).verifier.vkey  # the log's name, another key
    assert stackpin([*offline, "--log-key", other]) == 1
    assert "NOT VALID: the receipt is signed by stackpin.test/log" in capsys.readouterr().out
    assert stackpin(["prove", "--offline"]) == 2, "--offline checks a receipt, and none was given"


async def test_a_receipt_is_proven_by_its_entry_in_the_checkpoint_and_not_by_a_log_that_dropped_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    receipt, proof = await _receipted(tmp_path / "kept", ["a", "b"])
    _, rewritten = await _receipted(tmp_path / "rewritten", ["A", "b"])  # r0's entry is not the one promised
    (tmp_path / "receipt").write_text(receipt)
    key = ["--log-key", LOG_SIGNER.verifier.vkey]
    for name, held in (("proof.json", proof), ("rewritten.json", rewritten)):
        (tmp_path / name).write_text(json.dumps(held))
    given = ["prove", "--receipt", str(tmp_path / "receipt"), *key]
    assert stackpin([*given, "--proof", str(tmp_path / "proof.json")]) == 0
    assert "PROVEN: leaf 0 of the tree of size 2" in capsys.readouterr().out
    assert stackpin([*given, "--proof", str(tmp_path / "rewritten.json")]) == 1
    assert "NOT PROVEN: the log promised leaf" in capsys.readouterr().out
    assert stackpin([*given, "r1", "--proof", str(tmp_path / "proof.json")]) == 2, "the receipt is r0's"
