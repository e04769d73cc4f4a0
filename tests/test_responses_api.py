"""The Responses API over chat: requests translated field by field (or refused, naming the field), chat answers
and streams translated back with OpenAI's names and order, and `previous_response_id` expanded into the input it
stands for."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import BadRequest
from proxy.serving.responses_api import (
    Echo,
    ResponsesStream,
    expand,
    from_chat,
    record_of,
    response_id,
    responses_error,
    to_chat,
)

RECORD = "rec_" + "ab" * 16
ECHO = Echo(response_id(RECORD), 1700000000, {"model": "m", "input": "hi"}, None)


def test_a_responses_id_is_its_records_and_leads_back_to_it() -> None:
    assert response_id(RECORD) == "resp_" + "ab" * 16
    assert record_of(response_id(RECORD)) == RECORD
    with pytest.raises(BadRequest) as raised:
        record_of("resp_from_somewhere_else")
    assert raised.value.param == "previous_response_id"


def test_instructions_text_input_items_and_settings_become_a_chat_request() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Oslo?"},
                ],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It rains."}],
            },
        ],
        "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "weather"},
        "max_output_tokens": 20,
        "temperature": 0,
        "top_k": 5,
        "store": True,
        "metadata": {"who": "test"},
        "stream": True,
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
    ]  # fmt: skip
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert (chat["max_completion_tokens"], chat["temperature"], chat["top_k"]) == (20, 0, 5)
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "store" not in chat and "metadata" not in chat and "input" not in chat


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
    ],
)
def test_what_has_no_chat_equivalent_is_refused_naming_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        to_chat({"model": "m", "input": "hi", **extra})
    assert raised.value.param == param


def test_a_text_format_and_logprobs_are_asked_of_the_replica_not_dropped() -> None:
    fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}}
    chat = to_chat({"model": "m", "input": "hi", "text": {"format": fmt}, "top_logprobs": 2})
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)


@pytest.mark.parametrize(
    ("chat_param", "param"),
    [
        ("response_format", "text.format"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("max_completion_tokens", "max_output_tokens"),
        ("tools.2.function.parameters", "tools[2].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("messages.3.content", "input"),
        ("temperature", "temperature"),
    ],
)
def test_a_replicas_refusal_of_the_chat_request_names_the_clients_field(chat_param: str, param: str) -> None:
    refusal = {"error": {"message": f"{chat_param}: cannot honour it", "type": "invalid_request_error",
                         "param": chat_param, "code": "invalid_request"}}  # fmt: skip
    error = responses_error(refusal)["error"]
    assert (error["param"], error["message"]) == (param, f"{param}: cannot honour it")
    assert error["type"] == "invalid_request_error"
    assert responses_error({"error": {"message": "no param"}}) == {"error": {"message": "no param"}}


def chat_answer(
    content: str | None, finish: str = "stop", calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }


def test_a_chat_answer_becomes_a_response_with_its_items_status_and_usage() -> None:
    response = from_chat(chat_answer("The sea."), ECHO)
    assert (response["id"], response["object"], response["status"]) == (ECHO.id, "response", "completed")
    assert response["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "The sea.",
        "annotations": [],
        "logprobs": [],
    }
    assert response["usage"]["input_tokens"] == 4 and response["usage"]["output_tokens"] == 2
    cut = from_chat(chat_answer("The", "length"), ECHO)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    call = {"id": "call_9", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    called = from_chat(chat_answer(None, "tool_calls", [call]), ECHO)
    assert [(i["type"], i.get("call_id"), i.get("name")) for i in called["output"]] == [
        ("function_call", "call_9", "weather")
    ]


def stream_chunks(*pieces: dict[str, Any], finish: str = "stop") -> list[dict[str, Any]]:
    chunks = [{"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"model": "m", "choices": [{"index": 0, "delta": p}]} for p in pieces]
    chunks.append({"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append(
        {
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        }
    )
    return chunks


def translate(chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    stream = ResponsesStream(ECHO)
    events = [event for c in chunks for event in stream.feed(c)]
    return events + stream.finish()


def test_a_chat_stream_becomes_openais_events_in_openais_order() -> None:
    events = translate(stream_chunks({"content": "The"}, {"content": " sea."}))
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress"
    assert events[6][1]["text"] == "The sea."
    final = events[-1][1]["response"]
    assert final == from_chat({**stream_chunks()[0], "choices": [{"index": 0, "message": {"role": "assistant", "content": "The sea."},
                                                                  "finish_reason": "stop", "logprobs": None}],
                               "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}, ECHO)  # fmt: skip


def test_a_streamed_tool_call_becomes_a_function_call_item_with_its_argument_deltas() -> None:
    head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}
    events = translate(
        stream_chunks(
            {"tool_calls": [head]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]},
            finish="tool_calls",
        )
    )
    names = [name for name, _ in events]
    assert names[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-3][1]["arguments"] == '{"city": "Oslo"}'
    assert events[-1][1]["response"]["output"][0]["call_id"] == "call_1"


def test_previous_response_id_expands_into_the_previous_input_its_output_and_the_new_input() -> None:
    previous_request = {"model": "m", "instructions": "Old.", "input": "Hello"}
    previous_response = {
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]}
        ]
    }
    body = {"model": "m", "input": "And then?", "previous_response_id": "resp_x", "instructions": "New."}
    expanded = expand(body, previous_request, previous_response)
    assert "previous_response_id" not in expanded and expanded["instructions"] == "New."
    assert expanded["input"] == [
        {"type": "message", "role": "user", "content": "Hello"},
        previous_response["output"][0],
        {"type": "message", "role": "user", "content": "And then?"},
    ]
    assert [m["content"] for m in to_chat(expanded)["messages"]] == ["New.", "Hello", "Hi!", "And then?"]
