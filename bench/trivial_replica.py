"""A trivial OpenAI-compatible replica for benchmarks: a fixed answer, no model, as fast as aiohttp allows.

Run as a process: `python -m bench.trivial_replica PORT [--stream-events N]`. It describes a fixed stack at
`GET /v1/stack` and answers every completion with the same small body, so that whatever a benchmark measures on top
of it is overhead. Asked to stream, it sends N small events, written in 64 KiB pieces, as fast as the socket takes
them: a relay behind it always finds events already buffered, as behind a fast model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Awaitable, Callable

import rfc8785
from aiohttp import web

STACK = {
    "schema": 1,
    "model": "trivial",
    "weights_sha256": None,
    "quantisation": "fp32",
    "hardware": "cpu-x86_64",
    "hardware_detail": {},
    "kernel_mode": "batch_invariant",
    "software": {"backend": "trivial", "torch": None, "cuda": None, "triton": None, "driver": None},
    "batching": {},
}
FINGERPRINT = hashlib.sha256(rfc8785.dumps(STACK)).hexdigest()
ANSWER = json.dumps(
    {
        "id": "cmpl-trivial",
        "object": "chat.completion",
        "created": 0,
        "model": "trivial",
        "system_fingerprint": FINGERPRINT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok ok ok ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8},
        "stackpin": {
            "prompt_token_ids": [1, 2, 3, 4],
            "token_ids": [5, 5, 5, 5],
            "token_logprobs": [-0.1, -0.2, -0.3, -0.4],
            "batch": {"max": 1, "min": 1, "steps": 4},
            "seed": None,
        },
    }
).encode()


async def stack(_: web.Request) -> web.Response:
    return web.json_response({"stack": STACK, "fingerprint": FINGERPRINT})


EVENT = (
    "data: "
    + json.dumps(
        {
            "id": "cmpl-trivial",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "trivial",
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "delta": {"content": " ok"}, "finish_reason": None}],
            "stackpin": {"token_ids": [5], "token_logprobs": [-0.1]},
        }
    )
    + "\n\n"
).encode()


def completions(stream_events: int) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    stream_body = EVENT * stream_events + b"data: [DONE]\n\n"

    async def complete(request: web.Request) -> web.StreamResponse:
        if not json.loads(await request.read()).get("stream"):
            return web.Response(
                body=ANSWER, content_type="application/json", headers={"Stackpin-Stack": FINGERPRINT}
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Stackpin-Stack": FINGERPRINT}
        )
        await response.prepare(request)
        for start in range(0, len(stream_body), 65536):
            await response.write(stream_body[start : start + 65536])
        await response.write_eof()
        return response

    return complete


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int, help="the loopback port to listen on")
    parser.add_argument(
        "--stream-events", type=int, default=8, help="events in a streamed answer (default 8)"
    )
    args = parser.parse_args()
    app = web.Application()
    app.add_routes(
        [web.get("/v1/stack", stack), web.post("/v1/chat/completions", completions(args.stream_events))]
    )
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
