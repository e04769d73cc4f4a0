"""A small, honest OpenAI-compatible replica for the proxy's tests, served over real HTTP on loopback.

It speaks docs/protocol.md: `GET /v1/stack`, token ids and raw logprobs in the `stackpin` extension, the
fingerprint in `system_fingerprint` and the `Stackpin-Stack` header, streaming and not. It answers chat (with `n`
choices, and a tool call when the request offers tools), completions, embeddings, and, as an upstream that serves
it, the Responses API. Every answer is a pure function of the request, unless a test makes it nondeterministic (it
then perturbs one logprob's last bit, as batch-dependent kernels do, or for half its answers changes the tokens from
a random position on, as a near tie tipped the other way), makes it diverge from a token on, changes its
stack or its words, makes it fail, or tells it to change one thing (`alter`): a tool call's arguments, a later
choice, one streamed chunk's text, where a stream's chunks split, or one component of an embedding.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import rfc8785
from aiohttp import web

from tests.support.fake_routes import embeddings_body, response_body, response_events

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
ALTERATIONS = ("tool_arguments", "later_choice", "chunk_text", "chunk_split", "embedding")


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
    """The fingerprint as docs/protocol.md defines it: the batching policy's serving features left out."""
    batching = {
        k: v for k, v in stack.get("batching", {}).items() if k not in ("prefix_cache", "speculation")
    }
    return hashlib.sha256(rfc8785.dumps({**stack, "batching": batching})).hexdigest()


def _unit(*parts: Any) -> float:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return struct.unpack(">Q", digest[:8])[0] / 2**64


def tool_arguments(prompt: str, altered: bool) -> str:
    city = WORDS[int(_unit(prompt, "city") * len(WORDS))]
    days = 3 if not altered else 4
    return json.dumps({"city": city, "days": days, "units": "metric"})


@dataclass
class FakeReplica:
    stack: dict[str, Any] = field(default_factory=tiny_stack)
    nondeterministic: bool = False
    nondeterministic_tokens: bool = False  # half its answers take another token from a random position on
    chunk_delay_s: float = 0.0  # pause between streamed chunks, as a model's decode steps would
    answer_delay_s: float = 0.0  # pause before a whole (non-streamed) answer, as a model's decoding would
    # None, "500", "401", "garbage", "wrong_fingerprint", "drop_stream", "unsafe_int", or one of the upstreams
    # that quote the key they were sent: "echo_key" (an error of status `echo_status`), "echo_key_garbage" (a
    # non-JSON answer, plain or as a streamed event), "echo_key_midstream" (an error event inside a stream)
    failure: str | None = None
    echo_status: int = 400
    alter: str | None = None  # one of ALTERATIONS: the one thing the next answers change
    diverge_from: int | None = None  # every token from this position on is another one, as on another stack
    words: list[str] = field(default_factory=lambda: list(WORDS))  # what its completions are made of
    set_cookie: str | None = None  # a Set-Cookie header on every answer, as a load balancer's affinity cookie
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
                web.post("/v1/embeddings", self._embeddings),
                web.post("/v1/responses", self._responses),
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
        prompt = json.dumps(body.get("messages", body.get("prompt", body.get("input"))), sort_keys=True)
        temperature = float(body.get("temperature", 1.0) or 0.0)
        seed = body.get("seed")
        if seed is None and temperature > 0:
            seed = random.randrange(2**31)
        n = int(
            body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens") or 8
        )
        ids = [int(_unit(prompt, seed, temperature, k) * len(self.words)) for k in range(n)]
        if self.diverge_from is not None:
            ids = [i if k < self.diverge_from else (i + 1) % len(self.words) for k, i in enumerate(ids)]
        if self.nondeterministic_tokens and n and random.random() < 0.5:
            at = random.randrange(n)  # as a near tie that the batch tips the other way
            ids = [i if k < at else (i + 1) % len(self.words) for k, i in enumerate(ids)]
        logprobs = [-(_unit(prompt, "lp", k) * 5) for k in range(n)]
        if self.nondeterministic and n:
            k = random.randrange(n)
            (bits,) = struct.unpack(">Q", struct.pack(">d", logprobs[k]))
            logprobs[k] = struct.unpack(">d", struct.pack(">Q", bits ^ 1))[0]
        text = " ".join(self.words[i] for i in ids)
        return ids, logprobs, text, seed

    def _refusal(self, request: web.Request, body: dict[str, Any]) -> web.Response | None:
        if self.failure == "500":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if self.failure == "401":
            key = request.headers.get("Authorization", "")
            return web.json_response({"error": {"message": f"Incorrect API key provided: {key}"}}, status=401)
        if self.failure == "garbage":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.failure == "echo_key":
            message = f"request refused for the key {key}; check it"
            return web.json_response(
                {"error": {"message": message, "type": "invalid_request_error", "param": key}},
                status=self.echo_status,
            )
        if self.failure == "echo_key_garbage" and not body.get("stream"):
            # The key straddles where a short excerpt of the answer would be cut.
            return web.Response(text="<html>" + "x" * 70 + f" {key} </html>", content_type="text/html")
        for name, most in (("max_tokens", 4096), ("n", 8)):
            value = body.get(name, 1)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most
            ):
                return _invalid(f"{name} must be an integer from 1 to {most}")
        return None

    async def _received(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        """The request's body, kept with its headers, and the refusal a test asked for, if any."""
        body = await request.json()
        self.requests.append(body)
        self.headers_seen.append(dict(request.headers))
        return body, self._refusal(request, body)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._received(request)
        if refused is not None:
            return refused
        fingerprint = "f" * 64 if self.failure == "wrong_fingerprint" else self.fingerprint
        try:
            ids, logprobs, text, seed = self.completion(body)
        except (TypeError, ValueError) as e:
            return _invalid(f"the request cannot be served: {e}")
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
        try:
            choices = self._choices(body, chat, ids, logprobs, text)
        except (TypeError, ValueError, KeyError, IndexError) as e:
            return _invalid(f"the request cannot be served: {e!r}")
        if body.get("stream"):
            try:
                return await self._stream(
                    request, chat, choices, ids, logprobs, extension, usage, fingerprint
                )
            except (
                ConnectionResetError
            ):  # the proxy let go of the stream: a client left, or nothing is served
                return web.Response()
        await asyncio.sleep(self.answer_delay_s)
        answer = {
            "id": f"cmpl-{random.randrange(10**9)}",  # a handle, different every time, as OpenAI's
            "object": "chat.completion" if chat else "text_completion",
            "created": random.randrange(10**9),
            "model": self.stack["model"],
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage,
            "stackpin": extension,
        }
        headers = {"Stackpin-Stack": fingerprint}
        if self.set_cookie is not None:
            headers["Set-Cookie"] = self.set_cookie
        return web.json_response(answer, headers=headers)

    def _choices(
        self, body: dict[str, Any], chat: bool, ids: list[int], logprobs: list[float], text: str
    ) -> list[dict[str, Any]]:
        choices = []
        for i in range(int(body.get("n") or 1)):
            content = text if i == 0 else f"{text} (choice {i})"
            if i == 1 and self.alter == "later_choice":
                content = content.replace("choice", "option")
            choice: dict[str, Any] = {"index": i, "finish_reason": "length", "logprobs": None}
            if not chat:
                choice["text"] = content
            elif body.get("tools"):
                name = body["tools"][0]["function"]["name"]
                arguments = tool_arguments(
                    json.dumps(body["messages"], sort_keys=True), self.alter == "tool_arguments"
                )
                call = {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
                choice["finish_reason"] = "tool_calls"
            else:
                choice["message"] = {"role": "assistant", "content": content}
            if body.get("logprobs") and chat and i == 0:
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": self.words[t],
                            "logprob": lp,
                            "bytes": list(self.words[t].encode()),
                            "top_logprobs": [],
                        }
                        for t, lp in zip(ids, logprobs, strict=True)
                    ]
                }
            choices.append(choice)
        return choices

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        choices: list[dict[str, Any]],
        ids: list[int],
        logprobs: list[float],
        extension: dict[str, Any],
        usage: dict[str, Any],
        fingerprint: str,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Stackpin-Stack": fingerprint}
        )
        await response.prepare(request)
        # The proxy may let go of the stream: its client left, or nothing may be served.
        with contextlib.suppress(ConnectionResetError):
            await self._chunks(request, response, chat, choices, ids, logprobs, extension, usage, fingerprint)
        return response

    async def _chunks(
        self,
        request: web.Request,
        response: web.StreamResponse,
        chat: bool,
        choices: list[dict[str, Any]],
        ids: list[int],
        logprobs: list[float],
        extension: dict[str, Any],
        usage: dict[str, Any],
        fingerprint: str,
    ) -> None:
        pieces = _pieces(choices[0], chat, self.alter, [self.words[t] for t in ids])
        stamp = {
            "id": f"cmpl-{random.randrange(10**9)}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": random.randrange(10**9),
            "model": self.stack["model"],
            "system_fingerprint": fingerprint,
        }
        # Each chunk carries the tokens it adds: one each, the rest with the last, all of them in order.
        shares = [ids[k : k + 1] for k in range(len(pieces) - 1)] + [ids[len(pieces) - 1 :]]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            chunk_choices = [
                {"index": 0, **piece, "finish_reason": choices[0]["finish_reason"] if last else None}
            ]
            if last:  # the later choices arrive whole, in the last chunk, as a replica may send them
                chunk_choices += [_whole_delta(c, chat) for c in choices[1:]]
            lps = logprobs[k : k + 1] if not last else logprobs[len(pieces) - 1 :]
            chunk: dict[str, Any] = {
                **stamp,
                "choices": chunk_choices,
                "stackpin": {"token_ids": shares[k], "token_logprobs": lps},
            }
            if last:
                chunk["stackpin"].update(
                    prompt_token_ids=extension["prompt_token_ids"],
                    batch=extension["batch"],
                    seed=extension["seed"],
                )
                chunk["usage"] = usage
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.chunk_delay_s)
            key = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if self.failure == "echo_key_midstream":
                error = {
                    "error": {"message": f"upstream failed serving the key {key}", "type": "server_error"}
                }
                await response.write(f"data: {json.dumps(error)}\n\n".encode())
                return
            if self.failure == "echo_key_garbage":
                await response.write(f"data: <html>{'x' * 70} {key}</html>\n\n".encode())
                return
            if self.failure == "drop_stream" and k == 1:
                assert request.transport is not None
                request.transport.close()
                return
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    async def _embeddings(self, request: web.Request) -> web.Response:
        body, refused = await self._received(request)
        if refused is not None:
            return refused
        answer = embeddings_body(
            body, self.stack["model"], self.fingerprint, altered=self.alter == "embedding"
        )
        return web.json_response(answer, headers={"Stackpin-Stack": self.fingerprint})

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._received(request)
        if refused is not None:
            return refused
        _, _, text, _ = self.completion(body)
        answer = response_body(body, self.stack["model"], text)
        if not body.get("stream"):
            return web.json_response(answer, headers={"Stackpin-Stack": self.fingerprint})
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Stackpin-Stack": self.fingerprint}
        )
        await response.prepare(request)
        for name, event in response_events(answer):
            await response.write(f"event: {name}\ndata: {json.dumps(event)}\n\n".encode())
        await response.write_eof()  # a Responses stream ends with its terminal event, no [DONE]
        return response


def _pieces(choice: dict[str, Any], chat: bool, alter: str | None, words: list[str]) -> list[dict[str, Any]]:
    """The deltas (or texts) that stream choice 0: a token's word at a time, a tool call's arguments a few
    characters at a time after a first delta that names the call."""
    texts = [w if k == 0 else " " + w for k, w in enumerate(words)]
    if not chat:
        pieces = [{"text": t} for t in texts]
    elif choice["message"].get("tool_calls"):
        call = choice["message"]["tool_calls"][0]
        arguments = call["function"]["arguments"]
        head = {
            "index": 0,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        pieces = [{"delta": {"role": "assistant", "content": None, "tool_calls": [head]}}]
        pieces += [
            {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": arguments[k : k + 6]}}]}}
            for k in range(0, len(arguments), 6)
        ]
    else:
        pieces = [{"delta": {"content": t}} for t in texts]
    if alter == "chunk_text" and len(pieces) > 2:  # the third chunk's text in capitals
        target = pieces[2]["delta"] if chat else pieces[2]
        for key in ("content", "text"):
            if isinstance(target.get(key), str):
                target[key] = target[key].upper()
        for call in target.get("tool_calls", []):
            call["function"]["arguments"] = call["function"]["arguments"].upper()
    if alter == "chunk_split" and len(pieces) > 3:
        pieces = _merged(pieces, 2, chat)
    return pieces


def _merged(pieces: list[dict[str, Any]], k: int, chat: bool) -> list[dict[str, Any]]:
    """Chunks k and k + 1 sent as one: the same answer, other events."""
    a, b = pieces[k], pieces[k + 1]
    if not chat:
        joined = {"text": a["text"] + b["text"]}
    elif "tool_calls" in a["delta"]:
        args = (
            a["delta"]["tool_calls"][0]["function"]["arguments"]
            + b["delta"]["tool_calls"][0]["function"]["arguments"]
        )
        joined = {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}}
    else:
        joined = {"delta": {"content": a["delta"]["content"] + b["delta"]["content"]}}
    return [*pieces[:k], joined, *pieces[k + 2 :]]


def _whole_delta(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    if not chat:
        return {"index": choice["index"], "text": choice["text"], "finish_reason": choice["finish_reason"]}
    return {"index": choice["index"], "delta": choice["message"], "finish_reason": choice["finish_reason"]}


def embedding_bits(vector: list[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


def decode_embedding(value: str) -> list[float]:
    raw = base64.b64decode(value)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _invalid(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=400)
