"""The backend's chat route with tools, on a random checkpoint with a byte-level tokenizer: whatever the weights
draw, a forced answer is well-formed calls whose arguments validate against their function's schema, in OpenAI's
shapes (tool_calls or the legacy function_call, ids, finish reasons), and a stream's deltas assemble into the
whole answer's message, bit for bit the same answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pinned_backend.runtime import BackendSettings
from pinned_backend.server import create_app
from tests.support.backend_checkpoint import SMALL_CONFIG, write_random_checkpoint

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Weather?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": {"type": "object", "additionalProperties": False}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A byte-level tokenizer spends a token per byte of the tools block: a longer context than the small config's.
    config = {**SMALL_CONFIG, "max_position_embeddings": 2048}
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tools") / "bytes", with_tokenizer="bytes", config=config
    )


@pytest.fixture
async def client(checkpoint: Path) -> AsyncIterator[TestClient]:
    settings = BackendSettings(model=checkpoint, kv_cache_mb=4, max_step_tokens=1024)
    async with TestClient(TestServer(create_app(settings), host="127.0.0.1")) as c:
        yield c


async def chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = await client.post(
        CHAT, json={"messages": HELLO, "temperature": 0, "max_tokens": 300, **fields}
    )
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def chunks(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    body = {"messages": HELLO, "temperature": 0, "max_tokens": 300, "stream": True, **fields}
    response = await client.post(CHAT, json=body)
    assert response.status == 200
    lines = [line for line in (await response.text()).split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def assembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client assembles from a stream's deltas, as the OpenAI SDK does."""
    message: dict[str, Any] = {"role": None, "content": None}
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        delta = event["choices"][0]["delta"]
        message["role"] = delta.get("role", message["role"])
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            built = calls.setdefault(call["index"], {"function": {"arguments": ""}})
            built.update({k: call[k] for k in ("id", "type") if k in call})
            built["function"]["name"] = call["function"].get("name", built["function"].get("name"))
            built["function"]["arguments"] += call["function"]["arguments"]
        if "function_call" in delta:
            legacy = message.setdefault("function_call", {"arguments": ""})
            legacy.update({k: v for k, v in delta["function_call"].items() if k == "name"})
            legacy["arguments"] += delta["function_call"]["arguments"]
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def valid_calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


async def test_required_is_calls_only_whose_arguments_validate(client: TestClient) -> None:
    body = await chat(client, tools=[WEATHER, TIME], tool_choice="required")
    choice = body["choices"][0]
    assert choice["message"]["content"] is None, "an answer of calls only has no content"
    if choice["finish_reason"] == "tool_calls":
        assert valid_calls(choice["message"])
    else:  # the random weights may call again and again; every call but a cut last one is whole
        assert choice["finish_reason"] == "length"
        whole = {**choice["message"], "tool_calls": choice["message"]["tool_calls"][:-1]}
        assert whole["tool_calls"] and valid_calls(whole)
    ids = [call["id"] for call in choice["message"]["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


async def test_without_parallel_calls_a_forced_answer_is_one_call_then_the_end(client: TestClient) -> None:
    body = await chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert len(valid_calls(choice["message"])) == 1
    assert body["stackpin"]["token_ids"], "the tokens of the call are reported as any answer's"


async def test_a_named_function_is_the_one_called(client: TestClient) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    body = await chat(client, tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=False)
    assert valid_calls(body["choices"][0]["message"]) == [("get_time", {})]


async def test_a_stream_assembles_into_the_whole_answer(client: TestClient) -> None:
    fields = {
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "logprobs": True,
    }
    whole, events = await chat(client, **fields), await chunks(client, **fields)
    message = whole["choices"][0]["message"]
    assert assembled(events) == message
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "tool_calls"
    opening = next(e["choices"][0]["delta"]["tool_calls"][0] for e in events[1:] if e["choices"][0]["delta"])
    assert set(opening) == {"index", "id", "type", "function"} and opening["function"]["arguments"] == ""
    streamed = [i for e in events for i in e["stackpin"]["token_ids"]]
    assert streamed == whole["stackpin"]["token_ids"], "the same answer, streamed or not"
    bits = [lp for e in events for lp in e["stackpin"]["token_logprobs"]]
    assert bits == whole["stackpin"]["token_logprobs"]


async def test_legacy_functions_answer_with_a_function_call(client: TestClient) -> None:
    fields = {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    body, events = await chat(client, **fields), await chunks(client, **fields)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert "tool_calls" not in choice["message"]
    jsonschema.validate(json.loads(choice["message"]["function_call"]["arguments"]), WEATHER_PARAMETERS)
    assert assembled(events)["function_call"] == choice["message"]["function_call"]


async def test_the_same_request_gets_the_same_call_ids(client: TestClient) -> None:
    fields = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    first, second = await chat(client, **fields), await chat(client, **fields)
    assert (
        first["choices"][0]["message"]["tool_calls"][0]["id"]
        == second["choices"][0]["message"]["tool_calls"][0]["id"]
    )
    other = await chat(client, **fields, messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert (
        other["choices"][0]["message"]["tool_calls"][0]["id"]
        != first["choices"][0]["message"]["tool_calls"][0]["id"]
    )


async def test_auto_with_a_response_format_answers_that_json_or_calls(client: TestClient) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    body = await chat(
        client,
        tools=[WEATHER],
        parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
    )
    message = body["choices"][0]["message"]
    if message.get("tool_calls"):
        assert valid_calls(message) and message["content"] is None
    else:
        jsonschema.validate(json.loads(message["content"]), schema)


async def test_a_conversation_with_calls_and_results_is_served(client: TestClient) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    messages = [
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    body = await chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert (
        body["choices"][0]["finish_reason"] == "length" and "tool_calls" not in body["choices"][0]["message"]
    )
    assert isinstance(body["choices"][0]["message"]["content"], str)
