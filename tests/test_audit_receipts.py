"""Receipts (proxy/audit/receipts.py): the log's signed promise to integrate an entry, as a client keeps it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from proxy.audit.note import Checkpoint, generate_signer, open_checkpoint, sign_note
from proxy.audit.receipts import (
    CONTEXT,
    ReceiptError,
    ReceiptSigner,
    mismatch,
    parse_receipt,
    read_receipts,
    signed_by,
)
from tests.support.audit_databases import KINDS, LOG_SIGNER, audit_database, entry

TRUSTED = [LOG_SIGNER.verifier]


def test_a_receipt_names_its_entry_and_verifies_with_the_logs_key() -> None:
    sealed = entry("rec_1")
    text = ReceiptSigner(LOG_SIGNER).issue(sealed)
    assert text.isascii() and " " not in text and "\n" not in text, "it travels as one HTTP header value"
    receipt = parse_receipt(text)
    assert signed_by(receipt, TRUSTED) == LOG_SIGNER.verifier
    assert (receipt.log, receipt.record_id, receipt.part) == ("stackpin.test/log", "rec_1", "answer")
    assert (receipt.leaf_hash, receipt.fingerprint) == (sealed.leaf_hash, sealed.fingerprint)
    assert receipt.time == "2026-01-02T03:04:05.678901Z" == sealed.header()["created_at"]
    assert receipt.integrate_by == "2026-01-02T03:05:05.678901Z", (
        "the promise: in a checkpoint within a minute"
    )
    assert ReceiptSigner(LOG_SIGNER).issue(sealed) == text, "Ed25519 is deterministic: one receipt per entry"


def test_a_receipt_edited_or_signed_by_another_key_does_not_verify() -> None:
    receipt = parse_receipt(ReceiptSigner(LOG_SIGNER).issue(entry("rec_1")))
    signature = receipt.text.split(".")[1]
    edited = json.loads(receipt.encoded) | {"record_id": "rec_2"}
    encoded = json.dumps(edited, separators=(",", ":"), sort_keys=True).encode()
    forged = parse_receipt(base64.urlsafe_b64encode(encoded).rstrip(b"=").decode() + "." + signature)
    with pytest.raises(ReceiptError, match=r"does not verify with stackpin\.test/log"):
        signed_by(forged, TRUSTED)
    impostor = generate_signer("stackpin.test/log")  # the log's name, another key
    with pytest.raises(ReceiptError, match="none of the trusted log keys"):
        signed_by(parse_receipt(ReceiptSigner(impostor).issue(entry("rec_1"))), TRUSTED)
    with pytest.raises(ReceiptError, match="none given: --log-key"):
        signed_by(receipt, [])


def test_a_receipts_signature_is_never_a_checkpoints_nor_the_other_way_round() -> None:
    """One key signs both: what it signs for one must not be taken for the other."""
    receipt = parse_receipt(ReceiptSigner(LOG_SIGNER).issue(entry("rec_1")))
    assert LOG_SIGNER.verifier.check(CONTEXT + receipt.encoded, receipt.signature)
    assert not LOG_SIGNER.verifier.check(receipt.encoded, receipt.signature)
    note = sign_note(Checkpoint("stackpin.test/log", 3, bytes(32)).text, LOG_SIGNER)
    open_checkpoint(note.render(), TRUSTED)
    as_receipt = base64.urlsafe_b64encode(note.text.encode()).decode().rstrip("=")
    key_and_signature = base64.urlsafe_b64encode(bytes(4) + note.signatures[0].signature).decode()
    with pytest.raises(ReceiptError, match="not JSON"):
        parse_receipt(as_receipt + "." + key_and_signature.rstrip("="))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "BODY.SIGNATURE"),
        ("a.b.c", "BODY.SIGNATURE"),
        ("e30.AAAA", "4-byte key ID and a 64-byte"),
        ("e30." + "A" * 91, "holds"),  # {} with a signature of the right length
    ],
)
def test_what_is_not_a_receipt_says_what_a_receipt_is(text: str, says: str) -> None:
    with pytest.raises(ReceiptError, match=says):
        parse_receipt(text)


def test_a_body_that_is_not_canonical_is_refused() -> None:
    receipt = parse_receipt(ReceiptSigner(LOG_SIGNER).issue(entry("rec_1")))
    spaced = json.dumps(json.loads(receipt.encoded), sort_keys=True).encode()  # ", " and ": "
    signature = receipt.text.split(".")[1]
    with pytest.raises(ReceiptError, match="not canonical"):
        parse_receipt(base64.urlsafe_b64encode(spaced).decode().rstrip("=") + "." + signature)


def test_a_file_holds_receipts_one_a_line_and_a_bad_one_is_named_by_its_line(tmp_path: Path) -> None:
    signer = ReceiptSigner(LOG_SIGNER)
    lines = [signer.issue(entry("rec_1")), "", signer.issue(entry("rec_2"))]
    assert [r.record_id for r in read_receipts("\n".join(lines) + "\n", "kept")] == ["rec_1", "rec_2"]
    with pytest.raises(ReceiptError, match="kept, line 2: "):
        read_receipts(lines[0] + "\nnot a receipt\n", "kept")


def test_a_kept_receipt_must_be_the_logs_for_the_very_entry_that_keeps_it() -> None:
    sealed, other = entry("rec_1"), entry("rec_1", content={"said": "something else"})
    text = ReceiptSigner(LOG_SIGNER).issue(sealed)
    assert mismatch(text, "rec_1", "answer", sealed.leaf_hash, TRUSTED) is None
    assert "not this entry" in (mismatch(text, "rec_1", "answer", other.leaf_hash, TRUSTED) or "")
    forged = ReceiptSigner(generate_signer("stackpin.test/log")).issue(other)
    assert "none of the trusted" in (mismatch(forged, "rec_1", "answer", other.leaf_hash, TRUSTED) or "")


@pytest.mark.parametrize("kind", KINDS)
async def test_the_store_signs_a_receipt_for_every_entry_it_appends_and_keeps_it(
    kind: str, tmp_path: Path
) -> None:
    async with audit_database(kind, tmp_path) as database:
        await database.migrate()
        store = await database.open(checkpoint_interval_s=3600)
        keyless = await database.open(signer=None)
        try:
            stored = await store.append(entry("rec_1"))
            assert stored.receipt is not None
            receipt = parse_receipt(stored.receipt)
            signed_by(receipt, TRUSTED)
            assert receipt.leaf_hash.hex() == stored.leaf_hash
            record = await store.get_record("rec_1", None)
            assert record is not None and record.entries[0].receipt == stored.receipt
            assert (await keyless.append(entry("rec_2"))).receipt is None, "no key, no promise"
        finally:
            await keyless.close()
            await store.close()
