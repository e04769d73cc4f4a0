"""`stackpin prove`'s check, against a checkpoint the client kept: proven, not proven (a rewritten log), or an error
(inputs that do not belong together)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.audit import AuditStore
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
