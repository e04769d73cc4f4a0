"""`stackpin study`: a prompt set sent R times at each load against two pins side by side through a running proxy;
the rates with their intervals as JSON and an HTML file; an interrupted study continued from the audit log; and
the exit codes (0 every answer in, 2 an error or answers missing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.commands.cli import main as stackpin
from tests.support.fake_replica import FakeReplica, tiny_stack
from tests.support.proxy_harness import Harness, running_proxy

PROMPTS = ["Name a colour.", "What is two plus two?", "Say hello.", "Count to three.", "Name a tree."]


@dataclass
class World:
    harness: Harness
    invariant: FakeReplica
    default: FakeReplica
    folder: Path
    config: Path
    prompts: Path

    def study(self, *more: str, out: str = "study") -> list[str]:
        return [
            "study", str(self.prompts), "--url", self.harness.url, "--config", str(self.config),
            "--model", "fake-model", "--max-tokens", "6", "-n", "4", "--load", "2", "--load", "3+2",
            "--pin", "kernel_mode=batch_invariant", "--compare", "kernel_mode=default",
            "--out", str(self.folder / out), *more,
        ]  # fmt: skip


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    invariant = FakeReplica()
    default = FakeReplica(stack=tiny_stack(kernel_mode="default"), nondeterministic=True)
    for fake in (invariant, default):
        await fake.start()
    try:
        async with running_proxy([invariant, default], tmp_path) as harness:
            config = tmp_path / "stackpin.toml"
            config.write_text(
                f'[store]\nurl = "{harness.settings.store.url}"\n[local_backend]\nenabled = "off"\n'
            )
            prompts = tmp_path / "prompts.txt"
            prompts.write_text("\n".join(PROMPTS) + "\n")
            yield World(harness, invariant, default, tmp_path, config, prompts)
    finally:
        for fake in (invariant, default):
            await fake.stop()


def measured(fake: FakeReplica) -> int:
    return sum(1 for body in fake.requests if not body["messages"][0]["content"].startswith("Write about:"))


async def test_a_study_reports_each_sides_rate_with_its_interval_per_load_and_pooled(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.default.nondeterministic_tokens = True
    assert await asyncio.to_thread(stackpin, [*world.study(), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["complete"] and report["answered"] == 5 * 4 * 2 * 2
    a, b = report["sides"]
    assert (a["pin"], b["pin"]) == ("kernel_mode=batch_invariant", "kernel_mode=default")
    assert a["overall"]["diverged"] == {
        "hits": 0,
        "total": 5,
        "rate": 0.0,
        "low": 0.0,
        "high": a["overall"]["diverged"]["high"],
    }
    assert a["overall"]["diverged_bits"]["hits"] == 0 and a["overall"]["stacks"] == [
        world.invariant.fingerprint
    ]
    assert b["overall"]["diverged_bits"]["hits"] == 5, "8 answers a prompt, each with a flipped bit somewhere"
    assert b["overall"]["diverged"]["hits"] >= 1 and b["overall"]["positions"]["count"] >= 1
    assert [load["load"] for load in b["loads"]] == ["c2", "c3+b2"]
    assert all(load["answers"] == 20 for side in (a, b) for load in side["loads"])
    prompt = report["prompts"][0]
    assert prompt["label"] == "Name a colour." and prompt["sides"]["a"]["overall"]["most_common_share"] == 1.0
    assert set(prompt["sides"]["b"]["loads"]) == {"c2", "c3+b2"}

    assert measured(world.invariant) == measured(world.default) == 40
    background = len(world.invariant.requests) - 40
    assert background > 0, "the background load ran beside the measured requests at c3+b2"
    state = json.loads((world.folder / "study" / "study.json").read_text())
    assert state["report"]["sides"] == report["sides"]
    html = (world.folder / "study" / "report.html").read_text()
    assert report["study"] in html and "<script" not in html and "kernel_mode=default" in html


async def test_the_summary_names_each_side_and_links_the_audit_page(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(stackpin, world.study()) == 0
    out = capsys.readouterr().out
    assert "kernel_mode=batch_invariant: 0 of 5 prompts diverged (0%, 95% CI 0%-43%)" in out
    assert "kernel_mode=default:" in out and "in logprob bits 5 of 5" in out
    assert f"{world.harness.url}/ui/studies/st-" in out and "report.html" in out


async def test_an_interrupted_study_continues_from_the_log_and_sends_only_what_is_missing(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.default.failure = "garbage"  # every answer of side b fails: nothing of it reaches the log
    assert await asyncio.to_thread(stackpin, world.study()) == 2
    err = capsys.readouterr().err
    assert "40 of 80 requests have no answer yet; run the same command again" in err
    sent_to_a = len(world.invariant.requests)

    world.default.failure = None
    assert await asyncio.to_thread(stackpin, [*world.study(), "--json"]) == 0
    captured = capsys.readouterr()
    assert "40 answers already in the log" in captured.err
    report = json.loads(captured.out)
    assert report["complete"] and report["answered"] == 80
    assert len(world.invariant.requests) == sent_to_a, "side a's answers came from the log, none sent again"
    assert measured(world.default) == 40 + 40, "the failed requests, then each of side b's once"

    assert await asyncio.to_thread(stackpin, [*world.study(), "--json"]) == 0, "a finished study only reports"
    assert json.loads(capsys.readouterr().out)["sides"] == report["sides"]
    assert len(world.invariant.requests) == sent_to_a


async def test_mistakes_are_one_line_and_exit_2(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    bad_pin = world.study()
    bad_pin[bad_pin.index("kernel_mode=default")] = "kernel_mode"
    assert await asyncio.to_thread(stackpin, bad_pin) == 2
    assert "must be key=value" in capsys.readouterr().err

    assert await asyncio.to_thread(stackpin, [*world.study(), "--load", "x"]) == 2
    assert "a load is C or C+B" in capsys.readouterr().err

    nowhere = world.study(out="other")
    nowhere[nowhere.index("kernel_mode=default")] = "kernel_mode=no_such_mode"
    assert await asyncio.to_thread(stackpin, nowhere) == 2
    err = capsys.readouterr().err
    assert "the study stopped: kernel_mode=no_such_mode: HTTP 409" in err and "kernel_modes = [" in err

    assert await asyncio.to_thread(stackpin, world.study(out="another")) == 0
    capsys.readouterr()
    other_plan = world.study(out="another")
    other_plan[other_plan.index("-n") + 1] = "5"
    assert await asyncio.to_thread(stackpin, other_plan) == 2
    assert "holds another study" in capsys.readouterr().err
