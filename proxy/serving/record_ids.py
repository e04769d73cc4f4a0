"""Record ids: 128 random bits each, as `rec_` and 32 hex digits, unguessable and never reused.

The bits come from the operating system's generator, drawn for many ids at a time: one `getrandom` system call per
id was a measurable share of a request's time on the event loop, and a pool of bits is as random as the calls it
replaces. An instance belongs to the process that made it (each serving process builds its own, after any fork).
This module knows nothing of records themselves.
"""

from __future__ import annotations

import os

ID_BYTES = 16  # uuid4 would add only its version bits, and costs several times as much
POOL_IDS = 256


class RecordIds:
    """Calling it gives the next new record id."""

    def __init__(self, randomness: int = POOL_IDS * ID_BYTES) -> None:
        if randomness < ID_BYTES or randomness % ID_BYTES:
            raise ValueError(f"randomness must be a positive multiple of {ID_BYTES} bytes, got {randomness}")
        self._draw = randomness
        self._pool = b""
        self._next = 0

    def __call__(self) -> str:
        start = self._next
        if start >= len(self._pool):
            self._pool, start = os.urandom(self._draw), 0
        self._next = start + ID_BYTES
        return "rec_" + self._pool[start : start + ID_BYTES].hex()
