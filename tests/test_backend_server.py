"""Specification of pinned_backend.server: the OpenAI routes, the stackpin extension, the stack, errors, metrics.

A real server on loopback over a random Qwen3-format checkpoint with a character-level tokenizer; the OpenAI SDK
talks to it like any other endpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import rfc8785
from aiohttp.test_utils import TestClient, TestServer

from pinned_backend.checkpoint import weights_sha256
from pinned_backend.runtime import BackendSettings
from pinned_backend.server import create_app
from tests.support.backend_checkpoint import write_random_checkpoint

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("server") / "random-qwen3", with_tokenizer=True)


def settings(checkpoint: Path, **overrides: Any) -> BackendSettings:
    fields: dict[str, Any] = {"model": checkpoint, "block_size": 4, "kv_split_size": 8, "kv_cache_mb": 1}
    return BackendSettings(**{**fields, **overrides})


@pytest.fixture
async def client(checkpoint: Path) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(settings(checkpoint)), host="127.0.0.1")) as c:
        yield c


async def post(client: TestClient, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = await client.post(path, json=body)
    return response.status, await response.json()


async def events(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    response = await client.post(path, json={**body, "stream": True})
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    lines = [line for line in (await response.text()).split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


async def test_chat_answers_with_the_stackpin_extension_and_fingerprint(client: TestClient) -> None:
    response = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "temperature": 0})
    body = await response.json()
    assert response.status == 200
    stack = await (await client.get("/v1/stack")).json()
    batching = {
        k: v for k, v in stack["stack"]["batching"].items() if k not in ("prefix_cache", "speculation")
    }
    fingerprint = hashlib.sha256(rfc8785.dumps({**stack["stack"], "batching": batching})).hexdigest()
    assert stack["fingerprint"] == fingerprint
    assert response.headers["Stackpin-Stack"] == fingerprint
    assert body["system_fingerprint"] == fingerprint
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    ext = body["stackpin"]
    assert set(ext) == {"prompt_token_ids", "token_ids", "token_logprobs", "batch", "seed"}
    assert len(ext["token_ids"]) == len(ext["token_logprobs"]) == 5
    assert ext["seed"] is None
    # Served alone: one step prefills the prompt and samples the first token, four more decode.
    assert ext["batch"] == {"max": 1, "min": 1, "steps": 5, "cached_tokens": 0, "accepted_draft_tokens": 0}
    assert body["usage"] == {
        "prompt_tokens": len(ext["prompt_token_ids"]),
        "completion_tokens": 5,
        "total_tokens": len(ext["prompt_token_ids"]) + 5,
    }


async def test_the_stack_describes_what_was_loaded(client: TestClient, checkpoint: Path) -> None:
    stack = (await (await client.get("/v1/stack")).json())["stack"]
    assert stack["model"] == "random-qwen3"
    assert stack["weights_sha256"] == weights_sha256(checkpoint)
    assert stack["quantisation"] == "fp32"
    assert stack["kernel_mode"] == "batch_invariant"
    assert stack["hardware"].startswith("cpu-")
    assert stack["batching"] == {
        "policy": "continuous",
        "max_batch_size": 16,
        "max_step_tokens": 256,
        "kv_split_size": 8,
        "prefix_cache": True,
        "speculation": None,
    }
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["random-qwen3"]


async def test_chat_logprobs_follow_openai(client: TestClient) -> None:
    request = {"messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    status, body = await post(client, CHAT, request)
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == body["stackpin"]["token_logprobs"]
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]


async def test_completion_logprobs_follow_the_legacy_shape(client: TestClient) -> None:
    request = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    status, body = await post(client, COMPLETIONS, request)
    assert status == 200
    assert body["object"] == "text_completion"
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == body["stackpin"]["token_logprobs"]
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"])


async def test_token_id_prompts_are_served_as_given(client: TestClient) -> None:
    status, body = await post(client, COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert status == 200
    assert body["stackpin"]["prompt_token_ids"] == [5, 6, 7]


async def test_a_stream_carries_the_same_answer_as_the_whole_body(client: TestClient) -> None:
    request = {"messages": HELLO, "max_tokens": 6, "temperature": 0, "logprobs": True}
    _, whole = await post(client, CHAT, request)
    chunks = await events(client, CHAT, {**request, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    token_chunks = [c for c in chunks[1:] if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in token_chunks)
    assert text == whole["choices"][0]["message"]["content"]
    ids = [i for c in token_chunks for i in c["stackpin"]["token_ids"]]
    lps = [lp for c in token_chunks for lp in c["stackpin"]["token_logprobs"]]
    assert (ids, lps) == (whole["stackpin"]["token_ids"], whole["stackpin"]["token_logprobs"])
    last = token_chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["stackpin"]["prompt_token_ids"] == whole["stackpin"]["prompt_token_ids"]
    assert "batch" in last["stackpin"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]


async def test_a_completion_stream_ends_with_done(client: TestClient) -> None:
    _, whole = await post(client, COMPLETIONS, {"prompt": "abc", "max_tokens": 3, "temperature": 0})
    chunks = await events(client, COMPLETIONS, {"prompt": "abc", "max_tokens": 3, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


async def test_a_sampled_request_without_seed_reports_one_that_replays_it(client: TestClient) -> None:
    request = {"messages": HELLO, "max_tokens": 8, "temperature": 1.0}
    _, first = await post(client, CHAT, request)
    seed = first["stackpin"]["seed"]
    assert isinstance(seed, int)
    _, again = await post(client, CHAT, {**request, "seed": seed})
    assert again["stackpin"]["token_ids"] == first["stackpin"]["token_ids"]
    assert again["stackpin"]["token_logprobs"] == first["stackpin"]["token_logprobs"]


async def test_a_stop_string_cuts_the_text(client: TestClient) -> None:
    _, free = await post(client, COMPLETIONS, {"prompt": "abc", "max_tokens": 12, "temperature": 0})
    text = free["choices"][0]["text"]
    stop = text[3:5]
    _, cut = await post(
        client, COMPLETIONS, {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": stop}
    )
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]


async def test_unknown_fields_and_the_values_that_ask_for_nothing_are_accepted(client: TestClient) -> None:
    harmless = {
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "parallel_tool_calls": True,
        "user": "u-1",
        "x": {},
    }
    status, _ = await post(client, CHAT, {"messages": HELLO, "max_tokens": 1, **harmless})
    assert status == 200


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (CHAT, {"messages": HELLO, "temperature": "hot"}, "temperature", "valid number"),
        (CHAT, {"messages": HELLO, "n": 2}, "n", "only n = 1"),
        (CHAT, {"messages": HELLO, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        (CHAT, {"messages": HELLO, "max_tokens": 10_000}, "max_tokens", "lower max_tokens"),
        (CHAT, {"messages": HELLO, "top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "valid string"),
        (CHAT, {}, "messages", "required"),
        (COMPLETIONS, {"prompt": "a" * 300}, "prompt", "shorten the prompt"),
        (COMPLETIONS, {"prompt": [1, 999]}, "prompt", "token ids"),
        (COMPLETIONS, {"prompt": "a", "logprobs": 9}, "logprobs", "less than or equal to 5"),
        (COMPLETIONS, {"prompt": "a", "stop": [""]}, "stop", "must not be empty"),
        # What it cannot honour is refused, never answered as if it had not been asked.
        (CHAT, {"messages": HELLO, "tools": [{"type": "web_search"}]}, "tools.0.type", "only tools of type"),
        (CHAT, {"messages": HELLO, "tool_choice": "required"}, "tool_choice", "offers no tools"),
        (
            CHAT,
            {"messages": HELLO, "functions": [{"name": "f"}], "function_call": {"name": "g"}},
            "function_call",
            "no function named 'g'",
        ),
        (
            CHAT,
            {
                "messages": HELLO,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
            },
            "tools.0.function.parameters",
            "cannot constrain",
        ),
        (
            CHAT,
            {"messages": HELLO, "response_format": {"type": "xml"}},
            "response_format.type",
            "'text', 'json_object' or 'json_schema'",
        ),
        (CHAT, {"messages": HELLO, "logit_bias": {"5": 10}}, "logit_bias", "cannot honour"),
        (CHAT, {"messages": HELLO, "presence_penalty": 0.5}, "presence_penalty", "cannot honour"),
        (CHAT, {"messages": HELLO, "frequency_penalty": False}, "frequency_penalty", "cannot honour"),
        (CHAT, {"messages": HELLO, "modalities": ["text", "audio"]}, "modalities", "text only"),
        (
            CHAT,
            {"messages": [*HELLO, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            "messages.1.tool_calls.0.function",
            "required",
        ),
        (COMPLETIONS, {"prompt": "a", "best_of": 3}, "best_of", "one completion"),
        (COMPLETIONS, {"prompt": "a", "suffix": "end"}, "suffix", "middle"),
    ],
)
async def test_bad_requests_get_a_400_that_names_the_field(
    client: TestClient, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    status, error = await post(client, path, body)
    assert status == 400
    assert error["error"]["param"] == param
    assert error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]


async def test_a_model_whose_tokenizer_cannot_be_constrained_refuses_an_output_format(
    client: TestClient,
) -> None:
    # This checkpoint's character tokenizer decodes with a Fuse decoder, which llguidance cannot read.
    status, error = await post(client, CHAT, {"messages": HELLO, "response_format": {"type": "json_object"}})
    assert status == 400
    assert error["error"]["param"] == "response_format"
    assert "tokenizer cannot be constrained" in error["error"]["message"]


async def test_malformed_json_and_unknown_routes_get_openai_errors(client: TestClient) -> None:
    response = await client.post(CHAT, data=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert "not valid JSON" in (await response.json())["error"]["message"]
    response = await client.get("/v1/nothing")
    assert response.status == 404
    assert set((await response.json())["error"]) == {"message", "type", "param", "code"}
    assert "Stackpin-Stack" in response.headers
    response = await client.post(COMPLETIONS, json={"prompt": "a" * 2_000_000})
    assert response.status == 413
    assert "too large" in (await response.json())["error"]["message"].lower()


async def test_a_full_queue_answers_429(checkpoint: Path) -> None:
    app = create_app(settings(checkpoint, max_queue=0))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        response = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 1})
        body = await response.json()
        assert response.status == 429
        assert response.headers["Retry-After"] == "1"
        assert "queue is full" in body["error"]["message"]
        assert (await client.get("/healthz")).status == 200


async def test_metrics_export_the_documented_names(client: TestClient) -> None:
    await post(client, CHAT, {"messages": HELLO, "max_tokens": 2, "temperature": 0})
    text = await (await client.get("/metrics")).text()
    for name in [
        "stackpin_backend_info",
        "stackpin_backend_requests_total",
        "stackpin_backend_step_seconds",
        "stackpin_backend_batch_size",
        "stackpin_backend_tokens_total",
        "stackpin_backend_running_sequences",
        "stackpin_backend_queue_depth",
        "stackpin_backend_kv_cache_used_ratio",
    ]:
        assert name in text, f"{name} is missing from /metrics"
    assert 'stackpin_backend_requests_total{code="200",endpoint="/v1/chat/completions"} 1.0' in text
    assert 'kernel_mode="batch_invariant"' in text


async def test_the_openai_sdk_talks_to_it(client: TestClient) -> None:
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        completion = await sdk.chat.completions.create(
            model="random-qwen3", messages=HELLO, max_tokens=3, temperature=0, seed=1
        )
        assert completion.system_fingerprint is not None
        assert completion.choices[0].finish_reason == "length"
        assert completion.model_extra is not None
        assert len(completion.model_extra["stackpin"]["token_ids"]) == 3
        stream = await sdk.completions.create(model="random-qwen3", prompt="ab", max_tokens=2, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream]
        assert len(pieces) == 2
    finally:
        await sdk.close()


async def test_a_client_leaving_mid_stream_frees_its_place(client: TestClient) -> None:
    # Left alone, this prompt runs to all 200 tokens (no EOS on the way).
    body = {"prompt": "abc", "max_tokens": 200, "temperature": 0, "stream": True}
    response = await client.post(COMPLETIONS, json=body)
    assert (await response.content.readline()).startswith(b"data: ")
    response.close()
    status, _ = await post(client, COMPLETIONS, {"prompt": "abc", "max_tokens": 2})
    assert status == 200
    # The abandoned request leaves the batch at the engine's next step; wait for that step, however long.
    for _ in range(1000):
        text = await (await client.get("/metrics")).text()
        if "stackpin_backend_running_sequences 0.0" in text:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the abandoned request never left the running batch")
    decoded = [
        line for line in text.splitlines() if line.startswith('stackpin_backend_tokens_total{phase="decode"}')
    ]
    assert float(decoded[0].split()[-1]) < 150, "the abandoned request was decoded to the end"
