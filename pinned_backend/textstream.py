"""Releasing a completion's text piece by piece while honouring stop strings.

The engine decodes a request's completion tokens after every step and hands the whole text here. What comes
back is the part that is now safe to send: text that can no longer turn out to be the start of a stop
string, and no trailing half of a multi-byte character (decoders show it as U+FFFD until its last byte
arrives). Once a stop string appears, the text is cut just before it and the stream is over.

This module knows nothing of tokens or models: it sees only strings.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"


class StopTextStream:
    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.sent = ""  # everything released so far
        self.stopped = False
        self._latest = ""

    def update(self, text: str) -> str:
        """Take the completion's full text so far; return the newly releasable part."""
        if self.stopped:
            return ""
        self._latest = text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut])
        safe = text.rstrip(_INCOMPLETE)
        return self._release(safe[: len(safe) - self._held_back(safe)])

    def finish(self) -> str:
        """The request ended for another reason than a stop string: release whatever was held back."""
        if self.stopped:
            return ""
        self.stopped = True
        return self._release(self._latest)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, text: str) -> str:
        # A decoder may revise earlier text (a merged character, a cleaned-up space); what was sent stays.
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta
