"""Where a stream's events go: the client's HTTP response, or the buffer a replay reads its stream into.

The serving path writes the same bytes to either, so a replay's stream is read as a client reads one.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web


class Sink(Protocol):
    """Where a stream's events go: the client's HTTP response, or a replay's buffer."""

    async def open(self, headers: dict[str, str]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class HttpSink:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def open(self, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(headers=headers)
        await self.response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def close(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


class BufferSink:
    """A replay's stream: read whole, as a client would, and kept."""

    def __init__(self) -> None:
        self.data = bytearray()

    async def open(self, headers: dict[str, str]) -> None:
        return None

    async def write(self, data: bytes) -> None:
        self.data += data

    async def close(self) -> None:
        return None
