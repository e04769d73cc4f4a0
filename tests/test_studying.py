"""Running a study: what is left is sent, C at a time, while B background clients keep the batch changing; a
refusal every request would meet stops it; a passing failure is counted and the study goes on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.evidence.prompt_set import Defaults, read_prompt_set
from proxy.evidence.study import Load, Side, StudyPlan, parse_tag
from proxy.evidence.study_report import StudyTally
from proxy.evidence.studying import StudyAborted, StudyRequest, background_body, run_study

PROMPTS = read_prompt_set("one\ntwo\nthree\nfour", name="p.txt", defaults=Defaults("m", 8))
SIDES = [Side("a", "kernel_mode=batch_invariant"), Side("b", "kernel_mode=default")]


def plan(loads: list[Load], repeats: int = 2, sides: list[Side] = SIDES) -> StudyPlan:
    return StudyPlan("st-0123456789ab", PROMPTS, repeats, loads, sides)


def answer(request: StudyRequest) -> Any:
    body = {"choices": [{"index": 0, "message": {"content": "ok"}}], "stackpin": {"token_ids": [1]}}
    return 200, {"Stackpin-Record": "rec_x", "Stackpin-Stack": "fp"}, body


class Replica:
    """Answers after a pause, and notes what was in flight."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.sent: list[StudyRequest] = []
        self.measured_in_flight = 0
        self.most_measured = 0
        self.background_while_measuring = 0

    async def send(self, request: StudyRequest) -> Any:
        self.sent.append(request)
        tag = parse_tag(request.tag)
        assert tag is not None
        measured = tag.prompt is not None
        if measured:
            self.measured_in_flight += 1
            self.most_measured = max(self.most_measured, self.measured_in_flight)
        elif self.measured_in_flight:
            self.background_while_measuring += 1
        await asyncio.sleep(0.002)
        if measured:
            self.measured_in_flight -= 1
        if self.status != 200 and measured:
            return self.status, {}, {"error": {"message": "no replica matches the pin"}}
        return answer(request)


async def test_every_request_is_sent_once_c_at_a_time_with_its_side_pin_and_tag() -> None:
    replica, tally = Replica(), StudyTally()
    ends: list[str] = []
    await run_study(plan([Load(3)]), tally, replica.send, lambda load, side: ends.append(side.key))
    assert len(replica.sent) == 4 * 2 * 2 and replica.most_measured == 3
    first = replica.sent[0]
    assert (first.pin, first.tag, first.body) == (
        SIDES[0].pin,
        "study/st-0123456789ab/a/c3/0",
        PROMPTS[0].body,
    )
    assert [parse_tag(r.tag).side for r in replica.sent] == ["a"] * 8 + ["b"] * 8  # type: ignore[union-attr]
    assert ends == ["a"] * 8 + ["b"] * 8
    assert sum(tally.done().counts.values()) == 16


async def test_background_clients_send_random_requests_alongside_and_stop_with_the_level() -> None:
    replica = Replica()
    await run_study(plan([Load(2, 3), Load(1)], sides=SIDES[:1]), StudyTally(), replica.send)
    background = [r for r in replica.sent if r.tag.endswith("/bg")]
    assert background and all(r.tag == "study/st-0123456789ab/a/c2+b3/bg" for r in background)
    assert all(r.pin == SIDES[0].pin for r in background), "on the side's pin, so they share its batches"
    assert replica.background_while_measuring > 0
    at_c1 = replica.sent[replica.sent.index(next(r for r in replica.sent if "/c1/" in r.tag)) :]
    assert not any(r.tag.endswith("/bg") for r in at_c1), "the background stopped with its level"
    bodies = {str(r.body["messages"]) for r in background}
    assert len(bodies) > 1, "random requests, so that the batch keeps changing"


def test_the_background_is_the_same_on_every_run_of_a_seed() -> None:
    import random

    first = [background_body(random.Random("0/a/c8+b4/1"), "m") for _ in range(5)]
    again = [background_body(random.Random("0/a/c8+b4/1"), "m") for _ in range(5)]
    assert first == again and first[0]["model"] == "m" and first[0]["temperature"] == 0


async def test_what_the_tally_already_holds_is_not_sent_again() -> None:
    tally = StudyTally()
    for prompt in range(4):
        for _ in range(2):
            tally.add("a", "c2", prompt, answer(None))  # type: ignore[arg-type]
    tally.add("b", "c2", 3, answer(None))  # type: ignore[arg-type]
    replica = Replica()
    await run_study(plan([Load(2)]), tally, replica.send)
    assert [r.tag.rsplit("/", 1)[1] for r in replica.sent] == ["0", "1", "2", "0", "1", "2", "3"]


async def test_a_refusal_every_request_would_meet_stops_the_study_and_its_background() -> None:
    replica = Replica(status=409)
    with pytest.raises(StudyAborted, match="kernel_mode=batch_invariant: HTTP 409: no replica matches"):
        await run_study(plan([Load(2, 2)]), StudyTally(), replica.send)
    sent = len(replica.sent)
    await asyncio.sleep(0.05)
    assert len(replica.sent) == sent, "nothing keeps sending once the study has stopped"


async def test_a_passing_failure_is_counted_and_the_study_goes_on() -> None:
    replica, tally = Replica(status=503), StudyTally()
    await run_study(plan([Load(2)], sides=SIDES[:1]), tally, replica.send)
    assert len(replica.sent) == 8 and tally.failures() == 8 and not tally.done().counts
