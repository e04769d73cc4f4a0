"""Reading answers: a stream assembled choice by choice into the body a whole answer would have been (tool-call
deltas merged by their index), and answers reduced to what a replay compares."""

from __future__ import annotations

import base64
import struct
from typing import Any

from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from proxy.evidence.answers import ChunkAssembly, ResponseAssembly, merge, seed_of, steady_event, view_of
from proxy.serving.relay import sse


def chunk(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "choices": list(choices),
        **extra,
    }


def test_tool_call_deltas_merge_by_their_index_into_whole_calls() -> None:
    assembly = ChunkAssembly(CHAT)
    head = [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "weather", "arguments": ""}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "time", "arguments": '{"tz"'}},
    ]
    assembly.add(chunk({"index": 0, "delta": {"role": "assistant", "content": None, "tool_calls": head}}))
    for piece in ('{"ci', 'ty": ', '"Oslo"}'):
        assembly.add(
            chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}})
        )
    assembly.add(
        chunk({"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": ': "UTC"}'}}]}})
    )
    assembly.add(chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}))
    message = assembly.body()["choices"][0]["message"]
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("call_a", "weather", '{"city": "Oslo"}'), ("call_b", "time", '{"tz": "UTC"}')]
    assert message["role"] == "assistant" and message["content"] is None
    assert assembly.body()["choices"][0]["finish_reason"] == "tool_calls"


def test_two_fragments_of_one_call_in_one_chunk_are_merged_too() -> None:
    message: dict[str, Any] = {}
    fragments = [
        {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}},
        {"index": 0, "function": {"arguments": "}"}},
    ]
    merge(message, {"tool_calls": fragments})
    assert message["tool_calls"] == [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]


def test_each_choice_of_a_stream_is_assembled_apart() -> None:
    assembly = ChunkAssembly(CHAT)
    assembly.add(
        chunk({"index": 0, "delta": {"content": "sea "}}, {"index": 1, "delta": {"content": "sky "}})
    )
    assembly.add(chunk({"index": 1, "delta": {"content": "blue"}, "finish_reason": "stop"}))
    assembly.add(chunk({"index": 0, "delta": {"content": "green"}, "finish_reason": "length"}))
    assembly.add(chunk(usage={"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}))
    body = assembly.body()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "sea green", "length"),
        (1, "sky blue", "stop"),
    ]
    assert body["usage"]["total_tokens"] == 6 and assembly.chunks == 4


def test_token_ids_logprobs_and_text_logprobs_are_assembled_in_order() -> None:
    assembly = ChunkAssembly(COMPLETIONS)
    lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [0]}
    assembly.add(
        {
            "choices": [{"index": 0, "text": "a", "logprobs": lp}],
            "stackpin": {"token_ids": [1], "token_logprobs": [-0.5]},
        }
    )
    lp2 = {"tokens": ["b"], "token_logprobs": [-1.5], "top_logprobs": [{}], "text_offset": [1]}
    extension = {"token_ids": [2], "token_logprobs": [-1.5], "prompt_token_ids": [7], "seed": 11}
    assembly.add(
        {
            "choices": [{"index": 0, "text": "b", "logprobs": lp2, "finish_reason": "length"}],
            "stackpin": extension,
        }
    )
    body = assembly.body()
    assert body["choices"][0]["text"] == "ab"
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -1.5]
    assert body["stackpin"]["token_ids"] == [1, 2] and body["stackpin"]["prompt_token_ids"] == [7]
    assert seed_of(body) == 11
    view = view_of(COMPLETIONS, body)
    assert view.tokens is not None and view.tokens.token_logprobs == [-0.5, -1.5] and view.tokens.text == "ab"


def test_logprobs_after_a_first_chunk_that_has_none_are_assembled() -> None:
    # OpenAI's and vLLM's first chunk carries only the role, with `logprobs: null`.
    assembly = ChunkAssembly(CHAT)
    assembly.add(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}))
    for text, logprob in (("Par", -0.25), ("is", -0.5)):
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        assembly.add(chunk({"index": 0, "delta": {"content": text}, "logprobs": {"content": [entry]}}))
    choice = assembly.body()["choices"][0]
    assert choice["message"]["content"] == "Paris"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.25, -0.5]


def test_a_responses_streams_answer_is_the_last_response_it_carries() -> None:
    assembly = ResponseAssembly()
    assembly.add({"type": "response.created", "response": {"status": "in_progress", "output": []}})
    assembly.add({"type": "response.output_text.delta", "delta": "hi"})
    final = {
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
    }
    assembly.add({"type": "response.completed", "response": final})
    assert assembly.body() == final
    assert view_of(RESPONSES, final).parts[0].fields["content"][0]["text"] == "hi"


def test_an_embedding_in_base64_is_compared_by_its_components() -> None:
    vector = [0.5, -0.25]
    packed = base64.b64encode(struct.pack("<2f", *vector)).decode()
    view = view_of(EMBEDDINGS, {"data": [{"index": 0, "embedding": packed}]})
    assert view.parts[0].fields["embedding"] == vector and view.kind == "embedding"


def test_a_recorded_events_volatile_values_are_left_out_of_what_is_compared() -> None:
    event = {"id": "x", "created": 5, "system_fingerprint": "f", "obfuscation": "pad", "choices": [{"index": 0}],
             "stackpin": {"token_ids": [1], "batch": {"max": 3}}}  # fmt: skip
    assert steady_event(sse(None, event)) == (
        None,
        {"choices": [{"index": 0}], "stackpin": {"token_ids": [1]}},
    )
    named = sse(
        "response.created", {"type": "response.created", "response": {"id": "resp_1", "status": "queued"}}
    )
    assert steady_event(named) == (
        "response.created",
        {"type": "response.created", "response": {"status": "queued"}},
    )
