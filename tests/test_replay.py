"""Replay: the exact request resent to the identical stack, compared token by token and logprob bit by bit;
recorded and linked to its original; over HTTP and through `stackpin replay` with meaningful exit codes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from proxy.cli import main as stackpin
from tests.audit_databases import KINDS
from tests.fake_replica import FakeReplica
from tests.proxy_harness import Harness, running_proxy

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "temperature": 0,
}


async def answer(harness: Harness, body: dict[str, object] = CHAT) -> str:
    status, _, headers = await harness.post("/v1/chat/completions", body)
    assert status == 200
    return headers["Stackpin-Record"]


@pytest.mark.parametrize("store", KINDS)
async def test_a_deterministic_answer_replays_as_reproduced_and_the_replay_is_recorded(
    replica: FakeReplica, tmp_path: Path, store: str
) -> None:
    async with running_proxy([replica], tmp_path, store=store) as harness:
        record_id = await answer(harness)
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 200
        assert result["outcome"] == "reproduced" and result["compared"] == "tokens"
        assert result["stack"] == replica.fingerprint
        replay = await harness.proxy.store.get_record(result["replay_record"], "local")
        assert replay is not None and replay.replay_of == record_id
        assert replay.entries[0].content["replay"]["outcome"] == "reproduced"
        assert (await harness.proxy.store.verify()).ok


async def test_a_nondeterministic_replica_diverges_at_the_perturbed_token(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        record_id = await answer(harness)
        replica.nondeterministic = True
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 200
        assert result["outcome"] == "diverged" and result["reason"] == "logprob"
        assert 0 <= result["position"] < 8
        assert result["original_logprob"] != result["replayed_logprob"]


async def test_a_streamed_answer_with_a_drawn_seed_replays_with_that_seed(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        body = {**CHAT, "temperature": 0.8, "stream": True}
        import aiohttp

        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json=body) as r,
        ):
            record_id = r.headers["Stackpin-Record"]
            await r.read()
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 200 and result["outcome"] == "reproduced"
        assert isinstance(replica.requests[-1]["seed"], int) and "stream" not in replica.requests[-1]


async def test_replay_on_another_stack_and_on_a_stack_with_no_live_replica(
    replica: FakeReplica, tmp_path: Path
) -> None:
    other = FakeReplica(stack={**replica.stack, "kernel_mode": "default"})
    await other.start()
    try:
        async with running_proxy([replica, other], tmp_path) as harness:
            record_id = await answer(harness, {**CHAT, "stackpin": {"kernel_mode": "batch_invariant"}})
            status, result, _ = await harness.post(
                f"/v1/records/{record_id}/replay", {"on": {"kernel_mode": "default"}}
            )
            assert status == 200 and result["stack"] == other.fingerprint
            harness.proxy.registry.unreachable("replica-0")
            status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
            assert status == 503
            assert [s["fingerprint"] for s in result["error"]["live_stacks"]] == [other.fingerprint]
    finally:
        await other.stop()


async def test_the_cli_exits_0_when_reproduced_1_when_diverged_2_on_error(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        record_id = await answer(harness)

        def replay(*extra: str) -> int:
            return stackpin(["replay", record_id, "--url", harness.url, *extra])

        assert await asyncio.to_thread(replay) == 0
        assert "reproduced" in capsys.readouterr().out
        replica.nondeterministic = True
        assert await asyncio.to_thread(replay) == 1
        printed = capsys.readouterr().out
        assert "diverged" in printed and "first divergence at token" in printed
        replica.nondeterministic = False
        assert await asyncio.to_thread(replay, "--json") == 0
        assert json.loads(capsys.readouterr().out)["outcome"] == "reproduced"
        harness.proxy.registry.unreachable("replica-0")
        assert await asyncio.to_thread(replay) == 2
        printed = capsys.readouterr().err
        assert "none of their replicas is in rotation" in printed and "no stack is live" in printed
        assert await asyncio.to_thread(lambda: stackpin(["replay", "rec_unknown", "--url", harness.url])) == 2
