"""`stackpin prove RECORD`: shows that a record's entries are in the log, checked here against a checkpoint.

The proof comes from the proxy (`GET /v1/records/{id}/proof`, as the client's own tenant) or from a file saved
earlier (`--proof`, no network at all); the checkpoint from a file the client kept (`--checkpoint`), else the
one the proof names. Everything is checked locally by `check_proof`, a pure function: the checkpoint's
signature with the log's key, that the proof's tree has the checkpoint's root (another root at that size: a
rewritten log, so not proven), each entry's bytes against its leaf hash, each inclusion proof against the
checkpoint's root. Nothing here trusts the proxy.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.audit.merkle import ProofError, leaf_hash, verify_inclusion
from proxy.audit.note import Checkpoint, NoteError, Verifier, open_checkpoint, parse_checkpoint, parse_note

EXIT_OK, EXIT_NOT_PROVEN, EXIT_ERROR = 0, 1, 2


class ProveError(Exception):
    """The proof or checkpoint cannot be had or read; the message says which."""


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
    return verdict(True, f"leaf {index} of the tree of size {checkpoint.size}")


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
        raise ProveError(f"the proxy answered {status}: {message or body}")
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
