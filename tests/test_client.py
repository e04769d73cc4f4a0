"""`stackpin probe`: one request sent N times at a given concurrency, and how many distinct completions came back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from proxy.commands.cli import main as stackpin
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy


async def test_probe_counts_one_completion_when_deterministic_and_more_when_not(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:

        def probe() -> int:
            args = ["probe", "--url", harness.url, "--model", "fake-model", "-n", "12", "-c", "4", "--json"]
            return stackpin(args)

        assert await asyncio.to_thread(probe) == 0
        summary = json.loads(capsys.readouterr().out)
        assert (
            summary["answered"] == 12 and summary["distinct_completions"] == summary["distinct_bitwise"] == 1
        )
        assert summary["stacks"] == [replica.fingerprint]
        replica.nondeterministic = True
        assert await asyncio.to_thread(probe) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["distinct_completions"] == 1, "the fake perturbs logprob bits, not tokens"
        assert summary["distinct_bitwise"] > 1


async def test_probe_reports_failures_and_exits_2(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        replica.failure = "garbage"
        code = await asyncio.to_thread(
            stackpin, ["probe", "--url", harness.url, "--model", "fake-model", "-n", "3"]
        )
        assert code == 2
        assert "3 failed" in capsys.readouterr().out
