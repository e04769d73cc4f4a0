"""Receipts: the log's signed promise to integrate an entry, handed to the client with its answer.

A receipt is to an entry what a Certificate Transparency SCT is to a certificate, or a Rekor signed entry timestamp
to an entry: signed by the log's own Ed25519 key when the entry is appended, before it is in the tree, it names the
entry (record id, part, leaf hash), the stack that served it, its time, and when the log promises to have it in a
signed checkpoint. A client that keeps it can later hold the log to it without trusting whoever runs it: the
receipt's signature with the log's verifier key, then the entry with that leaf hash in a checkpoint's tree
(`stackpin prove --receipt`). A receipt the log signed for a leaf it does not hold is the log's own proof of a
broken promise (`stackpin verify --receipt`).

Its form is a compact signature over a canonical body, not a signed note: a note is lines of text, and a receipt
travels in one HTTP header (`Stackpin-Receipt`), so a note would need a second encoding there; the body is
RFC 8785 canonical JSON, as an entry's bytes are. It is

    base64url(JCS(body)) "." base64url(key ID || Ed25519 signature)

(no padding), where the key ID is the signed-note key ID of the log's key (note.py), and the signature is over
`stackpin-receipt/v1\\n` followed by JCS(body). That first line keeps a receipt's signature from ever verifying as a
checkpoint's (whose text starts with the origin and then a tree size on its own line) or a cosignature's, though
the same key signs them. Pure functions and small values; the store signs (store.py) and verification reads.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from proxy.audit.header import format_timestamp
from proxy.audit.note import LOG_SIGNATURE, Signer, Verifier
from proxy.audit.sealed import SealedEntry
from proxy.canonical import canonical_json

CONTEXT = b"stackpin-receipt/v1\n"
VERSION = 1
# The longest the log promises to take from an entry's time to a signed checkpoint that holds it. It integrates
# every `log.checkpoint_interval_s` (at most a second); the rest is room for a restart or a database failover.
MERGE_DELAY = timedelta(seconds=60)
BODY_KEYS = {"v", "log", "record_id", "part", "leaf_hash", "fingerprint", "time", "integrate_by"}
MAX_TEXT = 4096


class ReceiptError(ValueError):
    """A receipt that cannot be read, or whose signature does not verify; the message says which."""


@dataclass(frozen=True)
class Receipt:
    """A receipt as read back: its body, and the key ID and signature over it."""

    log: str  # the log's origin: the name of the key that signs it
    record_id: str
    part: str
    leaf_hash: bytes
    fingerprint: str | None
    time: str  # the entry's created_at, as its bytes write it
    integrate_by: str  # the promise: in a signed checkpoint by then
    key_id: int
    signature: bytes
    encoded: bytes  # the signed body, as it was signed
    text: str  # the receipt as it was handed out

    @property
    def leaf_b64(self) -> str:
        return base64.b64encode(self.leaf_hash).decode()

    def body(self) -> dict[str, Any]:
        decoded: dict[str, Any] = json.loads(self.encoded)
        return decoded


def _body(
    log: str, record_id: str, part: str, leaf: bytes, fingerprint: str | None, time: str, by: str
) -> dict[str, Any]:
    return {
        "v": VERSION,
        "log": log,
        "record_id": record_id,
        "part": part,
        "leaf_hash": base64.b64encode(leaf).decode(),
        "fingerprint": fingerprint,
        "time": time,
        "integrate_by": by,
    }


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64url(text: str, what: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ReceiptError(f"the receipt's {what} is not base64url") from exc


class ReceiptSigner:
    """Signs receipts with the log's key, loaded once: on the request path, every answer takes one signature."""

    def __init__(self, signer: Signer) -> None:
        if signer.kind != LOG_SIGNATURE:
            raise ReceiptError(f"{signer.name} is a cosigner key; receipts are signed with the log's key")
        self.log = signer.name
        self._key = Ed25519PrivateKey.from_private_bytes(signer.seed)
        self._key_id = struct.pack(">I", signer.verifier.key_id)

    def issue(self, entry: SealedEntry) -> str:
        """The receipt for `entry`, as the text handed to the client."""
        moment = entry.created_at
        body = _body(self.log, entry.record_id, entry.part, entry.leaf_hash, entry.fingerprint,
                     format_timestamp(moment), _promised(moment))  # fmt: skip
        encoded = canonical_json(body)
        signature = self._key.sign(CONTEXT + encoded)
        return _b64url(encoded) + "." + _b64url(self._key_id + signature)


def _promised(moment: datetime) -> str:
    return format_timestamp(moment + MERGE_DELAY)


def parse_receipt(text: str) -> Receipt:
    """The receipt in `text` (its signature not yet checked); ReceiptError when it is not one."""
    text = text.strip()
    if len(text) > MAX_TEXT or text.count(".") != 1:
        raise ReceiptError("a receipt is BODY.SIGNATURE, two base64url parts (the Stackpin-Receipt header)")
    body_text, signed = text.split(".")
    encoded, signature = _unb64url(body_text, "body"), _unb64url(signed, "signature")
    if len(signature) != 4 + 64:
        raise ReceiptError("a receipt's signature is a 4-byte key ID and a 64-byte Ed25519 signature")
    try:
        body = json.loads(encoded)
    except ValueError as exc:
        raise ReceiptError("the receipt's body is not JSON") from exc
    if not isinstance(body, dict) or set(body) != BODY_KEYS or body["v"] != VERSION:
        raise ReceiptError(f"the receipt's body holds {sorted(BODY_KEYS)}, version {VERSION}")
    try:
        leaf = base64.b64decode(body["leaf_hash"], validate=True)
        fields = [body[k] for k in ("log", "record_id", "part", "time", "integrate_by")]
    except (binascii.Error, TypeError, ValueError) as exc:
        raise ReceiptError("the receipt's leaf hash is not base64") from exc
    fingerprint = body["fingerprint"]
    if (
        len(leaf) != 32
        or not all(isinstance(f, str) for f in fields)
        or not isinstance(fingerprint, str | None)
    ):
        raise ReceiptError("the receipt's body has a field of the wrong type")
    if canonical_json(body) != encoded:
        raise ReceiptError("the receipt's body is not canonical JSON (RFC 8785)")
    log, record_id, part, time, by = fields
    return Receipt(log, record_id, part, leaf, fingerprint, time, by,
                   struct.unpack(">I", signature[:4])[0], signature[4:], encoded, text)  # fmt: skip


def signed_by(receipt: Receipt, verifiers: list[Verifier]) -> Verifier:
    """The trusted log key that signed `receipt`; ReceiptError when none of `verifiers` did."""
    message = CONTEXT + receipt.encoded
    for verifier in verifiers:
        if verifier.kind != LOG_SIGNATURE or (verifier.name, verifier.key_id) != (
            receipt.log,
            receipt.key_id,
        ):
            continue
        if verifier.check(message, receipt.signature):
            return verifier
        raise ReceiptError(
            f"the receipt's signature does not verify with {verifier.name} ({verifier.key_id:08x})"
        )
    names = ", ".join(f"{v.name} ({v.key_id:08x})" for v in verifiers if v.kind == LOG_SIGNATURE)
    raise ReceiptError(
        f"the receipt is signed by {receipt.log} ({receipt.key_id:08x}), which is none of the trusted log keys "
        f"({names or 'none given: --log-key'})"
    )


def read_receipts(text: str, source: str) -> list[Receipt]:
    """Every receipt in a file's text, one per line (blank lines skipped); ReceiptError naming the line."""
    receipts = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                receipts.append(parse_receipt(line))
            except ReceiptError as exc:
                raise ReceiptError(f"{source}, line {number}: {exc}") from exc
    return receipts


def mismatch(
    receipt_text: str, record_id: str, part: str, leaf: bytes, verifiers: list[Verifier]
) -> str | None:
    """What is wrong with the receipt a stored entry keeps, which must be the log's, for that entry's own leaf
    (signature checked when `verifiers` are given); None when nothing is."""
    try:
        receipt = parse_receipt(receipt_text)
        if verifiers:
            signed_by(receipt, verifiers)
    except ReceiptError as exc:
        return str(exc)
    if (receipt.record_id, receipt.part, receipt.leaf_hash) != (record_id, part, leaf):
        return (
            f"it promises leaf {receipt.leaf_b64} of record {receipt.record_id} ({receipt.part}), not this entry "
            f"(the entry was replaced after the log signed its receipt)"
        )
    return None
