"""`stackpin prove RECORD`: shows that a record's entries are in the log, checked here against a checkpoint; with
`--receipt`, that the log keeps the promise its receipt made for an answer.

The proof comes from the proxy (`GET /v1/records/{id}/proof`, as the client's own tenant) or from a file saved
earlier (`--proof`, no network at all); the checkpoint from a file the client kept (`--checkpoint`), else the
one the proof names. Everything is checked locally by `check_proof`, a pure function: the checkpoint's
signature with the log's key, that the proof's tree has the checkpoint's root (another root at that size: a
rewritten log, so not proven), each entry's bytes against its leaf hash, each inclusion proof against the
checkpoint's root. A receipt (`--receipt`, what the answer's `Stackpin-Receipt` header held) is checked with the
log's key first (`--offline`: only that), then its entry must be among the proven ones: the leaf it names, in the
checkpoint's tree. Nothing here trusts the proxy.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.audit.entries import payload_sha256
from proxy.audit.merkle import ProofError, leaf_hash, verify_inclusion
from proxy.audit.note import Checkpoint, NoteError, Verifier, open_checkpoint, parse_checkpoint, parse_note
from proxy.audit.receipts import Receipt, ReceiptError, parse_receipt, signed_by

EXIT_OK, EXIT_NOT_PROVEN, EXIT_ERROR = 0, 1, 2


class ProveError(Exception):
    """The proof or checkpoint cannot be had or read; the message says which."""


class NoSuchRecord(ProveError):
    """The proxy holds no such record of this client's (404)."""


@dataclass(frozen=True)
class Verdict:
    seq: int
    part: str
    index: int | None
    proven: bool
    why: str


def read_checkpoint(note: str, log_keys: list[Verifier]) -> Checkpoint:
    """The checkpoint in `note`, its signature checked when keys are given."""
    try:
        if log_keys:
            return open_checkpoint(note, log_keys)[0]
        return parse_checkpoint(parse_note(note).text)
    except NoteError as e:
        raise ProveError(f"the checkpoint does not verify: {e}") from e


def _entry_verdict(record_id: str, entry: dict[str, Any], checkpoint: Checkpoint) -> Verdict:
    seq, part, index = entry["seq"], entry["part"], entry["index"]

    def verdict(proven: bool, why: str) -> Verdict:
        return Verdict(seq, part, index, proven, why)

    data = entry["entry"].encode("utf-8")
    fields = json.loads(data)
    if "prev" in fields:  # a chained entry's envelope holds its fields under "entry"
        fields = fields["entry"]
    if fields.get("record_id") != record_id:
        return verdict(False, "the entry's bytes name another record")
    leaf = base64.b64decode(entry["leaf_hash"], validate=True)
    if leaf != leaf_hash(data):
        return verdict(False, "the entry's bytes do not hash to its leaf hash")
    if index is None or entry["proof"] is None:
        return verdict(False, f"not in the tree of size {checkpoint.size} (integrated later, or not yet)")
    try:
        proof = [base64.b64decode(h, validate=True) for h in entry["proof"]]
        verify_inclusion(index, checkpoint.size, leaf, proof, checkpoint.root)
    except ProofError as e:
        return verdict(False, str(e))
    where = f"leaf {index} of the tree of size {checkpoint.size}"
    committed = fields.get("payload_sha256")
    if committed is None:
        return verdict(True, where)
    if entry.get("payload") is None:
        return verdict(True, f"{where}; its payload (request and answer) was erased")
    if payload_sha256(bytes.fromhex(entry["salt"]), entry["payload"]) != committed:
        return verdict(False, f"{where}, but the payload given does not hash to what the entry commits to")
    return verdict(True, f"{where}, with the payload it commits to")


def check_proof(record_id: str, proof: dict[str, Any], checkpoint: Checkpoint) -> list[Verdict]:
    """One verdict per entry of the proof, against `checkpoint`; ProveError when the proof is unreadable."""
    try:
        if proof["record"] != record_id:
            raise ProveError(f"the proof is of record {proof['record']!r}, not {record_id!r}")
        claimed = proof["checkpoint"]
        if claimed["tree_size"] != checkpoint.size:
            raise ProveError(
                f"the proof is for the tree of size {claimed['tree_size']}, the checkpoint is of size "
                f"{checkpoint.size}: get the proof for that size (without --proof, prove asks the proxy for it)"
            )
        if base64.b64decode(claimed["root_hash"], validate=True) != checkpoint.root:
            # Not a mix-up of files: the log's tree of that size is not the one the checkpoint signed.
            why = (
                f"the roots differ: the log's tree of size {checkpoint.size} has root {claimed['root_hash']}, the "
                f"checkpoint signed root {base64.b64encode(checkpoint.root).decode()}; the log was rewritten since "
                "that checkpoint, or is another log"
            )
            return [Verdict(e["seq"], e["part"], e["index"], False, why) for e in proof["entries"]]
        return [_entry_verdict(record_id, entry, checkpoint) for entry in proof["entries"]]
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise ProveError(
            f"the proof is not a record proof as GET /v1/records/{{id}}/proof gives it: {e}"
        ) from e


async def fetch_proof(url: str, api_key: str | None, record_id: str, size: int | None) -> dict[str, Any]:
    query = "" if size is None else f"?size={size}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/v1/records/{record_id}/proof{query}", headers=headers) as response,
        ):
            body = await response.json(content_type=None)
            status = response.status
    except (aiohttp.ClientError, ValueError) as e:
        raise ProveError(f"cannot get the proof from the proxy at {url}: {e}") from e
    if status != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        failure = NoSuchRecord if status == 404 else ProveError
        raise failure(f"the proxy answered {status}: {message or body}")
    return dict(body)


def print_verdicts(
    proof: dict[str, Any], checkpoint: Checkpoint, verdicts: list[Verdict], signed: bool
) -> None:
    print(f"record      {proof['record']}")
    print(
        f"checkpoint  {checkpoint.origin} size {checkpoint.size} root {base64.b64encode(checkpoint.root).decode()}"
    )
    print(f"signature   {'checked' if signed else 'NOT checked: no log key given (--log-key)'}")
    for verdict, entry in zip(verdicts, proof["entries"], strict=True):
        print(f"entry       seq {verdict.seq} {verdict.part}: leaf hash {entry['leaf_hash']}")
        for i, node in enumerate(entry["proof"] or []):
            print(f"  proof[{i}]  {node}")
        print(f"  {'PROVEN' if verdict.proven else 'NOT PROVEN'}: {verdict.why}")


def read_receipt(text: str, log_keys: list[Verifier]) -> tuple[Receipt, str | None]:
    """The receipt in `text`, and why it is not the log's (None: it is, or no key was given to check it);
    ProveError when it is no receipt at all."""
    try:
        receipt = parse_receipt(text)
    except ReceiptError as e:
        raise ProveError(f"the receipt cannot be read: {e}") from e
    if not log_keys:
        return receipt, None
    try:
        signed_by(receipt, log_keys)
    except ReceiptError as e:
        return receipt, str(e)
    return receipt, None


def receipt_verdict(receipt: Receipt, proof: dict[str, Any], verdicts: list[Verdict]) -> Verdict:
    """Whether the log kept the receipt's promise: its leaf, in the record, proven in the checkpoint."""
    for entry, verdict in zip(proof["entries"], verdicts, strict=True):
        if entry["leaf_hash"] == receipt.leaf_b64:
            if verdict.proven:
                return verdict
            why = f"{verdict.why}; the log promised it by {receipt.integrate_by}"
            return Verdict(verdict.seq, verdict.part, verdict.index, False, why)
    return broken_promise(
        receipt, f"record {receipt.record_id} holds no entry with that leaf (dropped, or replaced)"
    )


def broken_promise(receipt: Receipt, why: str) -> Verdict:
    return Verdict(
        0, receipt.part, None, False, f"the log promised leaf {receipt.leaf_b64} ({receipt.time}); {why}"
    )


def print_receipt(receipt: Receipt, signed: bool) -> None:
    print(
        f"receipt     {receipt.log}: record {receipt.record_id} {receipt.part}, leaf hash {receipt.leaf_b64}"
    )
    print(f"  stack     {receipt.fingerprint}")
    print(f"  time      {receipt.time}, in the tree by {receipt.integrate_by}")
    print(
        f"  signature {'checked: the log signed it' if signed else 'NOT checked: no log key given (--log-key)'}"
    )


@dataclass(frozen=True)
class Asked:
    """What `stackpin prove` was given: a record or a receipt, and what it holds already (texts, a parsed
    proof)."""

    record: str | None
    receipt: str | None
    checkpoint: str | None
    proof: dict[str, Any] | None
    offline: bool
    as_json: bool


def run(asked: Asked, log_keys: list[Verifier], fetch: Callable[[str, int | None], dict[str, Any]]) -> int:
    """The command: the exit code, having printed the verdicts; ProveError for what cannot be checked."""
    receipt, forged = read_receipt(asked.receipt, log_keys) if asked.receipt is not None else (None, None)
    if receipt is None and asked.offline:
        raise ProveError("--offline checks a receipt: give it with --receipt FILE")
    record = asked.record or (receipt.record_id if receipt is not None else None)
    if record is None:
        raise ProveError("name the record to prove, or give its receipt with --receipt FILE")
    if receipt is not None and receipt.record_id != record:
        raise ProveError(f"the receipt is for record {receipt.record_id}, not {record}")
    if receipt is not None and (forged is not None or asked.offline):
        print_receipt(receipt, signed=bool(log_keys) and forged is None)
        print(f"  NOT VALID: {forged}" if forged else "  VALID: the log promised this entry")
        return EXIT_NOT_PROVEN if forged else EXIT_OK
    kept = read_checkpoint(asked.checkpoint, log_keys) if asked.checkpoint is not None else None
    try:
        proof = asked.proof if asked.proof is not None else fetch(record, kept.size if kept else None)
    except NoSuchRecord as e:
        if receipt is None:
            raise
        print_receipt(receipt, signed=bool(log_keys))
        print(f"  NOT PROVEN: {broken_promise(receipt, str(e)).why}")
        return EXIT_NOT_PROVEN
    checkpoint = kept or read_checkpoint(proof["checkpoint"]["note"], log_keys)
    verdicts = check_proof(record, proof, checkpoint)
    if asked.as_json:
        print(json.dumps(proof, indent=2, sort_keys=True))
    else:
        print_verdicts(proof, checkpoint, verdicts, signed=bool(log_keys))
    if receipt is None:
        return EXIT_OK if all(v.proven for v in verdicts) else EXIT_NOT_PROVEN
    promise = receipt_verdict(receipt, proof, verdicts)
    if not asked.as_json:
        print_receipt(receipt, signed=bool(log_keys))
        print(f"  {'PROVEN' if promise.proven else 'NOT PROVEN'}: {promise.why}")
    return EXIT_OK if promise.proven else EXIT_NOT_PROVEN
