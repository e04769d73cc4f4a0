"""A study report's charts, as geometry for inline SVG: the divergence rate of each side at each load with its 95%
interval (a forest plot), where answers first diverged (a histogram per side, on one scale), and every prompt as a
cell shaded by how many distinct answers it came back as. Pure; the templates draw it, so nothing here builds
markup. Everything is read from the report's JSON (proxy/evidence/study_report.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FOREST_LEFT = 170.0  # room for the row labels
FOREST_WIDTH = 480.0  # 0% to 100%
FOREST_ROW = 26
HIST_WIDTH = 560.0
HIST_HEIGHT = 90.0
HIST_BUCKETS = 28
CELL = 14
CELLS_A_ROW = 40


@dataclass(frozen=True)
class Mark:
    x: float  # the rate
    low: float
    high: float
    words: str  # "14 of 20, 70% (48-85%)"


@dataclass(frozen=True)
class ForestRow:
    y: int
    label: str
    side: str
    tokens: Mark | None
    bits: Mark | None


@dataclass(frozen=True)
class Forest:
    rows: list[ForestRow]
    height: int
    ticks: list[tuple[float, str]]


@dataclass(frozen=True)
class Bucket:
    x: float
    width: float
    tokens: float  # bar heights
    bits: float
    first: int  # the positions it holds, first to last
    last: int
    counts: tuple[int, int]


@dataclass(frozen=True)
class Histogram:
    side: str
    pin: str
    buckets: list[Bucket]
    last: int  # the axis' last position
    empty: bool


@dataclass(frozen=True)
class Cell:
    x: int
    y: int
    prompt: int
    kind: str  # "same", "bits", "two", "many", "none"
    words: str


@dataclass(frozen=True)
class PromptMap:
    side: str
    pin: str
    cells: list[Cell]
    height: int


def forest(report: Mapping[str, Any]) -> Forest:
    rows: list[ForestRow] = []
    several = any(len(side["loads"]) > 1 for side in report["sides"])
    for load in ([None] if several else []) + _load_labels(report):
        for side in report["sides"]:
            summary = side["overall"] if load is None else _at(side, load)
            if summary is None:
                continue
            label = f"{side['key']} · {'all loads' if load is None else load}"
            tokens = _mark(summary["diverged"])
            bits = _mark(summary["diverged_bits"]) if summary["bits_given"] else None
            rows.append(ForestRow(len(rows) * FOREST_ROW, label, side["key"], tokens, bits))
    ticks = [(FOREST_LEFT + FOREST_WIDTH * q, f"{q:.0%}") for q in (0, 0.25, 0.5, 0.75, 1)]
    return Forest(rows, max(1, len(rows)) * FOREST_ROW, ticks)


def _load_labels(report: Mapping[str, Any]) -> list[str]:
    return list(dict.fromkeys(load["load"] for side in report["sides"] for load in side["loads"]))


def _at(side: Mapping[str, Any], label: str) -> Mapping[str, Any] | None:
    return next((load for load in side["loads"] if load["load"] == label), None)


def _mark(rate: Mapping[str, Any]) -> Mark | None:
    if not rate["total"]:
        return None
    words = f"{rate['hits']} of {rate['total']}, {rate['rate']:.0%} ({rate['low']:.0%}-{rate['high']:.0%})"
    return Mark(
        FOREST_LEFT + FOREST_WIDTH * rate["rate"],
        FOREST_LEFT + FOREST_WIDTH * rate["low"],
        FOREST_LEFT + FOREST_WIDTH * rate["high"],
        words,
    )


def histograms(report: Mapping[str, Any]) -> list[Histogram]:
    """One per side, on a common axis and scale, so that two sides read against each other."""
    counted = [
        (side, _counts(side["overall"]["positions"]), _counts(side["overall"]["bit_positions"]))
        for side in report["sides"]
    ]
    last = max((max([*t, *b], default=0) for _, t, b in counted), default=0)
    width = max(1, math.ceil((last + 1) / HIST_BUCKETS))
    buckets = math.ceil((last + 1) / width)
    sums = [[_bucketed(t, width, buckets), _bucketed(b, width, buckets)] for _, t, b in counted]
    tallest = max((t + b for tokens, bits in sums for t, b in zip(tokens, bits, strict=True)), default=0)
    scale = HIST_HEIGHT / max(1, tallest)
    step = HIST_WIDTH / buckets
    drawn = []
    for (side, tokens, bits), (by_token, by_bits) in zip(counted, sums, strict=True):
        bars = [
            Bucket(k * step, step - 1, by_token[k] * scale, by_bits[k] * scale, k * width, (k + 1) * width - 1,
                   (by_token[k], by_bits[k]))
            for k in range(buckets)
            if by_token[k] or by_bits[k]
        ]  # fmt: skip
        drawn.append(Histogram(side["key"], side["pin"], bars, buckets * width - 1, not (tokens or bits)))
    return drawn


def _counts(positions: Mapping[str, Any]) -> dict[int, int]:
    return {int(position): int(count) for position, count in positions["histogram"]}


def _bucketed(counts: dict[int, int], width: int, buckets: int) -> list[int]:
    sums = [0] * buckets
    for position, count in counts.items():
        sums[position // width] += count
    return sums


def prompt_maps(report: Mapping[str, Any]) -> list[PromptMap]:
    """Per side, a cell per prompt: the same answer every time, the same tokens with other bits, two
    completions, or more."""
    maps = []
    for side in report["sides"]:
        cells = []
        for k, prompt in enumerate(report["prompts"]):
            summary = prompt["sides"][side["key"]]["overall"]
            cells.append(
                Cell(
                    (k % CELLS_A_ROW) * CELL,
                    (k // CELLS_A_ROW) * CELL,
                    prompt["index"],
                    _kind(summary),
                    f"prompt {prompt['index']}: {_words(summary)}",
                )
            )
        rows = max(1, math.ceil(len(cells) / CELLS_A_ROW))
        maps.append(PromptMap(side["key"], side["pin"], cells, rows * CELL))
    return maps


def _kind(summary: Mapping[str, Any]) -> str:
    if not summary["answers"]:
        return "none"
    completions, bitwise = summary["distinct_completions"], summary["distinct_bitwise"]
    if completions == 1:
        return "same" if bitwise == 1 else "bits"
    return "two" if completions == 2 else "many"


def _words(summary: Mapping[str, Any]) -> str:
    if not summary["answers"]:
        return "no answer"
    share = summary["most_common_share"]
    return (
        f"{summary['distinct_completions']} completion(s), {summary['distinct_bitwise']} bitwise, "
        f"the most common {share:.0%} of {summary['answers']}"
    )
