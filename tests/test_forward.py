"""HTTP to replicas (proxy/replicas/forward.py): what comes back from a JSON request, a stack description and an event
stream, over real loopback HTTP, and how every failure is sorted: worth a retry elsewhere (`ReplicaUnavailable`,
with `down` when the replica could not be reached at all), not an OpenAI answer (`ReplicaGarbage`), or the
client's problem (`ReplicaRejected`, with an OpenAI-style error body).

An honest replica is the fake of tests/support; what no honest replica sends comes from a server scripted here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from proxy.canonical import canonical_json
from proxy.replicas.forward import (
    Answer,
    Event,
    ReplicaGarbage,
    ReplicaRejected,
    ReplicaUnavailable,
    Stream,
    describe,
    excerpt,
    open_stream,
    post_json,
    request_bytes,
)
from tests.support.fake_replica import FakeReplica, fingerprint_of, tiny_stack

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 3,
    "temperature": 0,
}
KEY = SecretStr("sk-proxy-own-key-0123456789")
# Generous: only a replica that never answers reaches it, never a busy machine.
TIMEOUT_S = 30.0
# Small: the replicas scripted to reach it never answer at all.
NEVER_S = 0.2
# Long enough for a first event to arrive on a busy machine; a replica that then stalls reaches it.
STALLED_S = 5.0

Script = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
Scripted = Callable[[Script], Awaitable[str]]  # starts a replica answering with a script; returns its URL


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def scripted(aiohttp_raw_server: Any) -> Scripted:
    """Starts a replica on loopback that answers every request with `script`; returns its base URL."""

    async def start(script: Script) -> str:
        server = await aiohttp_raw_server(script)
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def refused() -> str:
    """The URL of a replica that has stopped: connections to it are refused."""
    gone = FakeReplica()
    url = await gone.start()
    await gone.stop()
    return url


@pytest.fixture
async def never() -> AsyncIterator[asyncio.Event]:
    """What a replica that never answers waits for; released when the test ends, so its server can stop."""
    released = asyncio.Event()
    yield released
    released.set()


def answering(status: int, body: bytes, content_type: str = "application/json") -> Script:
    async def script(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type=content_type)

    return script


def streaming(*parts: bytes, headers: dict[str, str] | None = None) -> Script:
    """A stream that sends `parts` as they are, then ends the response."""

    async def script(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
        await response.prepare(request)
        for part in parts:
            await response.write(part)
        await response.write_eof()
        return response

    return script


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any] = CHAT) -> Answer:
    return await post_json(session, url, body, api_key=KEY, timeout_s=TIMEOUT_S)


async def opened(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None) -> Stream:
    return await open_stream(session, url, body or {**CHAT, "stream": True}, api_key=KEY, timeout_s=TIMEOUT_S)


async def events_of(stream: Stream) -> list[Event]:
    try:
        return [event async for event in stream.events()]
    finally:
        stream.close()


async def scripted_events(session: aiohttp.ClientSession, scripted: Scripted, *parts: bytes) -> list[Event]:
    return await events_of(await opened(session, await scripted(streaming(*parts))))


# A JSON answer


async def test_an_answer_is_the_replicas_json_object_with_the_stack_its_header_names(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    answer = await post(session, f"{replica.url}/v1/chat/completions")
    assert answer.body["object"] == "chat.completion"
    assert answer.body["choices"][0]["message"]["role"] == "assistant"
    assert answer.stack_header == replica.fingerprint
    assert replica.requests == [CHAT], "the replica is sent the body exactly as given"


async def test_the_proxys_key_reaches_the_replica_as_a_bearer_token_and_no_key_sends_none(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    await post(session, f"{replica.url}/v1/chat/completions")
    await post_json(session, f"{replica.url}/v1/chat/completions", CHAT, api_key=None, timeout_s=TIMEOUT_S)
    with_key, without = replica.headers_seen
    assert with_key["Authorization"] == f"Bearer {KEY.get_secret_value()}"
    assert "Authorization" not in without
    assert with_key["Content-Type"] == "application/json"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": 'héllo \u2028 🎉 "quoted" \\ \n'}]},
        {
            "n": 2**53 - 1,
            "x": -0.0,
            "y": 1e-7,
            "z": 1.5,
            "big": 1e300,
            "none": None,
            "flag": True,
            "empty": {},
        },
        {"nested": [[[]], [{"a": [1, 2.5, "3"]}]]},
    ],
)
def test_a_replica_is_sent_json_that_reads_back_as_the_body(body: dict[str, Any]) -> None:
    sent = request_bytes(body)
    # repr, not ==: it tells -0.0 from 0.0 and 1.0 from 1
    expected = json.loads(json.dumps(body, sort_keys=True))
    assert repr(json.loads(sent)) == repr(expected), "the value json.dumps would send, keys sorted"
    assert b"\\u00e9" not in sent, "text goes as UTF-8, not escaped"


def test_a_replica_gets_keys_in_the_order_a_replay_of_the_record_sends_them() -> None:
    # A schema's properties reach the model's prompt and grammar in the order they arrive; the record keeps the
    # request canonical (keys sorted), so the original is sent sorted too, or its replay would see another prompt.
    schema = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}
    body = {"model": "m", "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    sent = request_bytes(body)
    assert sent.index(b'"alpha"') < sent.index(b'"zeta"')
    assert sent == request_bytes(json.loads(canonical_json(body)))


def test_a_body_orjson_refuses_is_still_sent_as_json_would_write_it() -> None:
    body = {"huge": 2**70}  # never reaches a replica from a client (the recordable check refuses it)
    assert json.loads(request_bytes(body)) == body


async def test_an_answer_without_a_stack_header_says_so(
    session: aiohttp.ClientSession, scripted: Scripted
) -> None:
    answer = await post(session, await scripted(answering(200, b'{"choices": []}')))
    assert answer == Answer({"choices": []}, None)


async def test_a_body_that_is_not_json_is_garbage_quoting_its_start(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    replica.failure = "garbage"
    with pytest.raises(ReplicaGarbage, match="answer is not JSON: '<html>not json</html>'"):
        await post(session, f"{replica.url}/v1/chat/completions")


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null", b"7"])
async def test_json_that_is_not_an_object_is_garbage(
    session: aiohttp.ClientSession, scripted: Scripted, body: bytes
) -> None:
    with pytest.raises(ReplicaGarbage, match="JSON but not an object"):
        await post(session, await scripted(answering(200, body)))


@pytest.mark.parametrize("body", [b"", b"\xff\xfe{", b'{"choices": '])
async def test_an_empty_undecodable_or_unfinished_body_is_garbage(
    session: aiohttp.ClientSession, scripted: Scripted, body: bytes
) -> None:
    with pytest.raises(ReplicaGarbage, match="not JSON"):
        await post(session, await scripted(answering(200, body)))


@pytest.mark.parametrize("status", [201, 202, 204])
async def test_a_success_other_than_200_is_garbage(
    session: aiohttp.ClientSession, scripted: Scripted, status: int
) -> None:
    body = b"" if status == 204 else b'{"choices": []}'
    with pytest.raises(ReplicaGarbage, match=f"status {status}"):
        await post(session, await scripted(answering(status, body)))


# Failures worth a retry on another replica of the same fingerprint


async def test_a_refused_connection_is_unavailable_and_the_replica_down(
    session: aiohttp.ClientSession, refused: str
) -> None:
    with pytest.raises(ReplicaUnavailable) as raised:
        await post(session, f"{refused}/v1/chat/completions")
    assert raised.value.down


async def test_a_replica_that_never_answers_is_unavailable_and_down_once_the_timeout_passes(
    session: aiohttp.ClientSession, scripted: Scripted, never: asyncio.Event
) -> None:
    async def silent(request: web.BaseRequest) -> web.StreamResponse:
        await never.wait()
        return web.Response()

    url = await scripted(silent)
    with pytest.raises(ReplicaUnavailable, match="TimeoutError") as raised:
        await post_json(session, url, CHAT, api_key=None, timeout_s=NEVER_S)
    assert raised.value.down


async def test_a_connection_cut_before_the_whole_body_is_unavailable_and_down(
    session: aiohttp.ClientSession, scripted: Scripted
) -> None:
    async def cut(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await response.prepare(request)
        await response.write(b'{"choices": [')
        assert request.transport is not None
        request.transport.close()
        return response

    with pytest.raises(ReplicaUnavailable) as raised:
        await post(session, await scripted(cut))
    assert raised.value.down


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_a_5xx_is_unavailable_but_the_replica_that_answered_stays_up(
    session: aiohttp.ClientSession, scripted: Scripted, status: int
) -> None:
    with pytest.raises(ReplicaUnavailable, match=f"answered {status}") as raised:
        await post(session, await scripted(answering(status, b'{"error": {"message": "boom"}}')))
    assert not raised.value.down


@pytest.mark.parametrize("status", [401, 403])
async def test_a_replica_refusing_the_proxys_key_is_retried_elsewhere_and_its_answer_never_quoted(
    session: aiohttp.ClientSession, scripted: Scripted, status: int
) -> None:
    async def quoting(request: web.BaseRequest) -> web.StreamResponse:
        message = f"Incorrect API key provided: {request.headers['Authorization']}"
        return web.json_response({"error": {"message": message}}, status=status)

    with pytest.raises(ReplicaUnavailable, match="check its api_key_env") as raised:
        await post(session, await scripted(quoting))
    assert not raised.value.down
    assert KEY.get_secret_value() not in str(raised.value)


# The client's problem


async def test_a_4xx_is_a_rejection_carrying_the_replicas_own_error_body(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    with pytest.raises(ReplicaRejected) as raised:
        await post(session, f"{replica.url}/v1/chat/completions", {**CHAT, "max_tokens": 0})
    assert raised.value.status == 400
    assert raised.value.replica_body == {
        "error": {"message": "max_tokens must be an integer from 1 to 4096", "type": "invalid_request_error"}
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"no such route", "no such route"),
        (b'{"detail": "Not Found"}', '{"detail": "Not Found"}'),
        (b'{"error": "a string, not an object"}', '{"error": "a string, not an object"}'),
    ],
)
async def test_a_4xx_without_an_openai_error_body_gets_one_quoting_what_the_replica_sent(
    session: aiohttp.ClientSession, scripted: Scripted, body: bytes, message: str
) -> None:
    with pytest.raises(ReplicaRejected) as raised:
        await post(session, await scripted(answering(404, body, "text/plain")))
    assert raised.value.status == 404
    assert raised.value.replica_body == {"error": {"message": message, "type": "replica_error"}}


def test_an_excerpt_is_whole_when_short_and_otherwise_cut_between_words() -> None:
    assert excerpt(b"short answer", 80) == "short answer"
    assert excerpt(b"one two three four", 9) == "one two ..."
    assert excerpt(b"\xffbad", 80) == "\ufffdbad", "undecodable bytes are replaced, never an error"


def test_an_excerpt_never_cuts_inside_a_word_so_a_quoted_key_is_whole_or_absent() -> None:
    key = KEY.get_secret_value()
    text = f"refused the key {key} today".encode()
    for limit in range(len(text)):
        cut = excerpt(text, limit)
        assert key in cut or key[:4] not in cut, (limit, cut)
    assert excerpt(key.encode(), len(key) - 1) == "...", "a single word too long is left out whole"


# A replica's stack


async def test_describing_a_replica_proves_its_stack_and_computes_its_fingerprint_here(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    described = await describe(session, replica.url, timeout_s=TIMEOUT_S)
    assert described.document == tiny_stack()
    assert described.stack.model == "fake-model"
    assert described.fingerprint == described.claimed == fingerprint_of(tiny_stack())
    assert described.honest


async def test_the_proxy_keeps_a_replicas_stack_without_its_serving_features(replica: FakeReplica) -> None:
    plain = tiny_stack()
    replica.stack = tiny_stack(batching={**plain["batching"], "prefix_cache": True, "speculation": None})
    async with aiohttp.ClientSession() as session:
        described = await describe(session, replica.url, timeout_s=10)
    assert described.honest
    assert described.document == plain, "what is kept and stored hashes to the fingerprint"
    assert described.stack.fingerprint == described.fingerprint == fingerprint_of(plain)


async def test_a_replica_claiming_another_fingerprint_than_its_stack_hashes_to_is_not_honest(
    session: aiohttp.ClientSession, scripted: Scripted
) -> None:
    claim = json.dumps({"stack": tiny_stack(), "fingerprint": "0" * 64}).encode()
    described = await describe(session, await scripted(answering(200, claim)), timeout_s=TIMEOUT_S)
    assert described.claimed == "0" * 64 and described.fingerprint == fingerprint_of(tiny_stack())
    assert not described.honest


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"<html>", id="not-json"),
        pytest.param(b'{"fingerprint": "00"}', id="no-stack"),
        pytest.param(b'{"stack": [1]}', id="stack-not-an-object"),
        pytest.param(b'{"stack": {"model": 3}}', id="invalid-stack"),
        pytest.param(b'{"stack": {"model": "m", "surprise": 1}}', id="unknown-key"),
        pytest.param(
            json.dumps({"stack": tiny_stack(hardware_detail={"cores": 2**60})}).encode(),
            id="no-canonical-form",
        ),
    ],
)
async def test_anything_but_a_valid_stack_at_v1_stack_leaves_the_replica_unavailable(
    session: aiohttp.ClientSession, scripted: Scripted, body: bytes
) -> None:
    url = await scripted(answering(200, body))
    with pytest.raises(ReplicaUnavailable, match=f"no valid stack at {url}/v1/stack"):
        await describe(session, url, timeout_s=TIMEOUT_S)


async def test_a_stack_refused_with_a_4xx_or_unreachable_leaves_the_replica_unavailable(
    session: aiohttp.ClientSession, scripted: Scripted, refused: str
) -> None:
    with pytest.raises(ReplicaUnavailable, match="no valid stack"):
        await describe(session, await scripted(answering(404, b"not here")), timeout_s=TIMEOUT_S)
    with pytest.raises(ReplicaUnavailable) as raised:
        await describe(session, refused, timeout_s=TIMEOUT_S)
    assert raised.value.down


# Opening a stream


async def test_a_stream_yields_each_events_data_in_order_and_ends_at_done(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    stream = await opened(session, f"{replica.url}/v1/chat/completions")
    assert stream.stack_header == replica.fingerprint
    events = await events_of(stream)
    assert [e.name for e in events] == [None, None, None]
    assert "".join(e.data["choices"][0]["delta"]["content"] for e in events) == replica.completion(CHAT)[2]
    assert events[-1].data["usage"]["completion_tokens"] == 3


async def test_a_responses_stream_keeps_its_event_names_and_ends_at_its_terminal_event(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    body = {"model": "fake-model", "input": "hello", "max_output_tokens": 2, "stream": True}
    events = await events_of(await opened(session, f"{replica.url}/v1/responses", body))
    assert events[0].name == "response.created"
    assert events[-1].name == "response.completed" and events[-1].data["type"] == "response.completed"
    assert all(e.name == e.data["type"] for e in events)


async def test_asking_for_a_stream_and_getting_anything_but_an_event_stream_is_garbage(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    with pytest.raises(ReplicaGarbage, match="not text/event-stream"):
        await opened(session, f"{replica.url}/v1/chat/completions", CHAT)  # no stream: a JSON answer


async def test_a_stream_refused_with_a_status_is_sorted_as_an_answer_is(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    url = f"{replica.url}/v1/chat/completions"
    with pytest.raises(ReplicaRejected) as rejected:
        await opened(session, url, {**CHAT, "stream": True, "max_tokens": 0})
    assert rejected.value.replica_body["error"]["message"] == "max_tokens must be an integer from 1 to 4096"
    for failure in ("500", "401"):
        replica.failure = failure
        with pytest.raises(ReplicaUnavailable) as unavailable:
            await opened(session, url)
        assert not unavailable.value.down


async def test_a_stream_that_cannot_be_opened_leaves_the_replica_down(
    session: aiohttp.ClientSession,
    scripted: Scripted,
    refused: str,
    never: asyncio.Event,
) -> None:
    async def silent(request: web.BaseRequest) -> web.StreamResponse:
        await never.wait()
        return web.Response()

    with pytest.raises(ReplicaUnavailable) as unreachable:
        await opened(session, refused)
    url = await scripted(silent)
    with pytest.raises(ReplicaUnavailable, match="TimeoutError") as silent_one:
        await open_stream(session, url, {**CHAT, "stream": True}, api_key=None, timeout_s=NEVER_S)
    assert unreachable.value.down and silent_one.value.down


async def test_the_replica_timeout_bounds_a_streams_whole_read(
    session: aiohttp.ClientSession, scripted: Scripted, never: asyncio.Event
) -> None:
    async def stalls(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await never.wait()
        return response

    stream = await open_stream(
        session, await scripted(stalls), {**CHAT, "stream": True}, api_key=None, timeout_s=STALLED_S
    )
    read: list[Event] = []
    with pytest.raises(ReplicaUnavailable, match="stream broke: TimeoutError"):
        async for event in stream.events():
            read.append(event)
    stream.close()
    assert read == [Event(None, {"n": 1})], "what arrived before is still relayed"


async def test_a_stream_the_replica_cuts_off_is_unavailable(
    session: aiohttp.ClientSession, replica: FakeReplica
) -> None:
    replica.failure = "drop_stream"
    stream = await opened(
        session, f"{replica.url}/v1/chat/completions", {**CHAT, "max_tokens": 6, "stream": True}
    )
    with pytest.raises(ReplicaUnavailable):
        await events_of(stream)


# Reading server-sent events


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        pytest.param(
            [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"],
            [Event(None, {"a": 1}), Event(None, {"b": 2})],
            id="plain",
        ),
        pytest.param(
            [b'data:{"a": 1}\n\ndata:[DONE]\n\n'], [Event(None, {"a": 1})], id="no-space-after-colon"
        ),
        pytest.param(
            [b'data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n'], [Event(None, {"a": 1})], id="crlf-line-ends"
        ),
        pytest.param(
            [b'data: {"a":\ndata: [1,\ndata: 2]}\n\n', b"data: [DONE]\n\n"],
            [Event(None, {"a": [1, 2]})],
            id="data-over-several-lines",
        ),
        pytest.param(
            [b": keep-alive\n\n\n", b'id: 7\nretry: 100\ndata: {"a": 1}\n\n', b": ping\ndata: [DONE]\n\n"],
            [Event(None, {"a": 1})],
            id="comments-ids-retries-and-blank-lines-carry-nothing",
        ),
        pytest.param(
            [b'data: {"a": 1', b"}\n", b"\n", b"data: [DO", b"NE]\n\n"],
            [Event(None, {"a": 1})],
            id="split-anywhere-by-the-network",
        ),
        pytest.param(
            [b'event: first\ndata: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'],
            [Event("first", {"a": 1}), Event(None, {"b": 2})],
            id="a-name-belongs-to-its-event-only",
        ),
        pytest.param(
            [b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: not read\n\n'],
            [Event(None, {"a": 1})],
            id="nothing-after-done-is-read",
        ),
        pytest.param(
            [b'data: {"type": "response.completed", "response": {}}\n\n'],
            [Event(None, {"type": "response.completed", "response": {}})],
            id="a-terminal-type-ends-a-stream-without-a-name",
        ),
        pytest.param(
            [b'event: response.failed\ndata: {"response": {}}\n\n'],
            [Event("response.failed", {"response": {}})],
            id="a-terminal-name-ends-a-stream-without-done",
        ),
        pytest.param(
            [b'data: {"text": "caf\xc3\xa9 \xe2\x9c\x93"}\n\ndata: [DONE]\n\n'],
            [Event(None, {"text": "café ✓"})],
            id="utf-8",
        ),
    ],
)
async def test_events_are_read_as_server_sent_events_define_them(
    session: aiohttp.ClientSession,
    scripted: Scripted,
    parts: list[bytes],
    expected: list[Event],
) -> None:
    assert await scripted_events(session, scripted, *parts) == expected


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([b'data: {"a": 1}\n\n'], id="no-done"),
        pytest.param([b'data: {"a": 1}\n\ndata: [DONE]'], id="done-without-its-blank-line"),
        pytest.param(
            [b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n'], id="no-terminal-event"
        ),
        pytest.param([], id="nothing-at-all"),
        pytest.param([b'data: {"type": ["response.completed"]}\n\n'], id="a-type-that-names-no-event"),
    ],
)
async def test_a_stream_that_ends_without_done_or_a_terminal_event_is_unavailable(
    session: aiohttp.ClientSession, scripted: Scripted, parts: list[bytes]
) -> None:
    with pytest.raises(ReplicaUnavailable, match="stream ended without data: \\[DONE\\]"):
        await scripted_events(session, scripted, *parts)


@pytest.mark.parametrize(
    "part",
    [
        pytest.param(b"data: <html>oops</html>\n\n", id="not-json"),
        pytest.param(b"data: [1, 2]\n\n", id="not-an-object"),
        pytest.param(b"data:\n\n", id="empty"),
    ],
)
async def test_an_event_whose_data_is_not_a_json_object_is_garbage(
    session: aiohttp.ClientSession, scripted: Scripted, part: bytes
) -> None:
    with pytest.raises(ReplicaGarbage):
        await scripted_events(session, scripted, b'data: {"a": 1}\n\n', part, b"data: [DONE]\n\n")


async def test_an_event_that_is_not_utf_8_is_garbage(
    session: aiohttp.ClientSession, scripted: Scripted
) -> None:
    with pytest.raises(ReplicaGarbage, match="not UTF-8"):
        await scripted_events(session, scripted, b'data: {"text": "caf\xe9"}\n\n', b"data: [DONE]\n\n")


async def test_an_event_of_any_length_is_read_whole(
    session: aiohttp.ClientSession, scripted: Scripted
) -> None:
    # A long prompt's token ids arrive in one event, a long response whole in its terminal event.
    ids = list(range(300_000))
    event = b"data: " + json.dumps({"stackpin": {"prompt_token_ids": ids}}).encode() + b"\n\n"
    assert len(event) > 2**21
    events = await scripted_events(session, scripted, event, b"data: [DONE]\n\n")
    assert events == [Event(None, {"stackpin": {"prompt_token_ids": ids}})]


async def test_the_name_of_an_event_without_data_is_not_given_to_the_next(
    session: aiohttp.ClientSession, scripted: Scripted
) -> None:
    events = await scripted_events(
        session, scripted, b"event: ping\n\n", b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    )
    assert events == [Event(None, {"a": 1})]
