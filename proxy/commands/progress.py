"""Progress of a long command on stderr: a bar that redraws itself on a terminal (tqdm), plain lines otherwise
(a CI log, a file), so that stdout keeps only the command's result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Protocol

from tqdm import tqdm

LINE_INTERVAL_S = 10.0


class Progress(Protocol):
    def advance(self, note: str) -> None: ...

    def close(self) -> None: ...


def progress_on(stream: IO[str], total: int, what: str) -> Progress:
    """A bar when `stream` is a terminal, else plain lines."""
    if stream.isatty():
        return Bar(stream, total, what)
    return Lines(stream, total, what)


class Bar:
    def __init__(self, stream: IO[str], total: int, what: str) -> None:
        self._bar = tqdm(total=total, desc=what, unit="req", file=stream, dynamic_ncols=True, leave=True)

    def advance(self, note: str) -> None:
        self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


class Lines:
    """`what: 120/400 (30%) at c8+b4, side a; 4.1 req/s, about 68 s left`, at most every `interval_s`, and at
    the end."""

    def __init__(
        self,
        stream: IO[str],
        total: int,
        what: str,
        *,
        interval_s: float = LINE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream, self._total, self._what = stream, total, what
        self._interval_s, self._clock = interval_s, clock
        self._started = self._last = clock()
        self._done = 0
        self._note = ""

    def advance(self, note: str) -> None:
        self._done += 1
        self._note = note
        now = self._clock()
        if now - self._last >= self._interval_s or self._done == self._total:
            self._last = now
            self._write(now)

    def close(self) -> None:
        if self._done < self._total:
            self._write(self._clock())

    def _write(self, now: float) -> None:
        elapsed = max(now - self._started, 1e-9)
        rate = self._done / elapsed
        share = self._done / self._total if self._total else 1.0
        line = f"{self._what}: {self._done}/{self._total} ({share:.0%})"
        if self._note:
            line += f" at {self._note}"
        line += f"; {rate:.1f} req/s"
        # The time left only after a few: the first answers say little of the rest.
        if min(10, max(1, self._total // 2)) <= self._done < self._total:
            line += f", about {(self._total - self._done) / rate:.0f} s left"
        self._stream.write(line + "\n")
        self._stream.flush()
