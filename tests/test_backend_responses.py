"""Specification of pinned_backend.responses: OpenAI bodies and chunks, with the stackpin extension."""

from __future__ import annotations

from pinned_backend.engine import BatchStats, TokenOutput
from pinned_backend.responses import (
    Completion,
    Meta,
    completion_logprobs,
    first_chunk,
    full_body,
    token_chunk,
    usage_chunk,
)

TEXT = {1: "He", 2: "llo", 3: "!", 4: "?"}


def token_text(token_id: int) -> tuple[str, bytes]:
    return TEXT[token_id], TEXT[token_id].encode()


def completion(finished: bool = True) -> Completion:
    batch = BatchStats(3, 1, 2, cached_tokens=5, accepted_draft_tokens=1)
    done = Completion(prompt_ids=[7, 8], seed=42)
    done.outputs.append(TokenOutput(1, -0.5, ((1, -0.5), (4, -1.5)), "He", None, BatchStats(1, 1, 1)))
    done.outputs.append(
        TokenOutput(2, -0.25, ((2, -0.25), (3, -2.0)), "llo", "stop" if finished else None, batch)
    )
    return done


def meta(chat: bool) -> Meta:
    return Meta("id-1", 1700000000, "tiny", "f" * 64, chat)


def test_a_chat_body_has_openai_fields_and_the_extension() -> None:
    body = full_body(meta(chat=True), completion(), logprobs=False, token_text=token_text)
    assert body["object"] == "chat.completion"
    assert body["system_fingerprint"] == "f" * 64
    assert body["choices"] == [
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert body["stackpin"] == {
        "prompt_token_ids": [7, 8],
        "token_ids": [1, 2],
        "token_logprobs": [-0.5, -0.25],
        "batch": {"max": 3, "min": 1, "steps": 2, "cached_tokens": 5, "accepted_draft_tokens": 1},
        "seed": 42,
    }


def test_chat_logprobs_list_each_token_with_its_top_alternatives() -> None:
    body = full_body(meta(chat=True), completion(), logprobs=True, token_text=token_text)
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "He",
        "logprob": -0.5,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
            {"token": "?", "logprob": -1.5, "bytes": [63]},
        ],
    }


def test_completion_logprobs_use_the_legacy_shape_with_offsets() -> None:
    logprobs = completion_logprobs(completion().outputs, token_text, offset=10)
    assert logprobs == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"He": -0.5, "?": -1.5}, {"llo": -0.25, "!": -2.0}],
        "text_offset": [10, 12],
    }


def test_the_sampled_token_is_always_among_the_legacy_top_logprobs() -> None:
    output = TokenOutput(3, -4.0, ((1, -0.1),), "!", None, BatchStats())
    assert completion_logprobs([output], token_text, 0)["top_logprobs"] == [{"He": -0.1, "!": -4.0}]


def test_stream_chunks_carry_their_tokens_and_the_last_the_whole_context() -> None:
    done = completion()
    assert first_chunk(meta(chat=True))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    middle = token_chunk(meta(chat=True), completion(finished=False), 1, False, token_text)
    assert middle["choices"][0]["delta"] == {"content": "llo"}
    assert middle["stackpin"] == {"token_ids": [2], "token_logprobs": [-0.25]}
    last = token_chunk(meta(chat=True), done, 1, False, token_text)
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["stackpin"]["prompt_token_ids"] == [7, 8]
    assert last["stackpin"]["batch"] == {
        "max": 3,
        "min": 1,
        "steps": 2,
        "cached_tokens": 5,
        "accepted_draft_tokens": 1,
    }
    assert last["stackpin"]["seed"] == 42


def test_completion_chunks_offset_logprobs_by_the_text_already_sent() -> None:
    chunk = token_chunk(meta(chat=False), completion(), 1, True, token_text)
    assert chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == "llo"
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2]


def test_the_usage_chunk_has_no_choices() -> None:
    chunk = usage_chunk(meta(chat=True), completion())
    assert chunk["choices"] == []
    assert chunk["usage"]["total_tokens"] == 4
