"""HTTP to replicas: send a request, read a JSON answer or a server-sent event stream, classify failures.

A failure the router may retry on another replica of the same fingerprint (connection refused or reset, timeout,
5xx) is `ReplicaUnavailable`; an answer that is not what the OpenAI wire format promises is `ReplicaGarbage`;
a 4xx is the client's problem and comes back as `ReplicaRejected` with the replica's error body. The three are
part of the proxy's one error tree (proxy/errors.py). This module knows nothing of pins, records or the client.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from pydantic import SecretStr, ValidationError

from proxy.endpoints import TERMINAL_EVENTS
from proxy.errors import ReplicaGarbage, ReplicaRejected, ReplicaUnavailable
from proxy.json_reader import read_json
from proxy.stack import Stack, fingerprint, fingerprinted

STACK_HEADER = "Stackpin-Stack"
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


@dataclass(frozen=True)
class Answer:
    body: dict[str, Any]
    stack_header: str | None


def request_bytes(body: dict[str, Any]) -> bytes:
    """The JSON a replica is sent for `body`: orjson's bytes, which read back as the value `json.dumps` would
    send (only its spacing and number spelling differ), for every value a record can hold, with every object's keys
    in sorted order. Sorted, because a replay resends the request its record keeps, whose canonical JSON sorts keys,
    and a model reads key order (a schema's properties, a tool's parameters are rendered into its prompt and its
    grammar in that order): the original must go out in the order its replay will. (RFC 8785 sorts by UTF-16 code
    units, orjson by code points: the two differ only between keys above U+FFFF and keys from U+E000 to U+FFFF.)
    orjson writes NaN and infinities as null where `json.dumps` writes non-JSON; no body reaches here with one,
    since every body is either checked by the recordable check or read back from a record, whose canonical JSON has
    none. Anything orjson refuses (an integer beyond 64 bits) is sent as `json.dumps` writes it."""
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(body, sort_keys=True).encode("utf-8")


def replica_headers(api_key: SecretStr | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key.get_secret_value()}"
    return headers


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    api_key: SecretStr | None,
    timeout_s: float,
) -> Answer:
    try:
        async with session.post(
            url,
            data=request_bytes(body),
            headers=replica_headers(api_key),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            raw = await response.read()
    except TRANSPORT_ERRORS as e:
        raise _unavailable(e) from e
    _raise_for_status(response.status, raw)
    return Answer(_parse_object(raw), response.headers.get(STACK_HEADER))


async def get_json(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float, api_key: SecretStr | None = None
) -> dict[str, Any]:
    return _parse_object(await get_bytes(session, url, timeout_s=timeout_s, api_key=api_key))


async def get_bytes(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float, api_key: SecretStr | None = None
) -> bytes:
    """A GET's body, with the failures sorted as every call's are."""
    headers = {**replica_headers(api_key), "Accept": "*/*"}
    del headers["Content-Type"]
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            raw = await response.read()
    except TRANSPORT_ERRORS as e:
        raise _unavailable(e) from e
    _raise_for_status(response.status, raw)
    return raw


@dataclass(frozen=True)
class Described:
    """A replica's answer to `GET /v1/stack`: the stack, its fingerprint as computed here, and as claimed."""

    stack: Stack
    document: dict[str, Any]
    fingerprint: str
    claimed: object

    @property
    def honest(self) -> bool:
        return self.claimed == self.fingerprint


async def describe(session: aiohttp.ClientSession, base_url: str, *, timeout_s: float) -> Described:
    """Asks a replica for its stack; any failure to get a valid stack is `ReplicaUnavailable`."""
    try:
        described = await get_json(session, f"{base_url}/v1/stack", timeout_s=timeout_s)
        document = fingerprinted(described["stack"])
        stack = Stack.model_validate(document)
        computed = fingerprint(document)  # ValueError when it has no canonical form
    except (ReplicaRejected, ReplicaGarbage, KeyError, TypeError, ValidationError, ValueError) as e:
        raise ReplicaUnavailable(f"no valid stack at {base_url}/v1/stack: {str(e)[:300]}") from e
    return Described(stack, document, computed, described.get("fingerprint"))


@dataclass(frozen=True)
class Event:
    """One server-sent event: its `event:` name when the replica names it (the Responses API does), and its data."""

    name: str | None
    data: dict[str, Any]


class Stream:
    """An open event stream from a replica; iterate `events()` for each event, its `data:` payload parsed.

    A stream ends at `data: [DONE]` (chat and completions) or, for the Responses API, with the body after a
    terminal event (`response.completed` ...); any other end is a broken stream."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.stack_header = response.headers.get(STACK_HEADER)

    async def events(self) -> AsyncIterator[Event]:
        data_lines: list[str] = []
        name: str | None = None
        last: Event | None = None
        try:
            async with contextlib.aclosing(_lines(self._response.content)) as lines:
                async for raw_line in lines:
                    try:
                        line = raw_line.decode("utf-8").rstrip("\r\n")
                    except UnicodeDecodeError as e:
                        raise ReplicaGarbage(f"event stream is not UTF-8: {excerpt(raw_line, 80)!r}") from e
                    if line.startswith("data:"):
                        data_lines.append(line[5:].lstrip(" "))
                        continue
                    if line.startswith("event:"):
                        name = line[6:].strip() or None
                        continue
                    if line:
                        continue  # comments, ids and retry hints carry nothing we relay
                    if not data_lines:
                        name = (
                            None  # a keep-alive, or an event without data: none, and its name names no other
                        )
                        continue
                    payload, data_lines = "\n".join(data_lines), []
                    if payload == "[DONE]":
                        return
                    last, name = Event(name, _parse_object(payload.encode())), None
                    yield last
        except TRANSPORT_ERRORS as e:
            raise ReplicaUnavailable(f"stream broke: {type(e).__name__}: {e}") from e
        if last is not None and {last.name, _text(last.data.get("type"))} & TERMINAL_EVENTS:
            return
        raise ReplicaUnavailable("stream ended without data: [DONE]")

    def close(self) -> None:
        self._response.close()


async def open_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    api_key: SecretStr | None,
    timeout_s: float,
) -> Stream:
    try:
        response = await session.post(
            url,
            data=request_bytes(body),
            headers=replica_headers(api_key),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )
        if response.status != 200:
            raw = await response.read()
            response.close()
    except TRANSPORT_ERRORS as e:
        raise _unavailable(e) from e
    if response.status != 200:
        _raise_for_status(response.status, raw)
    if not response.headers.get("Content-Type", "").startswith("text/event-stream"):
        response.close()
        raise ReplicaGarbage("asked for a stream, got a response that is not text/event-stream")
    return Stream(response)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stream's lines, each with its end, of any length: aiohttp's own reading by line refuses one over
    512 KiB, and one event may carry a long prompt's token ids or, in a terminal event, a whole response."""
    pending = bytearray()
    async for chunk in content.iter_any():
        searched, start = len(pending), 0  # what was pending holds no line end
        pending += chunk
        while (end := pending.find(b"\n", searched)) != -1:
            yield bytes(pending[start : end + 1])
            start = searched = end + 1
        del pending[:start]
    if pending:
        yield bytes(pending)


def _unavailable(error: BaseException) -> ReplicaUnavailable:
    """A transport failure (refused, reset, timed out) as the retryable error it is."""
    return ReplicaUnavailable(f"{type(error).__name__}: {error}")


def _raise_for_status(status: int, raw: bytes) -> None:
    if status >= 500:
        raise ReplicaUnavailable(f"replica answered {status}", down=False)
    if status in (401, 403):
        # The replica refused the proxy's own key, not the client's: the client must not see that answer, which
        # may quote the key; a twin of the same stack may hold a good one.
        raise ReplicaUnavailable(
            f"replica refused the proxy's credentials ({status}); check its api_key_env", down=False
        )
    if status >= 400:
        try:
            body = read_json(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            body = {"error": {"message": excerpt(raw, 500), "type": "replica_error"}}
        raise ReplicaRejected(status, body)
    if status != 200:
        raise ReplicaGarbage(f"replica answered status {status}")


def _parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = read_json(raw)
    except ValueError as e:
        raise ReplicaGarbage(f"answer is not JSON: {excerpt(raw, 80)!r}") from e
    if not isinstance(body, dict):
        raise ReplicaGarbage(f"answer is JSON but not an object: {excerpt(raw, 80)!r}")
    return body


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def excerpt(raw: bytes, limit: int) -> str:
    """The start of what a replica sent, for a message. Cut between words, never inside one, so that a key the
    replica quotes is either whole (and redacted where the message is relayed) or absent."""
    text = raw.decode("utf-8", "replace")
    if len(text) <= limit:
        return text
    cut = text[: limit + 1]
    if not cut[-1].isspace():
        cut = cut.rsplit(None, 1)[0] if len(cut.split(None, 1)) > 1 else ""
    return (cut.rstrip() + " ...").lstrip()
