"""`stackpin replay --since ...`: a slice replayed through a running proxy, gated by --require. Exit codes: 0 when
the agreement meets the requirement, 1 when it does not, 2 on an error (usage, nothing to replay, a stack nothing
live matches)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proxy.commands.cli import main as stackpin
from tests.support.fake_replica import FakeReplica, tiny_stack
from tests.support.proxy_harness import Harness, running_proxy


@dataclass
class World:
    harness: Harness
    default: FakeReplica
    config: Path
    since: str

    def replay(self, *more: str) -> list[str]:
        return [
            "replay",
            "--since",
            self.since,
            "--url",
            self.harness.url,
            "--config",
            str(self.config),
            *more,
        ]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    invariant, default = FakeReplica(), FakeReplica(stack=tiny_stack(kernel_mode="default"))
    for fake in (invariant, default):
        await fake.start()
    try:
        async with running_proxy([invariant, default], tmp_path) as harness:
            since = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
            for k in range(5):
                body = {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": f"q{k}"}],
                    "max_tokens": 4,
                }
                headers = {"Stackpin-Pin": "kernel_mode=batch_invariant"}
                assert (await harness.post("/v1/chat/completions", body, headers=headers))[0] == 200
            config = tmp_path / "stackpin.toml"
            config.write_text(
                f'[store]\nurl = "{harness.settings.store.url}"\n[local_backend]\nenabled = "off"\n'
            )
            yield World(harness, default, config, since)
    finally:
        for fake in (invariant, default):
            await fake.stop()


async def run(args: list[str]) -> int:
    return await asyncio.to_thread(stackpin, args)


async def test_a_slice_that_reproduces_meets_the_default_requirement_and_exits_0(
    world: World, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "outcomes.jsonl"
    assert await run(world.replay("--out", str(out))) == 0
    printed = capsys.readouterr().out
    assert "replayed 5 records on their own stacks" in printed and "identical>=1: met (1.0000)" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 5 and {line["agreement"] for line in lines} == {"identical"}
    assert all(line["replay_record"].startswith("rec_") for line in lines)


async def test_a_change_that_moves_bits_fails_identical_but_passes_a_requirement_on_tokens(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.default.nondeterministic = True
    on_default = world.replay("--on", "kernel_mode=default", "--json")
    assert await run([*on_default, "--require", "identical>=0.999"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["counts"]["same_tokens"] == 5 and not report["requirement"]["met"]
    assert report["divergences"][0]["reason"] == "logprob"
    assert await run([*on_default, "--require", "same_tokens>=1.0"]) == 0
    assert json.loads(capsys.readouterr().out)["requirement"] == {
        "level": "same_tokens",
        "share": 1.0,
        "met": True,
    }


async def test_a_diverging_slice_names_its_first_divergences_and_exits_1(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.default.diverge_from = 1
    assert await run(world.replay("--on", "kernel_mode=default", "--limit", "3", "--rate", "0")) == 1
    printed = capsys.readouterr().out
    assert "replayed 3 records on kernel_mode=default" in printed
    assert (
        "diverged at token 1 of choice 0 (token)" in printed and "identical>=1: NOT MET (0.0000)" in printed
    )


async def test_errors_exit_2_with_one_line(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    assert await run(world.replay("--on", "kernel_mode=no_such_mode")) == 2
    assert "the slice stopped: HTTP 409" in capsys.readouterr().err
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert await run([*world.replay(), "--since", later]) == 2
    assert "nothing in the slice was replayed" in capsys.readouterr().err
    assert await run(world.replay("--require", "identical>0.9")) == 2
    assert "a requirement is LEVEL>=SHARE" in capsys.readouterr().err
    assert await run(world.replay("rec_" + "0" * 32)) == 2
    assert "not both" in capsys.readouterr().err
    assert await run(["replay", "--url", world.harness.url]) == 2
    assert "name the RECORD to replay, a batch with --batch ID, or a slice" in capsys.readouterr().err
    assert await run([*world.replay(), "--since", "yesterday"]) == 2
    assert "--since must be an ISO 8601 time" in capsys.readouterr().err
    assert await run(world.replay("--stack", "XYZ")) == 2
    assert "lowercase hex" in capsys.readouterr().err


async def test_another_tenants_records_are_skipped_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = FakeReplica()
    await replica.start()
    keys = {"KEY_ACME": "sk-acme", "KEY_GLOBEX": "sk-globex"}
    tenants = [{"name": "acme", "api_key_env": "KEY_ACME"}, {"name": "globex", "api_key_env": "KEY_GLOBEX"}]
    try:
        async with running_proxy([replica], tmp_path, environ=keys, tenants=tenants) as harness:
            since = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            for key in ("sk-acme", "sk-acme", "sk-globex"):
                headers = {"Authorization": f"Bearer {key}"}
                assert (await harness.post("/v1/chat/completions", body, headers=headers))[0] == 200
            config = tmp_path / "stackpin.toml"
            config.write_text(
                f'[store]\nurl = "{harness.settings.store.url}"\n[local_backend]\nenabled = "off"\n'
            )
            monkeypatch.setenv("MY_KEY", "sk-acme")
            args = ["replay", "--since", since, "--url", harness.url, "--config", str(config),
                    "--api-key-env", "MY_KEY", "--json"]  # fmt: skip
            assert await run(args) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["counts"]["identical"] == 2 and report["counts"]["failed"] == 0
            assert list(report["skipped"].values()) == [1] and "another tenant" in next(
                iter(report["skipped"])
            )
    finally:
        await replica.stop()
