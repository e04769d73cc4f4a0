"""A loopback server that describes itself as an engine does, from a fixture file of documents.

`EngineDocuments` serves each document of a file in tests/data/engines/ at its path (GET, or POST for Ollama's
`/api/show`), `/metrics` as text, and `/v1/chat/completions` with the file's `chat_answer` when it has one. A test
changes `documents` to show a restart with other settings. It knows no proxy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "engines"


def documents_of(engine: str) -> dict[str, Any]:
    """The fixture file's documents, its provenance note left out."""
    data = json.loads((FIXTURES / f"{engine}.json").read_text())
    return {key: value for key, value in data.items() if not key.startswith("_")}


@dataclass
class EngineDocuments:
    documents: dict[str, Any]
    requests: list[tuple[str, str, Any]] = field(default_factory=list)  # (method, path, body)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path, body))
        if request.path == "/v1/chat/completions" and "chat_answer" in self.documents:
            return web.json_response(self.documents["chat_answer"])
        if request.path not in self.documents:
            return web.json_response({"error": f"no {request.path} here"}, status=404)
        document = self.documents[request.path]
        if isinstance(document, str):
            return web.Response(text=document, content_type="text/plain")
        return web.json_response(document)
