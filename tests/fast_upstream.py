"""A replica that streams as fast as a socket takes it, in a process of its own: `python -m tests.fast_upstream`.

Each streamed answer is `--chunks` small events, written in 64 KiB pieces, so that the proxy's relay finds many
events already buffered, as it does behind a fast model. Non-streamed answers are one short completion. It prints
its base URL on the first line of its output once listening. For the fairness test and `bench/fairness.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web

from tests.fake_replica import fingerprint_of, tiny_stack

STACK = tiny_stack()
FINGERPRINT = fingerprint_of(STACK)


def stream_body(chunks: int) -> bytes:
    event = {
        "id": "cmpl-fast",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": STACK["model"],
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}],
        "stackpin": {"token_ids": [7], "token_logprobs": [-0.5]},
    }
    line = f"data: {json.dumps(event)}\n\n".encode()
    return line * chunks + b"data: [DONE]\n\n"


def make_app(chunks: int) -> web.Application:
    body = stream_body(chunks)

    async def stack(request: web.Request) -> web.Response:
        return web.json_response({"stack": STACK, "fingerprint": FINGERPRINT})

    async def complete(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        if not payload.get("stream"):
            answer = {
                "id": "cmpl-fast",
                "object": "chat.completion",
                "created": 0,
                "model": STACK["model"],
                "system_fingerprint": FINGERPRINT,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "word"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                "stackpin": {"token_ids": [7], "token_logprobs": [-0.5], "prompt_token_ids": [1]},
            }
            return web.json_response(answer, headers={"Stackpin-Stack": FINGERPRINT})
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Stackpin-Stack": FINGERPRINT}
        )
        await response.prepare(request)
        for start in range(0, len(body), 65536):
            await response.write(body[start : start + 65536])
        await response.write_eof()
        return response

    app = web.Application()
    app.add_routes([web.get("/v1/stack", stack), web.post("/v1/chat/completions", complete)])
    return app


async def serve(chunks: int) -> None:
    runner = web.AppRunner(make_app(chunks), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=20_000)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.chunks))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
