"""Reading a study back from the audit log: its measured answers found by their tags, whatever else the log holds
(other studies, its own background load, untagged requests, replays), with the pins, loads and prompts they tell."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from proxy.evidence.study import Load
from proxy.evidence.study_log import read_study
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy

STUDY, OTHER = "st-0123456789ab", "st-ffffffffffff"


def chat(content: str) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


async def test_the_study_is_found_by_its_tags_and_nothing_else_is(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        began = datetime.now(UTC)

        async def ask(content: str, tag: str | None, pin: str = "kernel_mode=batch_invariant") -> str:
            headers = {"Stackpin-Pin": pin} | ({"Stackpin-Tag": tag} if tag else {})
            status, _, answered = await harness.post("/v1/chat/completions", chat(content), headers=headers)
            assert status == 200
            return answered["Stackpin-Record"]

        for _ in range(3):
            await ask("Name a colour.", f"study/{STUDY}/a/c2/0")
        await ask("Say hello.", f"study/{STUDY}/a/c8+b4/1")
        await ask("Write about: lanterns", f"study/{STUDY}/a/c8+b4/bg")
        await ask("Name a colour.", f"study/{OTHER}/a/c2/0")
        untagged = await ask("Name a colour.", None)
        await ask("Name a colour.", "mine")
        status, _, _ = await harness.post(f"/v1/records/{untagged}/replay", {})
        assert status == 200

        found = await read_study(harness.proxy.store, STUDY, since=began - timedelta(seconds=5))
        assert found.tally.done().counts == {("a", "c2", 0): 3, ("a", "c8+b4", 1): 1}
        assert found.loads == {Load(2), Load(8, 4)} and found.labels == {0: "Name a colour.", 1: "Say hello."}
        assert found.pins == {"a": "model=fake-model, kernel_mode=batch_invariant"}
        assert found.read == 8, "every answered record of the window is read once; the replay is not"
        assert found.first is not None and found.last is not None and found.first <= found.last
        shape = found.shape()
        assert [s.key for s in shape.sides] == ["a"] and shape.loads == [Load(2), Load(8, 4)]

        later = await read_study(harness.proxy.store, STUDY, since=datetime.now(UTC) + timedelta(seconds=1))
        assert not later.tally.tallies and later.read == 0, "nothing before `since` is read"
        other_tenant = await read_study(harness.proxy.store, STUDY, since=began, tenant="acme")
        assert not other_tenant.tally.tallies
