"""Running a study: each load level in turn, each side at it in turn, what is left of it sent by C workers while B
background clients send random requests to the same pin; every answer tallied as it comes.

How a request is sent is the caller's (`send`): `stackpin study` posts it to a proxy, as any client would, with the
side's pin and the request's tag in headers. A refusal that every later request would meet too (a 4xx: a pin that
matches nothing, a model that is not served, a key that is not known) stops the study at once; a failure that may
pass (a 5xx, a timeout, a rate limit) is counted and the study goes on, and since failed requests leave no record,
continuing the study later sends them again. The background clients' requests are drawn from a seeded generator,
so one study's background load is the same on every run, and they are tagged so that the log tells them apart.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from proxy.endpoints import CHAT
from proxy.evidence.probe import Reply
from proxy.evidence.study import Load, Side, StudyPlan, Tag, remaining
from proxy.evidence.study_report import StudyTally

# Refusals that say the study itself is wrong: every other request would be refused alike.
ABORTING = frozenset({400, 401, 403, 404, 405, 409, 413, 422})
# fmt: off
BACKGROUND_WORDS = (
    "harbour", "river", "mountain", "lantern", "orchard", "winter", "signal", "copper", "meadow", "engine",
    "letter", "garden", "thunder", "bridge", "violin", "compass", "island", "market", "shadow", "quartz",
    "ladder", "forest", "candle", "marble", "window", "pepper", "rocket", "silver",
)
# fmt: on
BACKGROUND_PAUSE_S = 0.5  # after a background request fails, so that a refused one does not spin


@dataclass(frozen=True)
class StudyRequest:
    endpoint: str
    body: dict[str, Any]
    pin: str  # the Stackpin-Pin header; "" for none
    tag: str  # the Stackpin-Tag header


Send = Callable[[StudyRequest], Awaitable[Reply]]
Answered = Callable[[Load, Side], None]


class StudyAborted(Exception):
    """A request was refused as every other would be: the message says what the proxy said."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def run_study(
    plan: StudyPlan, tally: StudyTally, send: Send, answered: Answered = lambda *_: None
) -> None:
    """Sends what `tally` does not hold yet; `answered` hears of each measured request as it ends."""
    for load, side, order in remaining(plan, tally.done()):
        if order:
            await _run_level(plan, tally, send, load, side, order, answered)


async def _run_level(
    plan: StudyPlan,
    tally: StudyTally,
    send: Send,
    load: Load,
    side: Side,
    order: list[int],
    answered: Answered,
) -> None:
    stop = asyncio.Event()
    model = plan.prompts[0].body.get("model")
    background = [
        asyncio.create_task(_background(send, stop, Tag(plan.study, side.key, load.label, None), side, model,
                                        random.Random(f"{plan.seed}/{side.key}/{load.label}/{k}")))
        for k in range(load.background)
    ]  # fmt: skip
    queue = iter(order)  # shared by the workers: each takes the next prompt when it is free

    async def worker() -> None:
        for index in queue:
            prompt = plan.prompts[index]
            tag = Tag(plan.study, side.key, load.label, index)
            reply = await send(StudyRequest(prompt.endpoint, prompt.body, side.pin, str(tag)))
            if reply[0] in ABORTING:
                raise StudyAborted(f"{side.name}: {_message(reply)}", reply[0])
            tally.add(side.key, load.label, index, reply)
            answered(load, side)

    workers = [asyncio.create_task(worker()) for _ in range(min(load.concurrency, len(order)))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for task in [*workers, *background]:
            task.cancel()
        await asyncio.gather(*workers, *background, return_exceptions=True)
        raise
    # The background clients finish the request they are in, so that the next level starts on a quiet replica.
    stop.set()
    await asyncio.gather(*background)


async def _background(
    send: Send, stop: asyncio.Event, tag: Tag, side: Side, model: Any, rng: random.Random
) -> None:
    while not stop.is_set():
        reply = await send(StudyRequest(CHAT, background_body(rng, model), side.pin, str(tag)))
        if reply[0] != 200:
            await asyncio.sleep(BACKGROUND_PAUSE_S)


def background_body(rng: random.Random, model: Any) -> dict[str, Any]:
    """A random request of random length, so that the batches around the measured requests keep changing."""
    words = " ".join(rng.choice(BACKGROUND_WORDS) for _ in range(rng.randint(4, 48)))
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Write about: {words}"}],
        "max_tokens": rng.randint(8, 64),
        "temperature": 0,
    }


def _message(reply: Reply) -> str:
    status, _, body = reply
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {status}: {message or body}"
