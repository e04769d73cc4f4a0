"""Specification of pinned_backend.tool_calls: an answer's text read into OpenAI's message and stream deltas, the
same whatever pieces the text arrives in, with ids that a replay reproduces."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pinned_backend.tool_calls import CallReader, call_id
from pinned_backend.tool_format import SEPARATOR, call_text

PROMPT = [1, 2, 3]
WEATHER = call_text("get_weather", '{"city": "Paris", "days": {"from": 1}}')
TIME = call_text("get_time", "{}")
ANSWERS = [
    "Plain text, no call at all.\n",
    WEATHER,
    WEATHER + SEPARATOR + TIME,
    "Let me look that up. \n" + WEATHER,
    "text that mentions <tool but no call",
]


def joined(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client assembles from the deltas, as the OpenAI SDK does."""
    message: dict[str, Any] = {"content": None, "tool_calls": {}}
    for delta in deltas:
        if "content" in delta:
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            built = message["tool_calls"].setdefault(call["index"], {"function": {"arguments": ""}})
            built.update({k: call[k] for k in ("id", "type") if k in call})
            if "name" in call["function"]:
                built["function"]["name"] = call["function"]["name"]
            built["function"]["arguments"] += call["function"]["arguments"]
    return {
        "content": message["content"],
        "tool_calls": [message["tool_calls"][i] for i in sorted(message["tool_calls"])],
    }


def read_whole(text: str, legacy: bool = False, seed: int | None = None) -> CallReader:
    reader = CallReader(PROMPT, seed, legacy)
    reader.feed(text, end=True)
    return reader


@given(st.sampled_from(ANSWERS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_a_stream_in_any_pieces_assembles_into_the_whole_message(text: str, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    reader = CallReader(PROMPT, None, legacy=False)
    deltas = [reader.feed(piece, end=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    whole = read_whole(text).message()
    streamed = joined(deltas)
    assert streamed["content"] == whole["content"]
    assert streamed["tool_calls"] == whole.get("tool_calls", [])


def test_an_answer_of_calls_only_has_null_content_and_finishes_with_tool_calls() -> None:
    reader = read_whole(WEATHER + SEPARATOR + TIME)
    message = reader.message()
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": {"from": 1}}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert reader.finish_reason("stop") == "tool_calls"
    assert reader.finish_reason("length") == "length", "a cut answer says so"


def test_text_before_a_call_is_the_content_without_the_space_before_the_tag() -> None:
    message = read_whole("Let me look that up. \n" + WEATHER).message()
    assert message["content"] == "Let me look that up."
    assert len(message["tool_calls"]) == 1


def test_plain_text_stays_content_exactly_and_finishes_as_the_engine_said() -> None:
    reader = read_whole("text that mentions <tool but no call  ")
    assert reader.message() == {"role": "assistant", "content": "text that mentions <tool but no call  "}
    assert reader.finish_reason("stop") == "stop"


def test_the_first_delta_of_a_call_names_it_and_the_arguments_follow_in_fragments() -> None:
    reader = CallReader(PROMPT, None, legacy=False)
    opened = reader.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert opened == {
        "tool_calls": [
            {
                "index": 0,
                "id": call_id(PROMPT, None, 0),
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert reader.feed('{"city": "Paris"}') == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]
    }
    assert reader.feed("}") == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}, (
        "a closing brace is held back only while it may be the call's own"
    )
    assert reader.feed("\n</tool_call>", end=True) == {}


def test_a_call_cut_short_keeps_the_arguments_it_has() -> None:
    reader = read_whole('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert reader.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'


def test_a_call_cut_inside_its_framing_keeps_its_arguments_without_it() -> None:
    start = '<tool_call>\n{"name": "get_weather", "arguments": '
    for framing in ("}", "}\n", "}\n</tool_call"):
        reader = read_whole(start + '{"city": "Paris"}' + framing)
        assert reader.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    reader = read_whole(start + '{"days": {"from": 1}' + "}")
    assert reader.message()["tool_calls"][0]["function"]["arguments"] == '{"days": {"from": 1}}', (
        "a brace the arguments need is theirs"
    )


def test_legacy_functions_get_one_function_call() -> None:
    reader = CallReader(PROMPT, None, legacy=True)
    cut = WEATHER.index('"arguments": ') + len('"arguments": ')
    deltas = [reader.feed(WEATHER[:cut]), reader.feed(WEATHER[cut:], end=True)]
    assert deltas[0] == {"function_call": {"name": "get_weather", "arguments": ""}}
    assert "function_call" in deltas[1] and "tool_calls" not in deltas[1]
    message = reader.message()
    assert message["function_call"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "days": {"from": 1}}',
    }
    assert "tool_calls" not in message
    assert reader.finish_reason("stop") == "function_call"


def test_ids_derive_from_what_the_record_keeps() -> None:
    ids = [c["id"] for c in read_whole(WEATHER + SEPARATOR + TIME, seed=7).message()["tool_calls"]]
    again = [c["id"] for c in read_whole(WEATHER + SEPARATOR + TIME, seed=7).message()["tool_calls"]]
    assert ids == again == [call_id(PROMPT, 7, 0), call_id(PROMPT, 7, 1)], "the same inputs give the same ids"
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert call_id(PROMPT, 8, 0) != ids[0] and call_id([1, 2], 7, 0) != ids[0], (
        "another seed or prompt, another id"
    )
