"""Tools end to end: the official OpenAI SDK, through the proxy, to a pinned_backend serving the embedded default model
(SmolLM2-135M-Instruct, whose chat template knows nothing of tools, so the generic format is used). A call, the
function's result as a `tool` message, then the final answer, with `tool_choice` `required` and `auto`, streamed
and not; a named function; the legacy `functions`; the Responses API with a function tool and with `text.format`.
Every call's arguments parse and validate against their function's schema. In `batch_invariant` mode a tool-call
answer is the same to the bit, tokens and logprobs, alone and amid other requests, and its replay reproduces it.

The embedded default (`stackpin serve`, one process for the session, shared with the other modules that need it)
serves every test. The model is small: a prompt that asks for the tag gets it to call under `auto`, and `parallel_tool_calls` is off
where one call is wanted, since left free it repeats its call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("torch")

MODEL = "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": CITY},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time in a city", "parameters": CITY},
}
ASK = [{"role": "user", "content": "Reply with a <tool_call> block that calls get_weather for Paris."}]
RESULT = "Sunny, 24 C"
CALL_TOKENS = 40  # a call of get_weather in the generic format is about 30 tokens of SmolLM2's
ANSWER_TOKENS = 6  # the final answer only has to be one


Served = tuple[str, Path, dict[str, str]]


@pytest.fixture
def proxy(embedded_default: Served) -> str:
    return embedded_default[0]


def sdk(proxy: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key="unused-on-loopback", max_retries=0)


async def post(proxy: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], httpx.Headers]:
    async with httpx.AsyncClient(timeout=600) as client:
        response = await client.post(proxy + path, json=body)
    return response.status_code, response.json(), response.headers


async def answer(client: openai.AsyncOpenAI, stream: bool, **fields: Any) -> Any:
    """Choice 0 of a chat answer; streamed, as the SDK's own stream helper assembles it (its snapshot: the final
    completion it also offers refuses an answer cut at max_tokens, which a short final answer is)."""
    if not stream:
        return (await client.chat.completions.create(model=MODEL, temperature=0, **fields)).choices[0]
    async with client.chat.completions.stream(model=MODEL, temperature=0, **fields) as events:
        async for _ in events:
            pass
        return events.current_completion_snapshot.choices[0]


def checked(name: str, arguments: str) -> dict[str, Any]:
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, {"get_weather": CITY, "get_time": CITY}[name])
    return dict(parsed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "auto"])
async def test_a_call_its_result_then_the_final_answer(proxy: str, choice: str, stream: bool) -> None:
    client = sdk(proxy)
    tools = {"tools": [WEATHER], "parallel_tool_calls": False}
    first = await answer(client, stream, messages=ASK, tool_choice=choice, max_tokens=CALL_TOKENS, **tools)
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None, "an answer of calls only has no content"
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert checked(call.function.name, call.function.arguments) == {"city": "Paris"}
    called = first.message.model_dump(exclude_none=True, exclude={"parsed"})
    conversation = [*ASK, called, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = await answer(
        client, stream, messages=conversation, tool_choice="auto", max_tokens=ANSWER_TOKENS, **tools
    )
    assert final.finish_reason in ("stop", "length")
    assert isinstance(final.message.content, str) and final.message.content
    assert not final.message.tool_calls


async def test_a_named_function_is_the_one_called(proxy: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    first = await answer(
        sdk(proxy),
        False,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=CALL_TOKENS,
    )
    (call,) = first.message.tool_calls
    assert call.function.name == "get_time"
    checked(call.function.name, call.function.arguments)


async def test_legacy_functions_call_then_answer(proxy: str) -> None:
    client = sdk(proxy)
    functions = {"functions": [WEATHER["function"]]}
    first = await answer(
        client,
        False,
        messages=ASK,
        function_call={"name": "get_weather"},
        max_tokens=CALL_TOKENS,
        **functions,
    )
    assert first.finish_reason == "function_call" and not first.message.tool_calls
    call = first.message.function_call
    checked(call.name, call.arguments)
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": call.name, "arguments": call.arguments},
        },
        {"role": "function", "name": call.name, "content": RESULT},
    ]
    final = await answer(client, False, messages=conversation, max_tokens=ANSWER_TOKENS, **functions)
    assert isinstance(final.message.content, str) and final.message.content


async def test_the_responses_api_calls_a_function_tool_and_takes_its_output(proxy: str) -> None:
    client = sdk(proxy)
    tool = {"type": "function", **WEATHER["function"]}
    response = await client.responses.create(
        model=MODEL,
        input=ASK[0]["content"],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=CALL_TOKENS,
        temperature=0,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert checked(call.name, call.arguments) == {"city": "Paris"}
    final = await client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=ANSWER_TOKENS,
        temperature=0,
    )
    assert final.output_text and not [item for item in final.output if item.type == "function_call"]


async def test_the_responses_api_honours_text_format_and_names_it_when_it_cannot(proxy: str) -> None:
    client = sdk(proxy)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "country": {"type": "string", "maxLength": 16},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    response = await client.responses.create(
        model=MODEL,
        input="Name a city in France and its country.",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        max_output_tokens=32,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model=MODEL,
            input="Anything.",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"not": {"type": "string"}}}},
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "text.format.schema", (
        "the client's field, not chat's"
    )
    assert "response_format" not in error["message"]


async def test_in_batch_invariant_mode_a_tool_call_is_bit_identical_alone_amid_load_and_replayed(
    proxy: str,
) -> None:
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": CALL_TOKENS,
        "temperature": 0,
        "logprobs": True,
    }
    load = [
        {
            **body,
            "messages": [
                {"role": "user", "content": "Reply with a <tool_call> block that calls get_weather for Oslo."}
            ],
        },
        {**body, "tools": [WEATHER, TIME], "tool_choice": "auto"},
        {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 24},
    ]
    status, alone, headers = await post(proxy, "/v1/chat/completions", body)
    assert status == 200 and alone["choices"][0]["finish_reason"] == "tool_calls"
    answers = await asyncio.gather(*(post(proxy, "/v1/chat/completions", b) for b in [body, *load]))
    amid = answers[0][1]
    assert amid["stackpin"]["batch"]["max"] > 1, "the answer was computed amid other requests"
    assert amid["stackpin"]["token_ids"] == alone["stackpin"]["token_ids"], (
        "the same tokens alone and amid load"
    )
    assert amid["stackpin"]["token_logprobs"] == alone["stackpin"]["token_logprobs"], (
        "and the same logprob bits"
    )
    assert amid["choices"][0]["message"] == alone["choices"][0]["message"], "the same call, id included"
    # The record keeps the request with its keys in RFC 8785's order, not the client's; the replay must not care.
    status, replayed, _ = await post(proxy, f"/v1/records/{headers['Stackpin-Record']}/replay", {})
    assert status == 200 and replayed["outcome"] == "reproduced", replayed
