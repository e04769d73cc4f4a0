"""Whatever a client sends to the three POST routes, the proxy answers without a 5xx, every 4xx with an
OpenAI-style error body, and never a second response inside a first.

A fuzz test (hypothesis) over raw HTTP: bodies that are JSON, nearly JSON or not at all, values the audit log
cannot hold, deep nesting, every Content-Encoding, header lines and header counts past aiohttp's limits. The
proxy runs on a thread of its own, so that each example is a plain blocking request over loopback.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@dataclass(frozen=True)
class LiveProxy:
    port: int
    record_id: str


@pytest.fixture(scope="module")
def live_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    folder = tmp_path_factory.mktemp("fuzz")
    ready = threading.Event()
    found: dict[str, Any] = {}

    async def serve() -> None:
        replica = FakeReplica()
        await replica.start()
        try:
            async with running_proxy([replica], folder, server={"max_body_bytes": 8192}) as harness:
                status, _, headers = await harness.post("/v1/chat/completions", {**CHAT, "temperature": 0})
                assert status == 200
                found.update(
                    port=int(harness.url.rsplit(":", 1)[1]),
                    record=headers["Stackpin-Record"],
                    stop=asyncio.Event(),
                    loop=asyncio.get_running_loop(),
                )
                ready.set()
                await found["stop"].wait()
        finally:
            await replica.stop()
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60) and "port" in found, "the proxy did not start"
    yield LiveProxy(found["port"], found["record"])
    found["loop"].call_soon_threadsafe(found["stop"].set)
    thread.join(30)


def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection; the response parsed by the standard library's HTTP client."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def http_request(path: str, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def assert_openai_error(status: int, body: bytes) -> None:
    document = json.loads(body)
    error = document["error"]
    assert isinstance(error["message"], str) and error["message"], (status, body[:300])
    assert isinstance(error["type"], str) and error["type"], (status, body[:300])


# JSON values, with what JSON itself allows and the audit log does not: huge integers, 1e400, lone surrogates.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udfffb", 2**63 - 1, -(2**70), 1e308, "__nan__"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "stream", "max_tokens", "temperature", "seed", "stackpin", "on", "n"]
# Mostly requests a replica would serve, with a field or two replaced by anything at all.
plausible = st.builds(
    lambda stream, overrides: {**CHAT, "prompt": "hi", "temperature": 0, "stream": stream, **overrides},
    st.booleans(),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=2),
)
anything = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("fake-model"), values),
        "messages": st.one_of(
            st.just([{"role": "user", "content": "hi"}]),
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": values})),
            values,
        ),
        "prompt": st.one_of(st.just("hi"), values),
        "stream": st.one_of(st.booleans(), values),
        "max_tokens": st.one_of(st.integers(-2, 6), values),
        "temperature": st.one_of(st.floats(0, 2), values),
        "seed": st.one_of(st.integers(), values),
        "stackpin": st.one_of(
            st.dictionaries(st.sampled_from(["model", "stack", "kernel_mode", "nope"]), values)
        ),
        "on": values,
        "extra": values,
    },
)


def as_text(body: dict[str, Any]) -> bytes:
    # Python writes NaN and infinities as bare words, which JSON does not have: they must be refused too.
    return json.dumps(body).replace('"__nan__"', "NaN").encode()


raw_bodies = st.one_of(
    plausible.map(as_text),
    plausible.map(as_text),
    anything.map(as_text),
    st.binary(max_size=64),
    st.integers(1, 3000).map(lambda depth: b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"),
    st.integers(1, 3000).map(lambda depth: b'{"a": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"),
    st.sampled_from([b'{"top_p": 1e400}', b'{"seed": NaN}', b'{"x": Infinity}', b"x" * 9000, b""]),
)
encodings = st.one_of(
    st.none(),
    st.sampled_from([None, "gzip", "deflate", "gzip-broken", "br", "zstd", "identity", "x-unknown"]),
)
extra_headers = st.lists(
    st.tuples(
        st.sampled_from(["Stackpin-Pin", "Content-Type", "Authorization", "X-Anything"]),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    ),
    max_size=2,
)
oversize = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(["long-line", "many-headers"]))


def encode(body: bytes, encoding: str | None) -> tuple[bytes, list[tuple[str, str]]]:
    if encoding is None:
        return body, []
    if encoding == "gzip":
        return gzip.compress(body), [("Content-Encoding", "gzip")]
    if encoding == "deflate":
        return zlib.compress(body), [("Content-Encoding", "deflate")]
    if encoding == "gzip-broken":
        return b"not gzip at all" + body, [("Content-Encoding", "gzip")]
    return body, [("Content-Encoding", encoding)]


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(["chat", "completions", "replay"]),
    body=raw_bodies,
    encoding=encodings,
    headers=extra_headers,
    big=oversize,
)
@example(route="chat", body=b"[" * 1000 + b"]" * 1000, encoding=None, headers=[], big=None)
@example(
    route="replay", body=b'{"on": ' + b"[" * 1000 + b"]" * 1000 + b"}", encoding=None, headers=[], big=None
)
@example(route="chat", body=as_text({**CHAT, "seed": 2**63 - 1}), encoding=None, headers=[], big=None)
@example(route="completions", body=b'{"prompt": "hi", "top_p": 1e400}', encoding=None, headers=[], big=None)
@example(
    route="chat",
    body=as_text({**CHAT, "stream": True, "messages": [{"role": "user", "content": "\ud800"}]}),
    encoding=None,
    headers=[],
    big=None,
)
@example(route="chat", body=as_text(CHAT), encoding="gzip-broken", headers=[], big=None)
@example(route="chat", body=as_text(CHAT), encoding="deflate", headers=[], big=None)
@example(route="chat", body=as_text(CHAT), encoding="br", headers=[], big=None)
@example(route="chat", body=as_text(CHAT), encoding=None, headers=[], big="long-line")
@example(route="completions", body=as_text(CHAT), encoding=None, headers=[], big="many-headers")
def test_no_request_gets_a_5xx_and_every_4xx_is_openai_style(
    live_proxy: LiveProxy,
    route: str,
    body: bytes,
    encoding: str | None,
    headers: list[tuple[str, str]],
    big: str | None,
) -> None:
    path = {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "replay": f"/v1/records/{live_proxy.record_id}/replay",
    }[route]
    payload, encoding_headers = encode(body, encoding)
    headers = [*encoding_headers, *headers]
    if big == "long-line":
        headers.append(("X-Long", "a" * 9000))
    elif big == "many-headers":
        headers += [(f"X-Many-{i}", "a") for i in range(200)]
    status, response_headers, answer = exchange(live_proxy.port, http_request(path, payload, headers))
    assert status < 500, (status, answer[:300])
    assert b"HTTP/1." not in answer, "no second response inside the first"
    if status >= 400:
        assert response_headers.get("content-type", "").startswith("application/json"), answer[:300]
        assert_openai_error(status, answer)


def test_what_aiohttp_refuses_itself_is_answered_as_the_proxy_answers(live_proxy: LiveProxy) -> None:
    for request in (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS on the HTTP port
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
        http_request("/v1/chat/completions", as_text(CHAT), [("Content-Encoding", "br")]),
    ):
        status, headers, answer = exchange(live_proxy.port, request)
        assert status == 400 and headers["content-type"].startswith("application/json")
        assert_openai_error(status, answer)


def test_a_body_from_the_audit_logs_blind_spots_is_refused_naming_the_field(live_proxy: LiveProxy) -> None:
    for body, param in (
        (as_text({**CHAT, "seed": 2**63 - 1}), "seed"),
        (as_text({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}), "messages[0].content"),
        (
            b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}',
            "top_p",
        ),
    ):
        status, _, answer = exchange(live_proxy.port, http_request("/v1/chat/completions", body, []))
        assert status == 400 and json.loads(answer)["error"]["param"] == param
