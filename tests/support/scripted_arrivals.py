"""Scripted arrivals: drive an engine step by step, each request submitted before the step it is scheduled for.

Live traffic decides who shares a step with whom; a script decides it exactly and the same way every run, so a
test or a benchmark can place a request amid precisely the neighbours it wants. Knows nothing of HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pinned_backend.engine import Engine, TokenOutput
from pinned_backend.sampling import SamplingParams


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


def run_schedule(
    engine: Engine, arrivals: Iterable[Arrival], *, max_steps: int = 100_000
) -> dict[str, list[TokenOutput]]:
    """Every request's token outputs, once each has finished; raises if the schedule has not ended by `max_steps`."""
    pending = sorted(arrivals, key=lambda a: a.step)
    outputs: dict[str, list[TokenOutput]] = {a.request_id: [] for a in pending}
    step = 0
    while pending or engine.has_work():
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            engine.submit(
                arrival.request_id, arrival.prompt, arrival.params, outputs[arrival.request_id].append
            )
        engine.step()
        step += 1
        if step >= max_steps:
            raise RuntimeError(f"the schedule did not finish within {max_steps} steps")
    return outputs
