"""Replay comparison: every part of an answer compared exactly (tokens and logprob bits, each choice's content,
tool calls, refusal, finish reason, logprobs, the number of choices, usage, a stream's events), and the first
difference named by its part, its field and its position, with both continuations."""

from __future__ import annotations

import json
from typing import Any

from proxy.endpoints import CHAT, EMBEDDINGS, RESPONSES
from proxy.evidence.answers import view_of
from proxy.evidence.compare import compare, where
from proxy.serving.relay import sse


def chat(
    *contents: str | None, ids: list[int] | None = None, logprobs: list[float] | None = None, **extra: Any
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": c},
            "finish_reason": "stop",
            "logprobs": None,
        }
        for i, c in enumerate(contents)
    ]
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "created": 1,
        "choices": choices,
        "usage": {"completion_tokens": 3},
    }
    if ids is not None:
        body["stackpin"] = {"token_ids": ids, "token_logprobs": logprobs or [0.0] * len(ids)}
    return {**body, **extra}


def with_tool_call(body: dict[str, Any], arguments: str, name: str = "weather") -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    call = {"id": "call_abc", "type": "function", "function": {"name": name, "arguments": arguments}}
    body["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    return body


def outcome(
    a: dict[str, Any],
    b: dict[str, Any],
    endpoint: str = CHAT,
    events: tuple[list[str], list[str]] | None = None,
) -> Any:
    return compare(view_of(endpoint, a), view_of(endpoint, b), *(events or (None, None)))


def test_identical_answers_reproduce_whatever_their_ids_clocks_and_stack_name() -> None:
    a = chat("a b c", ids=[1, 2, 3], logprobs=[-0.5, -1.0, -2.0])
    b = {**a, "id": "chatcmpl-2", "created": 99, "system_fingerprint": "other"}
    result = outcome(a, b)
    assert (result.outcome, result.compared) == ("reproduced", "tokens")


def test_a_last_bit_difference_in_a_logprob_is_divergence_at_that_token() -> None:
    nudged = -1.0000000000000002
    result = outcome(chat("a b c", ids=[1, 2, 3], logprobs=[-0.5, -1.0, -2.0]),
                     chat("a b c", ids=[1, 2, 3], logprobs=[-0.5, nudged, -2.0]))  # fmt: skip
    assert (result.outcome, result.field, result.position, result.reason) == (
        "diverged",
        "tokens",
        1,
        "logprob",
    )
    assert result.original_logprob == (-1.0).hex() and result.part == "choice 0"
    assert where(result.as_json()) == "token 1 of choice 0"


def test_the_two_zeros_are_one_because_the_canonical_record_cannot_keep_them_apart() -> None:
    assert (
        outcome(chat("a", ids=[1], logprobs=[0.0]), chat("a", ids=[1], logprobs=[-0.0])).outcome
        == "reproduced"
    )
    assert (
        outcome(chat("a", ids=[1], logprobs=[-1]), chat("a", ids=[1], logprobs=[-1.0])).outcome
        == "reproduced"
    )


def test_a_different_token_and_a_shorter_answer() -> None:
    result = outcome(chat("a b c", ids=[1, 2, 3]), chat("a z c", ids=[1, 9, 3]))
    assert (result.position, result.reason, result.original, result.replayed) == (1, "token", "b c", "z c")
    assert outcome(chat("a b", ids=[1, 2]), chat("a b c", ids=[1, 2, 3])).reason == "length"


def test_changed_tool_call_arguments_diverge_at_their_first_differing_character() -> None:
    base = chat(None, ids=[1, 2])
    result = outcome(with_tool_call(base, '{"city": "Paris"}'), with_tool_call(base, '{"city": "Perth"}'))
    assert result.outcome == "diverged" and result.compared == "tokens"
    assert (result.part, result.field, result.position) == (
        "choice 0",
        "message.tool_calls[0].function.arguments",
        11,
    )
    assert (result.original, result.replayed) == ('aris"}', 'erth"}')
    assert outcome(with_tool_call(base, "{}"), with_tool_call(base, "{}", name="time")).field == (
        "message.tool_calls[0].function.name"
    )


def test_a_tool_calls_id_is_a_handle_and_is_not_compared() -> None:
    a = with_tool_call(chat(None), "{}")
    b = json.loads(json.dumps(a))
    b["choices"][0]["message"]["tool_calls"][0]["id"] = "call_xyz"
    assert outcome(a, b).outcome == "reproduced"


def test_a_later_choice_the_number_of_choices_refusal_and_finish_reason_are_compared() -> None:
    result = outcome(chat("same", "first"), chat("same", "fir5t"))
    assert (result.part, result.choice, result.field, result.position) == (
        "choice 1",
        1,
        "message.content",
        3,
    )
    result = outcome(chat("same", "first"), chat("same"))
    assert (result.field, result.reason, result.position) == ("choices", "count", 1)
    refused = chat("x")
    refused["choices"][0]["message"]["refusal"] = "I cannot"
    assert outcome(chat("x"), refused).field == "message.refusal"
    stopped = chat("x")
    stopped["choices"][0]["finish_reason"] = "length"
    assert outcome(chat("x"), stopped).field == "finish_reason"


def test_usage_and_the_legacy_function_call_are_compared() -> None:
    assert outcome(chat("x"), chat("x", usage={"completion_tokens": 4})).field == "usage.completion_tokens"
    legacy = chat(None)
    legacy["choices"][0]["message"]["function_call"] = {"name": "f", "arguments": "{}"}
    assert outcome(chat(None), legacy).reason == "missing"


def test_without_token_ids_every_field_is_compared_and_the_result_says_so() -> None:
    result = outcome(chat("hello world"), chat("hello there"))
    assert (result.outcome, result.compared, result.position) == ("diverged", "answer", 6)
    assert "field message.content, character 6" in where(result.as_json())


def test_an_embedding_diverges_at_the_component_that_changed_in_its_last_bit() -> None:
    def vectors(*vs: list[float]) -> dict[str, Any]:
        return {
            "data": [{"index": i, "embedding": v} for i, v in enumerate(vs)],
            "usage": {"prompt_tokens": 2},
        }

    nudged = float.fromhex((0.25).hex().replace("0000000000000p", "0000000000001p"))
    result = outcome(vectors([0.5, 0.5], [0.75, 0.25]), vectors([0.5, 0.5], [0.75, nudged]), EMBEDDINGS)
    assert (result.part, result.field, result.position, result.reason) == ("data[1]", "embedding", 1, "value")
    assert result.original_bits == (0.25).hex() != result.replayed_bits


def test_a_response_is_compared_item_by_item_and_by_status() -> None:
    def response(text: str, status: str = "completed") -> dict[str, Any]:
        item = {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": text}]}
        return {"id": "resp_1", "created_at": 1, "status": status, "output": [item]}

    result = outcome(response("sea"), response("see"), RESPONSES)
    assert (result.part, result.field, result.position) == ("output[0]", "content[0].text", 2)
    assert outcome(response("sea"), response("sea", "incomplete"), RESPONSES).field == "status"
    assert outcome(response("sea"), {**response("sea"), "id": "resp_2"}, RESPONSES).outcome == "reproduced"


def test_a_stream_whose_answer_agrees_still_diverges_where_its_events_split_otherwise() -> None:
    def events(*pieces: str) -> list[str]:
        chunks = [
            {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces
        ]
        return [sse(None, c) for c in chunks]

    body = chat("a bc")
    result = outcome(body, body, events=(events("a ", "b", "c"), events("a ", "bc")))
    assert (result.event, result.field, result.position) == (1, "choices[0].delta.content", 1)
    assert (result.original, result.replayed) == ("", "c")
    result = outcome(body, body, events=(events("a ", "b", "c"), events("a ", "b", "c", "")))
    assert (result.field, result.reason, result.event) == ("events", "count", 3)
    volatile = [sse(None, {**json.loads(e[6:]), "id": "other", "obfuscation": "xyz"}) for e in events("a ")]
    assert outcome(body, body, events=(events("a "), volatile)).outcome == "reproduced"
