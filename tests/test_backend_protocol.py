"""Specification of pinned_backend.protocol: what requests are accepted, and the 400s that name what to fix."""

from __future__ import annotations

from typing import Any

import pytest

from pinned_backend.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    Overloaded,
    parse_request,
)

HELLO = [{"role": "user", "content": "hi"}]


def bad(model: type[ChatRequest] | type[CompletionRequest], body: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        parse_request(model, body)
    return caught.value


def test_content_parts_are_joined_and_unknown_fields_ignored() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        "presence_penalty": 0.5,
        "user": "someone",
    }
    request = parse_request(ChatRequest, body)
    assert request.messages[0].text() == "ab"


def test_integers_are_numbers_but_strings_and_booleans_are_not() -> None:
    assert parse_request(ChatRequest, {"messages": HELLO, "temperature": 1}).temperature == 1.0
    assert bad(ChatRequest, {"messages": HELLO, "temperature": "1"}).param == "temperature"
    assert bad(ChatRequest, {"messages": HELLO, "max_tokens": True}).param == "max_tokens"


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = parse_request(ChatRequest, {"messages": HELLO, "max_tokens": 5, "max_completion_tokens": 7})
    assert request.requested_max_tokens() == 7


def test_completion_defaults_follow_openai() -> None:
    request = parse_request(CompletionRequest, {"prompt": "x"})
    assert request.requested_max_tokens() == 16
    assert request.temperature == 1.0
    assert request.top_logprob_count() == 0


def test_errors_name_the_field_without_union_branches() -> None:
    error = bad(ChatRequest, {"messages": [{"role": "user", "content": 3}]})
    assert error.param == "messages.0.content"
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": HELLO, "n": 3}, "n", "only n = 1"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "Input should be"),
        ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"messages": HELLO, "top_p": 0}, "top_p", "greater than 0"),
        ({"messages": HELLO, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ],
)
def test_out_of_range_values_are_refused(body: dict[str, Any], param: str, words: str) -> None:
    error = bad(ChatRequest, body)
    assert error.param == param
    assert words in error.message


def test_completions_refuse_echo_and_several_prompts() -> None:
    assert "echo is not supported" in bad(CompletionRequest, {"prompt": "a", "echo": True}).message
    assert bad(CompletionRequest, {"prompt": ["a", "b"]}).param == "prompt"


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert "JSON object" in bad(ChatRequest, [1, 2]).message


def test_overloaded_is_a_429_rate_limit_error() -> None:
    body = Overloaded("queue is full").body()
    assert Overloaded.status == 429
    assert body == {
        "error": {"message": "queue is full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }
