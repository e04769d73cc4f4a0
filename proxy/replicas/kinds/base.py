"""What every replica kind is asked (`ReplicaKind`), and where a stack comes from (`StackSource`).

The kinds' modules implement the protocol; `proxy/replicas/kinds/__init__.py` names them. This module knows no kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from pydantic import SecretStr

from proxy.errors import ReplicaRejected, StackpinError
from proxy.replicas.forward import Described
from proxy.stack import Stack

if TYPE_CHECKING:
    from proxy.replicas.registry import ReplicaSnapshot


class StackSource(StrEnum):
    PROVEN = "proven"  # computed by the replica from what it loaded and runs on, checked on every answer
    REPORTED = "reported"  # read from what a running engine says about itself; nothing proves it
    DECLARED = "declared"  # written in configuration; nothing checks it


@dataclass(frozen=True)
class Target:
    """Where a kind fetches a replica's stack from, and how."""

    url: str
    timeout_s: float
    api_key: SecretStr | None = None
    model: str | None = None  # the model asked about, for an engine that serves several (Ollama)


class KindSettings(Protocol):
    """What a `[[replicas]]` entry says that a kind judges (proxy/config.py's ReplicaSettings)."""

    stack: Stack | None
    endpoints: list[str] | None
    model: str | None


class ReplicaKind(Protocol):
    name: str
    source: StackSource

    def validate(self, settings: KindSettings) -> None:
        """Raises ValueError, saying what to fix, when a `[[replicas]]` entry of this kind is not one it can be."""
        ...

    def endpoints(self, declared: list[str] | None) -> frozenset[str]:
        """The routes it answers itself (`declared`: what its configuration lists, where the kind takes that)."""
        ...

    def translated(self) -> frozenset[str]:
        """The routes it serves through the proxy's translation (the Responses API to chat)."""
        ...

    async def describe(self, session: aiohttp.ClientSession, target: Target) -> Described:
        """Fetches and builds its stack; `ReplicaUnavailable` when it cannot. Never called for a declared one."""
        ...

    def forwarded(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """The request as it is sent (and recorded): what the kind asks for beyond the client (token ids,
        logprobs). Applying it twice gives what applying it once does, since a replay sends a recorded body."""
        ...

    def answered(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """A whole answer or one stream chunk with its choice 0's token ids and logprobs in the `stackpin`
        extension (docs/protocol.md), read from wherever this kind puts them."""
        ...

    def check_answer(
        self, replica: ReplicaSnapshot, stack_header: str | None, body: dict[str, Any] | None
    ) -> None:
        """Raises `StackMismatch` when an answer (`body` None: a stream's headers) shows another stack."""
        ...

    def rejected(self, error: ReplicaRejected) -> StackpinError:
        """A 4xx from the replica as the error the client gets."""
        ...
