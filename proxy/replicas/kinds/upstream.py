"""The `upstream` kind: an OpenAI-compatible API whose stack is declared in configuration.

Nothing checks a declared stack: the proxy cannot ask an upstream API what serves it, so the replica is in rotation
on its declaration, no health check reaches it, and the record says its stack was declared. It answers the routes
its configuration lists (chat and completions unless it lists more); the proxy does not translate for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

from proxy.endpoints import DECLARED_DEFAULT
from proxy.errors import ReplicaRejected, ReplicaUnavailable, StackpinError
from proxy.replicas.forward import Described
from proxy.replicas.kinds.base import KindSettings, StackSource, Target

if TYPE_CHECKING:
    from proxy.replicas.registry import ReplicaSnapshot


class Upstream:
    name = "upstream"
    source = StackSource.DECLARED

    def validate(self, settings: KindSettings) -> None:
        if settings.stack is None:
            raise ValueError(
                "an upstream replica declares its stack: add a 'stack' table (at least its 'model'), or name the "
                "kind that describes its own (stackpin, vllm, sglang, llamacpp, ollama)"
            )

    def endpoints(self, declared: list[str] | None) -> frozenset[str]:
        return frozenset(declared if declared is not None else DECLARED_DEFAULT)

    def translated(self) -> frozenset[str]:
        return frozenset()

    async def describe(self, session: aiohttp.ClientSession, target: Target) -> Described:
        raise ReplicaUnavailable(
            f"{target.url} is an upstream API: its stack is declared, never fetched", down=False
        )

    def forwarded(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def answered(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def check_answer(
        self, replica: ReplicaSnapshot, stack_header: str | None, body: dict[str, Any] | None
    ) -> None:
        return None  # its `system_fingerprint`, if any, is its own and proves nothing of the declared stack

    def rejected(self, error: ReplicaRejected) -> StackpinError:
        return error


KIND = Upstream()
