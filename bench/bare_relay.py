"""The floor a Python relay can reach: forward the body, return the answer, nothing else (no record, no checks).

Run as a process: `python -m bench.bare_relay PORT UPSTREAM_URL`. It uses the aiohttp client session settings
the proxy uses (proxy/app.py), so that what stackpin costs beyond it is what stackpin does, not how it connects.
A streamed answer is relayed chunk by chunk as it arrives.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


async def ready(_: web.Request) -> web.Response:
    return web.Response(text="ready")


def relay(upstream: str) -> web.Application:
    async def session(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), cookie_jar=aiohttp.DummyCookieJar()
        )
        yield
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"}
        async with request.app[SESSION].post(
            upstream + request.path, data=await request.read(), headers=headers
        ) as answer:
            content_type = answer.headers.get("Content-Type", "application/json")
            if not content_type.startswith("text/event-stream"):
                body = await answer.read()
                return web.Response(body=body, status=answer.status, headers={"Content-Type": content_type})
            response = web.StreamResponse(headers={"Content-Type": content_type})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/readyz", ready)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int, help="the loopback port to listen on")
    parser.add_argument("upstream", help="the replica's base URL, e.g. http://127.0.0.1:8001")
    args = parser.parse_args()
    web.run_app(relay(args.upstream), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
