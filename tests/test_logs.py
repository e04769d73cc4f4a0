"""Logs are JSON lines, each line about a request carries its record id, and no key ever reaches a line."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import structlog

from proxy.logs import configure_logging
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


async def test_request_lines_carry_the_record_id_and_never_a_key(
    replica: FakeReplica, tmp_path: Path
) -> None:
    sink = io.StringIO()
    configure_logging("info", sink)
    try:
        replicas = [
            {"name": "upstream", "url": replica.url, "api_key_env": "UP", "stack": {"model": "fake-model"}}
        ]
        tenants = [{"name": "acme", "api_key_env": "ACME"}]
        environ = {"UP": "sk-upstream-very-secret", "ACME": "sk-client-very-secret"}
        async with running_proxy(
            [], tmp_path, replicas=replicas, tenants=tenants, environ=environ
        ) as harness:
            auth = {"Authorization": "Bearer sk-client-very-secret"}
            status, _, headers = await harness.post("/v1/chat/completions", CHAT, headers=auth)
            assert status == 200
            await harness.post("/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sk-wrong-key"})
            replica.failure = "500"
            await harness.post("/v1/chat/completions", CHAT, headers=auth)
    finally:
        configure_logging("info", sys.stderr)
    text = sink.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    assert all("event" in line and "timestamp" in line for line in lines)
    answered = [line for line in lines if line["event"] == "answered"]
    assert answered and answered[0]["record_id"] == headers["Stackpin-Record"]
    for secret in ("sk-upstream-very-secret", "sk-client-very-secret", "sk-wrong-key"):
        assert secret not in text


class Writes(io.StringIO):
    """A stream that keeps each write() apart, as an unbuffered stderr hands each to the kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_each_line_is_written_whole_in_one_write_so_processes_sharing_stderr_never_split_one() -> None:
    writes = Writes()
    configure_logging("info", writes)
    try:
        structlog.get_logger("stackpin.test").info("proxy_event", detail="x" * 300)
        logging.getLogger("aiohttp.test").warning("a library's line")
    finally:
        configure_logging("info", sys.stderr)
    lines = [call for call in writes.calls if call]
    assert len(lines) == 2, lines
    for call in lines:
        assert call.endswith("\n") and call.count("\n") == 1, call
        json.loads(call)
