"""Specification of pinned_backend.tools: what a chat request's tool fields ask for, OpenAI's defaults, and the 400s
that name what contradicts itself."""

from __future__ import annotations

from typing import Any

import pytest

from pinned_backend.protocol import BadRequest, ChatRequest, parse_request
from pinned_backend.tools import NO_ARGUMENTS, ToolPlan, tool_plan

HELLO = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def plan(**fields: Any) -> ToolPlan | None:
    return tool_plan(parse_request(ChatRequest, {"messages": HELLO, **fields}))


def refused(**fields: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        plan(**fields)
    return caught.value


def test_tools_default_to_auto_and_parallel_calls_of_any_offered_function() -> None:
    offered = plan(tools=[WEATHER, TIME])
    assert offered is not None
    assert (offered.choice, offered.parallel, offered.legacy, offered.forced) == ("auto", True, False, False)
    assert [f.name for f in offered.callable] == ["get_weather", "get_time"]


def test_parameters_keep_the_key_order_a_record_keeps_whatever_the_clients() -> None:
    parameters = WEATHER["function"]["parameters"]
    reordered = {"required": ["city"], "properties": parameters["properties"], "type": "object"}
    mixed = plan(tools=[{"type": "function", "function": {**WEATHER["function"], "parameters": reordered}}])
    as_given = plan(tools=[WEATHER])
    assert mixed is not None and as_given is not None
    assert (
        list(mixed.functions[0].parameters)
        == list(as_given.functions[0].parameters)
        == [
            "properties",
            "required",
            "type",
        ]
    ), "a replay, sent in the record's key order, must render and constrain as the original did"


def test_a_function_without_parameters_takes_an_empty_object() -> None:
    offered = plan(tools=[TIME])
    assert offered is not None and offered.functions[0].parameters == NO_ARGUMENTS
    assert offered.functions[0].definition() == {"name": "get_time", "parameters": NO_ARGUMENTS}


def test_required_and_a_named_function_force_a_call_and_none_forbids_one() -> None:
    required = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required is not None and required.forced and not required.parallel
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named.forced and [f.name for f in named.callable] == ["get_time"]
    assert not named.parallel, "a named function is called once"
    none = plan(tools=[WEATHER], tool_choice="none")
    assert none is not None and none.callable == () and not none.forced


def test_no_tools_and_a_choice_that_asks_for_nothing_is_no_plan() -> None:
    assert plan() is None
    assert plan(tools=[], tool_choice="none") is None
    assert plan(tool_choice="auto") is None


def test_legacy_functions_answer_with_one_function_call() -> None:
    legacy = plan(functions=[WEATHER["function"]])
    assert legacy is not None and (legacy.choice, legacy.parallel, legacy.legacy) == ("auto", False, True)
    named = plan(functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert named is not None and named.choice == "get_weather" and named.forced
    assert legacy.functions[0].param == "functions.0"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions", "not both"),
        ({"tool_choice": "required"}, "tool_choice", "offers no tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
            "no function named 'get_time'",
        ),
        (
            {"functions": [WEATHER["function"]], "function_call": {"name": "x"}},
            "function_call",
            "'get_weather'",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "two functions"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
            "JSON object",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only tools of type 'function'"),
        (
            {"tool_choice": {"type": "custom", "function": {"name": "f"}}, "tools": [WEATHER]},
            "tool_choice.type",
            "only tools of type 'function'",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
    ],
)
def test_contradictions_and_unsupported_tools_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = refused(**fields)
    assert error.param == param
    assert words in error.message


def test_assistant_tool_calls_and_tool_results_are_accepted_in_the_conversation() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    request = parse_request(
        ChatRequest,
        {
            "messages": [
                *HELLO,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "function", "name": "get_weather", "content": "sunny"},
            ]
        },
    )
    assert request.messages[1].tool_calls is not None
    assert request.messages[1].tool_calls[0].function.name == "get_weather"
    assert request.messages[2].tool_call_id == "call_1"
