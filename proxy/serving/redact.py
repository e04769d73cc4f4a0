"""Redaction: every configured secret taken out of what the proxy relays from a replica to a client.

An upstream may quote the key it was sent in an error body (some do), and the proxy relays replicas' error
bodies and streamed events. Whatever the proxy relays passes through a `Redactor` built from the configured
upstream keys, which replaces each key, and its JSON-escaped spellings, by `[redacted]`. Client keys need none:
the proxy sends them nowhere and keeps only their hashes. Pure; knows nothing of HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

REDACTED = "[redacted]"


class Redactor:
    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so that a key containing another is replaced whole.
        self._texts = sorted({s for s in secrets if s}, key=len, reverse=True)
        spellings = {form for s in self._texts for form in (s, *_json_spellings(s))}
        self._bytes = sorted((f.encode() for f in spellings), key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._texts)

    def text(self, text: str) -> str:
        for secret in self._texts:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    def value(self, value: Any) -> Any:
        """A copy of a parsed JSON value with every string (keys too) redacted."""
        if not self._texts:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def data(self, data: bytes) -> bytes:
        """Serialized JSON (or any text) with every spelling of a secret replaced."""
        for secret in self._bytes:
            if secret in data:
                data = data.replace(secret, REDACTED.encode())
        return data


def _json_spellings(secret: str) -> tuple[str, str]:
    """The secret inside a JSON string: quotes and controls escaped, non-ASCII escaped as \\uXXXX or not."""
    return json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]
