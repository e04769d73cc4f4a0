"""The `stackpin` kind: a pinned_backend, which proves its stack.

It computes its stack from what it loaded and runs on and serves it at `GET /v1/stack` with the fingerprint it
claims (docs/protocol.md); the proxy recomputes the fingerprint and quarantines a replica whose claim is not its
document's. Every answer names the fingerprint it was computed under (the `Stackpin-Stack` header, or
`system_fingerprint` in the body), and one that names another is thrown away. It answers chat, completions and
embeddings itself, with token ids and logprobs in the `stackpin` extension, and the Responses API through the
proxy's translation to chat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

from proxy.endpoints import BACKEND_ENDPOINTS, RESPONSES
from proxy.errors import ReplicaRejected, StackMismatch, StackpinError
from proxy.replicas.forward import Described, describe
from proxy.replicas.kinds.base import KindSettings, StackSource, Target

if TYPE_CHECKING:
    from proxy.replicas.registry import ReplicaSnapshot


class Stackpin:
    name = "stackpin"
    source = StackSource.PROVEN

    def validate(self, settings: KindSettings) -> None:
        if settings.stack is not None or settings.endpoints is not None or settings.model is not None:
            raise ValueError(
                "a stackpin replica proves its own stack at GET /v1/stack and its routes are known: leave out "
                "'stack', 'endpoints' and 'model' (kind = \"upstream\" declares them)"
            )

    def endpoints(self, declared: list[str] | None) -> frozenset[str]:
        return BACKEND_ENDPOINTS

    def translated(self) -> frozenset[str]:
        return frozenset({RESPONSES})

    async def describe(self, session: aiohttp.ClientSession, target: Target) -> Described:
        return await describe(session, target.url, timeout_s=target.timeout_s)

    def forwarded(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return body  # it returns token ids and logprobs unasked

    def answered(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return body  # its `stackpin` extension is already there

    def check_answer(
        self, replica: ReplicaSnapshot, stack_header: str | None, body: dict[str, Any] | None
    ) -> None:
        claimed = stack_header
        if claimed is None and body is not None and isinstance(body.get("system_fingerprint"), str):
            claimed = body["system_fingerprint"]
        if claimed != replica.fingerprint:
            raise StackMismatch(replica, claimed)

    def rejected(self, error: ReplicaRejected) -> StackpinError:
        return error


KIND = Stackpin()
