"""A TCP relay on loopback in front of a real server (PostgreSQL, Redis) that a test can cut and restore.

`cut()` drops every connection and refuses new ones, as a server going away does; `start()` again listens on the
same port, as the server coming back.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpRelay:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.server: asyncio.Server | None = None
        self.listen_port = 0
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.listen_port)
        self.listen_port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.close()
        await self.server.wait_closed()
        self.server = None

    async def close(self) -> None:
        if self.server is not None:
            await self.cut()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self.writers.update((writer, up_writer))

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self.writers.difference_update((writer, up_writer))
