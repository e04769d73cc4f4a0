"""`stackpin witness`: follows a log's checkpoints, accepts only those consistent with the last it holds, keeps
them in a store of its own and cosigns each (C2SP tlog-cosignature, Ed25519, type 0x04).

What makes a rewrite by the database's owner visible: once a witness holds a checkpoint, a log whose history no
longer extends it (a cut tail, a rewritten one) is refused here, and `stackpin verify --witness FILE` finds it
in the database. The decision is `decide`, a pure function; the log is reached through a `LogSource` (the
proxy's HTTP routes, or in tests the store itself); the store is a file of JSON lines, one per accepted
checkpoint, appended and synced.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import aiohttp
import structlog

from proxy.audit.merkle import ProofError, verify_consistency
from proxy.audit.note import (
    Checkpoint,
    NoteError,
    Signer,
    Verifier,
    cosign,
    open_checkpoint,
    parse_checkpoint,
    parse_note,
)
from proxy.audit.verify import Witnessed

log = structlog.get_logger("stackpin.witness")


class LogSource(Protocol):
    async def checkpoint(self) -> str:
        """The log's latest signed checkpoint note."""
        ...

    async def consistency(self, old: int, new: int) -> list[bytes]: ...


class WitnessError(Exception):
    """The log cannot be reached or answers something that is not a checkpoint or a proof."""


@dataclass(frozen=True)
class Outcome:
    """What one look at the log gave: a checkpoint `accepted` (and cosigned), `unchanged`, or `refused` (why)."""

    verdict: str
    checkpoint: Checkpoint
    reason: str | None = None


def decide(held: Checkpoint | None, new: Checkpoint, proof: list[bytes] | None) -> str | None:
    """None when `new` may follow `held` (with `proof`, the consistency proof between them); else why not."""
    if held is None:
        return None  # the first one is taken on trust
    if new.origin != held.origin:
        return f"the checkpoint is of log {new.origin!r}, this witness follows {held.origin!r}"
    if held.size == 0 and new.size > 0:
        return None  # every tree extends the empty one
    if new.size < held.size:
        return f"the log went back from size {held.size} to {new.size} (its tail was cut)"
    if new.size == held.size:
        return (
            None if new.root == held.root else f"two different roots for tree size {new.size} (a forked log)"
        )
    try:
        verify_consistency(held.size, new.size, held.root, new.root, proof or [])
    except ProofError as e:
        return f"the tree of size {new.size} does not extend the one of size {held.size}: {e}"
    return None


class WitnessStore:
    """The checkpoints this witness accepted, each cosigned, one JSON object per line, oldest first."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def notes(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.path.open(encoding="utf-8") as source:
            return [json.loads(line)["note"] for line in source if line.strip()]

    def latest(self) -> Checkpoint | None:
        notes = self.notes()
        return parse_checkpoint(parse_note(notes[-1]).text) if notes else None

    def append(self, note: str, checkpoint: Checkpoint, at: datetime) -> None:
        line = {
            "origin": checkpoint.origin,
            "tree_size": checkpoint.size,
            "root_hash": base64.b64encode(checkpoint.root).decode(),
            "witnessed_at": at.isoformat(),
            "note": note,
        }
        with self.path.open("a", encoding="utf-8") as sink:
            sink.write(json.dumps(line, sort_keys=True) + "\n")
            sink.flush()
            os.fsync(sink.fileno())

    def witnessed(self, cosigners: list[Verifier]) -> list[Witnessed]:
        """What `verify` holds the log to: every checkpoint here, checked against the witness's keys."""
        return [Witnessed(f"witness {self.path}", note, cosigners) for note in self.notes()]


async def observe(
    source: LogSource,
    store: WitnessStore,
    log_keys: list[Verifier],
    signer: Signer,
    clock: Callable[[], datetime],
) -> Outcome:
    """One look at the log: fetch its checkpoint, check it against the last one held, cosign and keep it."""
    try:
        checkpoint, note = open_checkpoint(await source.checkpoint(), log_keys)
    except NoteError as e:
        raise WitnessError(f"the log's checkpoint does not verify: {e}") from e
    held = store.latest()
    if held is not None and (checkpoint.size, checkpoint.root) == (held.size, held.root):
        return Outcome("unchanged", checkpoint)
    proof = None
    if held is not None and 0 < held.size < checkpoint.size and held.origin == checkpoint.origin:
        proof = await source.consistency(held.size, checkpoint.size)
    reason = decide(held, checkpoint, proof)
    if reason is not None:
        return Outcome("refused", checkpoint, reason)
    now = clock()
    store.append(cosign(note, signer, int(now.timestamp())).render(), checkpoint, now)
    return Outcome("accepted", checkpoint)


class HttpLogSource:
    """A proxy's log routes: GET /v1/log/checkpoint and /v1/log/consistency."""

    def __init__(self, session: aiohttp.ClientSession, url: str, api_key: str | None) -> None:
        self._session = session
        self._url = url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _get(self, path: str) -> tuple[int, str]:
        try:
            async with self._session.get(self._url + path, headers=self._headers) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WitnessError(f"the log at {self._url} cannot be reached: {type(e).__name__}") from e

    async def checkpoint(self) -> str:
        status, body = await self._get("/v1/log/checkpoint")
        if status != 200:
            raise WitnessError(f"the log answered {status} for its checkpoint: {body[:200]}")
        return body

    async def consistency(self, old: int, new: int) -> list[bytes]:
        status, body = await self._get(f"/v1/log/consistency?from={old}&to={new}")
        if status != 200:
            raise WitnessError(f"the log answered {status} for a consistency proof: {body[:200]}")
        try:
            return [base64.b64decode(h, validate=True) for h in json.loads(body)["proof"]]
        except (ValueError, KeyError, TypeError) as e:
            raise WitnessError("the log's consistency proof is not a list of base64 hashes") from e


async def follow(
    source: LogSource,
    store: WitnessStore,
    log_keys: list[Verifier],
    signer: Signer,
    *,
    interval_s: float,
    once: bool,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> int:
    """Looks at the log every `interval_s`; prints one line per accepted or refused checkpoint. With `once`, one
    look: exit status 0 when the checkpoint is accepted or unchanged, 1 when refused, 2 when the log failed."""
    while True:
        try:
            outcome = await observe(source, store, log_keys, signer, clock)
        except WitnessError as e:
            print(f"stackpin witness: {e}", flush=True)
            if once:
                return 2
        else:
            size = outcome.checkpoint.size
            if outcome.verdict == "refused":
                print(f"REFUSED checkpoint of size {size}: {outcome.reason}", flush=True)
                log.error("witness_refused", tree_size=size, reason=outcome.reason)
            elif outcome.verdict == "accepted":
                print(f"cosigned checkpoint of size {size}", flush=True)
            if once:
                return 1 if outcome.verdict == "refused" else 0
        await asyncio.sleep(interval_s)
