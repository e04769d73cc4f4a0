"""The digest of a set of files that docs/protocol.md defines for a stack's `weights_sha256` and for the source
digest in `software.backend`: SHA-256 over `name:hex\\n` lines, one per file, where `hex` is the file's own SHA-256.
Which files, under which names and in which order, is the caller's: this module only hashes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path


def files_sha256(named_files: Iterable[tuple[str, Path]]) -> str:
    """SHA-256 over each file's own SHA-256, as `name:hex\\n` lines in the order given."""
    outer = hashlib.sha256()
    for name, path in named_files:
        inner = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                inner.update(chunk)
        outer.update(f"{name}:{inner.hexdigest()}\n".encode())
    return outer.hexdigest()
