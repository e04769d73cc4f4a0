"""A small, honest OpenAI-compatible replica for the proxy's tests, served over real HTTP on loopback.

It speaks docs/protocol.md: `GET /v1/stack`, token ids and raw logprobs in the `stackpin` extension, the
fingerprint in `system_fingerprint` and the `Stackpin-Stack` header, streaming and not. Its completion is a pure
function of the prompt, the seed and the temperature, unless a test makes it nondeterministic (it then perturbs one
logprob's last bit, as batch-dependent kernels do), makes it diverge from a token on, changes its stack or its
words, or makes it fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import rfc8785
from aiohttp import web

WORDS = [
    "the",
    "quiet",
    "lighthouse",
    "keeper",
    "watched",
    "ships",
    "sail",
    "past",
    "at",
    "dawn",
    "and",
    "dusk",
]


def tiny_stack(**overrides: Any) -> dict[str, Any]:
    stack: dict[str, Any] = {
        "schema": 1,
        "model": "fake-model",
        "weights_sha256": "ab" * 32,
        "quantisation": "fp32",
        "hardware": "cpu-x86_64-avx512",
        "hardware_detail": {"cpu_model": "test cpu", "isa": "avx512"},
        "kernel_mode": "batch_invariant",
        "software": {"backend": "0.0-test", "torch": None, "cuda": None, "triton": None, "driver": None},
        "batching": {"policy": "continuous", "max_batch_size": 8, "max_step_tokens": 64, "kv_split_size": 64},
    }
    stack.update(overrides)
    return stack


def fingerprint_of(stack: dict[str, Any]) -> str:
    return hashlib.sha256(rfc8785.dumps(stack)).hexdigest()


def _unit(*parts: Any) -> float:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return struct.unpack(">Q", digest[:8])[0] / 2**64


@dataclass
class FakeReplica:
    stack: dict[str, Any] = field(default_factory=tiny_stack)
    nondeterministic: bool = False
    diverge_from: int | None = None  # every token from this position on is another one, as on another stack
    words: list[str] = field(default_factory=lambda: list(WORDS))  # what its completions are made of
    chunk_delay_s: float = 0.0  # pause between streamed chunks, as a model's decode steps would
    failure: str | None = (
        None  # None, "500", "401", "garbage", "wrong_fingerprint", "drop_stream", "unsafe_int"
    )
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.stack)

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.add_routes(
            [
                web.get("/v1/stack", self._stack),
                web.post("/v1/chat/completions", self._complete),
                web.post("/v1/completions", self._complete),
            ]
        )
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _stack(self, request: web.Request) -> web.Response:
        return web.json_response({"stack": self.stack, "fingerprint": self.fingerprint})

    def completion(self, body: dict[str, Any]) -> tuple[list[int], list[float], str, int | None]:
        prompt = json.dumps(body.get("messages", body.get("prompt")), sort_keys=True)
        temperature = float(body.get("temperature", 1.0) or 0.0)
        seed = body.get("seed")
        if seed is None and temperature > 0:
            seed = random.randrange(2**31)
        n = int(body.get("max_tokens") or 8)
        ids = [int(_unit(prompt, seed, temperature, k) * len(self.words)) for k in range(n)]
        if self.diverge_from is not None:
            ids = [i if k < self.diverge_from else (i + 1) % len(self.words) for k, i in enumerate(ids)]
        logprobs = [-(_unit(prompt, "lp", k) * 5) for k in range(n)]
        if self.nondeterministic and n:
            k = random.randrange(n)
            (bits,) = struct.unpack(">Q", struct.pack(">d", logprobs[k]))
            logprobs[k] = struct.unpack(">d", struct.pack(">Q", bits ^ 1))[0]
        text = " ".join(self.words[i] for i in ids)
        return ids, logprobs, text, seed

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers_seen.append(dict(request.headers))
        if self.failure == "500":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if self.failure == "401":
            key = request.headers.get("Authorization", "")
            return web.json_response({"error": {"message": f"Incorrect API key provided: {key}"}}, status=401)
        if self.failure == "garbage":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if not isinstance(body.get("max_tokens", 8), int) or body.get("max_tokens", 8) < 1:
            return web.json_response(
                {
                    "error": {
                        "message": "max_tokens must be a positive integer",
                        "type": "invalid_request_error",
                    }
                },
                status=400,
            )
        fingerprint = "f" * 64 if self.failure == "wrong_fingerprint" else self.fingerprint
        ids, logprobs, text, seed = self.completion(body)
        if self.failure == "unsafe_int":
            seed = 2**63 - 1  # no JSON reader carries it exactly; canonical JSON refuses it
        chat = request.path.endswith("/chat/completions")
        extension = {
            "prompt_token_ids": [1, 2, 3],
            "token_ids": ids,
            "token_logprobs": logprobs,
            "batch": {"max": 1, "min": 1, "steps": len(ids)},
            "seed": seed,
        }
        usage = {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}
        if body.get("stream"):
            return await self._stream(request, chat, ids, logprobs, text, extension, usage, fingerprint)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.words[i],
                        "logprob": lp,
                        "bytes": list(self.words[i].encode()),
                        "top_logprobs": [],
                    }
                    for i, lp in zip(ids, logprobs, strict=True)
                ]
            }
        answer = {
            "id": "cmpl-fake",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": self.stack["model"],
            "system_fingerprint": fingerprint,
            "choices": [choice],
            "usage": usage,
            "stackpin": extension,
        }
        return web.json_response(answer, headers={"Stackpin-Stack": fingerprint})

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        ids: list[int],
        logprobs: list[float],
        text: str,
        extension: dict[str, Any],
        usage: dict[str, Any],
        fingerprint: str,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Stackpin-Stack": fingerprint}
        )
        await response.prepare(request)
        for k, (token, logprob) in enumerate(zip(ids, logprobs, strict=True)):
            piece = self.words[token] if k == 0 else " " + self.words[token]
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            chunk: dict[str, Any] = {
                "id": "cmpl-fake",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": self.stack["model"],
                "system_fingerprint": fingerprint,
                "choices": [choice],
                "stackpin": {"token_ids": [token], "token_logprobs": [logprob]},
            }
            if k == len(ids) - 1:
                choice["finish_reason"] = "length"
                chunk["stackpin"].update(
                    prompt_token_ids=extension["prompt_token_ids"],
                    batch=extension["batch"],
                    seed=extension["seed"],
                )
                chunk["usage"] = usage
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.chunk_delay_s)
            if self.failure == "drop_stream" and k == 1:
                assert request.transport is not None
                request.transport.close()
                return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
