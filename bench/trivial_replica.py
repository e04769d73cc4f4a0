"""A trivial OpenAI-compatible replica for benchmarks: a fixed answer, no model, as fast as aiohttp allows.

Run as a process: `python -m bench.trivial_replica PORT`. It describes a fixed stack at `GET /v1/stack` and answers
every completion with the same small body, so that whatever a benchmark measures on top of it is overhead.
"""

from __future__ import annotations

import argparse
import hashlib
import json

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


async def complete(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json", headers={"Stackpin-Stack": FINGERPRINT})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int, help="the loopback port to listen on")
    port = parser.parse_args().port
    app = web.Application()
    app.add_routes([web.get("/v1/stack", stack), web.post("/v1/chat/completions", complete)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
