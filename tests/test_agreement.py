"""How far a replay agrees with its original: identical, the same tokens, the same text, the same tool calls and
JSON, or diverged; and a requirement on the share that agrees at least that well."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.endpoints import CHAT, EMBEDDINGS
from proxy.evidence.agreement import FAILED, Requirement, agreement, at_least, parse_requirement
from proxy.evidence.answers import view_of
from proxy.evidence.compare import compare


def chat(
    content: str | None, ids: list[int] | None = None, bits: float = -0.5, **message: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "finish_reason": "stop",
            }
        ],
        "usage": {"completion_tokens": 3},
    }
    if ids is not None:
        body["stackpin"] = {"token_ids": ids, "token_logprobs": [bits] * len(ids)}
    return body


def level(a: dict[str, Any], b: dict[str, Any], endpoint: str = CHAT) -> str:
    ours, theirs = view_of(endpoint, a), view_of(endpoint, b)
    return agreement(ours, theirs, compare(ours, theirs))


def call(arguments: str, name: str = "get_weather") -> dict[str, Any]:
    return {
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
        ]
    }


def test_each_level_is_the_strongest_that_holds() -> None:
    base = chat("Paris.", [1, 2])
    assert level(base, chat("Paris.", [1, 2])) == "identical"
    assert level(base, chat("Paris.", [1, 2], bits=-0.5000000000000001)) == "same_tokens"
    assert level(base, chat("Paris.", [1, 7])) == "same_text", "other token ids spelling the same text"
    other_usage = {**chat("Paris."), "usage": {"completion_tokens": 4}}
    assert level(chat("Paris."), other_usage) == "same_text", "no token ids: the text is what is known"
    assert level(base, chat("Lyon.", [1, 3])) == "diverged"


def test_tool_calls_and_json_content_agree_as_json_when_only_their_writing_differs() -> None:
    a = chat(None, **call('{"city": "Paris", "days": 3}'))
    assert level(a, chat(None, **call('{"days":3,"city":"Paris"}'))) == "same_json"
    assert level(a, chat(None, **call('{"city": "Paris", "days": 3.0}'))) == "same_json", (
        "3 and 3.0 are one number"
    )
    assert level(a, chat(None, **call('{"city": "Paris", "days": true}'))) == "diverged", "true is not 1"
    assert level(a, chat(None, **call('{"city": "Paris", "days": 3}', name="get_time"))) == "diverged"
    assert level(chat('{"a": [1, 2]}'), chat('{ "a": [1,2] }')) == "same_json"
    assert level(chat("not json {"), chat("not json  {")) == "diverged"


def test_embeddings_are_identical_or_diverged() -> None:
    one = {"data": [{"index": 0, "embedding": [0.5, 0.25]}]}
    other = {"data": [{"index": 0, "embedding": [0.5, 0.2500001]}]}
    assert level(one, one, EMBEDDINGS) == "identical"
    assert level(one, other, EMBEDDINGS) == "diverged"


def test_a_requirement_counts_every_replay_that_agrees_at_least_as_well_failures_against_it() -> None:
    counts = {"identical": 96, "same_tokens": 2, "same_text": 1, FAILED: 1}
    assert at_least(counts, "identical") == 0.96 and at_least(counts, "same_text") == 0.99
    assert at_least({}, "identical") is None
    assert Requirement("same_tokens", 0.98).met(counts) and not Requirement("identical", 0.999).met(counts)
    assert not Requirement("identical", 0.0).met({}), "nothing replayed meets nothing"


@pytest.mark.parametrize(
    ("text", "wanted"),
    [("identical>=0.999", Requirement("identical", 0.999)), ("same_text >= 99%", Requirement("same_text", 0.99)),
     ("same_json>=1", Requirement("same_json", 1.0)), ("same_tokens>=.5", Requirement("same_tokens", 0.5))],
)  # fmt: skip
def test_requirements_are_written_level_and_share(text: str, wanted: Requirement) -> None:
    assert parse_requirement(text) == wanted
    assert str(wanted) == f"{wanted.level}>={wanted.share:g}"


@pytest.mark.parametrize(
    "text", ["identical", "identical>1.0", "diverged>=0.5", "same>=0.9", "identical>=1.5", "identical>=120%"]
)
def test_a_requirement_written_otherwise_says_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match="requirement"):
        parse_requirement(text)
