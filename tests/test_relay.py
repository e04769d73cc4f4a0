"""Relaying a stream: what the client reads, byte for byte, with the stack's fingerprint stamped in; the event
that ends the answer held back until the record is closed; what the record keeps rebuilds every byte."""

from __future__ import annotations

import json

from proxy.replicas.forward import Event
from proxy.serving.relay import DONE, Relay
from proxy.serving.responses_api import Echo

FP = "f" * 64


def test_chat_chunks_pass_through_stamped_and_the_done_event_comes_after_the_record() -> None:
    relay = Relay("/v1/chat/completions", FP)
    sent = relay.feed(
        Event(
            None,
            {
                "id": "c",
                "system_fingerprint": "upstream",
                "choices": [{"index": 0, "delta": {"content": "hi"}}],
            },
        )
    )
    assert [json.loads(text[6:])["system_fingerprint"] for text in sent] == [FP]
    assert relay.upstream_fingerprint == "upstream" and relay.events == sent
    assert relay.finish() == []
    assert relay.terminal(None, client_left=False) == DONE
    assert relay.answer()["choices"][0]["message"]["content"] == "hi"
    failure = relay.terminal("replica: stream broke", client_left=False)
    assert failure is not None and "the stream is incomplete: replica: stream broke" in failure
    assert relay.terminal("client went away", client_left=True) is None


def test_an_upstreams_responses_events_keep_their_names_take_the_records_id_and_hold_back_the_last() -> None:
    echo = Echo("resp_" + "a" * 32, 1, {"input": "hi"}, None)
    relay = Relay("/v1/responses", FP, echo)
    created = {
        "type": "response.created",
        "sequence_number": 0,
        "response": {"id": "resp_theirs", "output": []},
    }
    sent = relay.feed(Event("response.created", created))
    assert sent[0].startswith("event: response.created\ndata: ")
    assert json.loads(sent[0].split("data: ", 1)[1])["response"]["id"] == echo.id
    done = {
        "type": "response.completed",
        "sequence_number": 1,
        "response": {"id": "resp_theirs", "status": "completed", "output": []},
    }
    assert relay.feed(Event("response.completed", done)) == [], "the terminal event waits for the record"
    held = relay.terminal(None, client_left=False)
    assert held is not None and held.startswith("event: response.completed\n")
    assert relay.answer()["status"] == "completed" and relay.answer()["id"] == echo.id
    error = relay.terminal("replica: broke", client_left=False)
    assert error is not None and json.loads(error.split("data: ", 1)[1])["sequence_number"] == 2


def test_a_translated_stream_sends_every_item_done_before_the_record_and_the_completion_after() -> None:
    relay = Relay.translating(FP, Echo("resp_" + "b" * 32, 1, {"input": "hi"}, None))
    for chunk in ({"model": "m", "choices": [{"index": 0, "delta": {"content": "sea"}}], "stackpin": {"token_ids": [4], "token_logprobs": [-1.0]}},
                  {"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}):  # fmt: skip
        relay.feed(Event(None, chunk))
    relay.finish()
    names = [text.split("\n", 1)[0] for text in relay.events]
    assert names[-1] == "event: response.output_item.done"
    terminal = relay.terminal(None, client_left=False)
    assert terminal is not None and terminal.startswith("event: response.completed")
    assert relay.replica_answer()["stackpin"]["token_ids"] == [4]  # type: ignore[index]
