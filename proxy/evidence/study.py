"""A study: a prompt set sent R times each, at one or more load levels, against one pin or two side by side.

This module says what a study is and what is left of it to send. A study is named by an id drawn when it starts;
every request it sends carries a tag (`study/<id>/<side>/<load>/<prompt>`, or `.../bg` for its background load)
that the proxy keeps in the request's record, so the study's answers can be found in the audit log again: an
interrupted study continues by counting what is already there (proxy/evidence/study_log.py) and sending the rest.
A load level is a concurrency C (how many of the study's requests are in flight at once) and a background B (how
many clients meanwhile send random requests to the same pin, so that the batches the measured requests run in
keep changing). The repeats are sent round-robin over the prompts, so that at any moment the requests in flight
are mostly of different prompts. What the answers show is proxy/evidence/study_report.py's; sending them is
proxy/evidence/studying.py's. Pure.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.evidence.prompt_set import StudyPrompt, digest

SIDES = ("a", "b")
BACKGROUND = "bg"
_LOAD = re.compile(r"^(?P<c>[1-9][0-9]*)(?:\+(?P<b>[0-9]+))?$")
_LABEL = re.compile(r"^c(?P<c>[1-9][0-9]*)(?:\+b(?P<b>[1-9][0-9]*))?$")
_ID = re.compile(r"^st-[0-9a-f]{12}$")


@dataclass(frozen=True, order=True)
class Load:
    concurrency: int
    background: int = 0

    @property
    def label(self) -> str:
        """`c8+b4`: how it is named in tags and reports."""
        return f"c{self.concurrency}" + (f"+b{self.background}" if self.background else "")

    @classmethod
    def parse(cls, text: str) -> Load:
        """`8` (8 in flight) or `8+4` (and 4 background clients); ValueError saying how to write one."""
        match = _LOAD.match(text.strip())
        if match is None:
            raise ValueError(
                f"a load is C or C+B (concurrency, and background clients), e.g. 8+4; got {text!r}"
            )
        return cls(int(match["c"]), int(match["b"] or 0))

    @classmethod
    def from_label(cls, label: str) -> Load | None:
        match = _LABEL.match(label)
        return cls(int(match["c"]), int(match["b"] or 0)) if match else None


@dataclass(frozen=True)
class Side:
    key: str  # "a", or "b" for the pin compared with it
    pin: str  # the Stackpin-Pin header it sends; "" for none

    @property
    def name(self) -> str:
        return self.pin or "(no pin)"


@dataclass(frozen=True)
class Tag:
    study: str
    side: str
    load: str
    prompt: int | None  # None: background load

    def __str__(self) -> str:
        prompt = BACKGROUND if self.prompt is None else str(self.prompt)
        return f"study/{self.study}/{self.side}/{self.load}/{prompt}"


def parse_tag(text: str) -> Tag | None:
    """A study's tag, or None when `text` is not one."""
    parts = text.split("/")
    if len(parts) != 5 or parts[0] != "study" or parts[2] not in SIDES or Load.from_label(parts[3]) is None:
        return None
    if parts[4] == BACKGROUND:
        return Tag(parts[1], parts[2], parts[3], None)
    return Tag(parts[1], parts[2], parts[3], int(parts[4])) if parts[4].isdigit() else None


def new_study_id() -> str:
    return "st-" + secrets.token_hex(6)


def valid_study_id(text: str) -> bool:
    return _ID.match(text) is not None


@dataclass(frozen=True)
class StudyPlan:
    study: str
    prompts: list[StudyPrompt]
    repeats: int
    loads: list[Load]
    sides: list[Side]
    seed: int = 0  # the background load's randomness
    source: str = ""  # the prompt set's file name

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if not self.loads or len(set(self.loads)) != len(self.loads):
            raise ValueError("a study needs at least one load level, each named once")
        if not 1 <= len(self.sides) <= len(SIDES):
            raise ValueError("a study runs one pin, or two side by side")

    @property
    def requests(self) -> int:
        """How many measured requests the whole study sends."""
        return len(self.prompts) * self.repeats * len(self.loads) * len(self.sides)

    def identity(self) -> dict[str, Any]:
        """What must match for a study to be continued: the same requests, repeats, loads, pins and seed."""
        return {
            "prompts": digest(self.prompts),
            "repeats": self.repeats,
            "loads": [load.label for load in self.loads],
            "sides": {side.key: side.pin for side in self.sides},
            "seed": self.seed,
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "study": self.study,
            "source": self.source,
            "prompt_count": len(self.prompts),
            **self.identity(),
        }


@dataclass
class Done:
    """How many answers each (side, load, prompt) already has: what a study need not send again."""

    counts: dict[tuple[str, str, int], int] = field(default_factory=dict)

    def add(self, side: str, load: str, prompt: int, n: int = 1) -> None:
        key = (side, load, prompt)
        self.counts[key] = self.counts.get(key, 0) + n

    def of(self, side: str, load: str) -> Mapping[int, int]:
        return {p: n for (s, lo, p), n in self.counts.items() if s == side and lo == load}


def schedule(prompts: int, repeats: int, done: Mapping[int, int]) -> list[int]:
    """The prompts to send, in order: round-robin over the set, one repeat of each at a time, skipping the
    answers already in hand (a prompt with k answers is sent from its (k+1)th repeat on)."""
    return [p for r in range(repeats) for p in range(prompts) if done.get(p, 0) <= r]


def remaining(plan: StudyPlan, done: Done) -> Iterator[tuple[Load, Side, list[int]]]:
    """Each (load, side) of the plan, loads in order and the sides in turn at each, with what is left to send."""
    for load in plan.loads:
        for side in plan.sides:
            yield load, side, schedule(len(plan.prompts), plan.repeats, done.of(side.key, load.label))
