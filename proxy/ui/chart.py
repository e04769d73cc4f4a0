"""The probe's chart, as geometry for an inline SVG: one row per distinct answer, a bar for how often it came
back, and a strip of its tokens, shaded where it agrees with the most common answer and marked where it left it.
Pure; the template draws it, so nothing here builds markup.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.evidence.probe import ProbeResult

BAR_WIDTH = 220.0
STRIP_WIDTH = 380.0
ROW_HEIGHT = 22


@dataclass(frozen=True)
class ChartRow:
    y: int
    count: int
    share: float
    bar: float  # width of the count bar, the most common answer's the widest
    same: float  # width of the strip that agrees with the most common answer
    mark: float  # width of the divergent token (where only bits differ, the rest may agree)
    rest: float  # width of the strip after it
    kind: str  # "reference", "token" (another completion) or "bits" (the same tokens, other logprob bits)
    diverges_at: int | None
    length: int
    completion: int


@dataclass(frozen=True)
class Chart:
    rows: list[ChartRow]
    height: int
    longest: int


def chart(result: ProbeResult) -> Chart:
    answered = max(1, result.answered)
    most = max((v.count for v in result.variants), default=1)
    longest = max((v.length for v in result.variants), default=0)
    scale = STRIP_WIDTH / max(1, longest)
    rows = []
    for i, variant in enumerate(result.variants):
        k = variant.length if variant.diverges_at is None else variant.diverges_at
        kind = "reference" if i == 0 else ("bits" if variant.reason == "logprob" else "token")
        rows.append(
            ChartRow(
                y=i * ROW_HEIGHT,
                count=variant.count,
                share=variant.count / answered,
                bar=BAR_WIDTH * variant.count / most,
                same=k * scale,
                mark=min(1, max(0, variant.length - k)) * scale if kind == "bits" else 0.0,
                rest=max(0, variant.length - k - (1 if kind == "bits" else 0)) * scale,
                kind=kind,
                diverges_at=variant.diverges_at,
                length=variant.length,
                completion=variant.completion,
            )
        )
    return Chart(rows=rows, height=max(1, len(rows)) * ROW_HEIGHT, longest=longest)
