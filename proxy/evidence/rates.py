"""Rates and their spread: the share of prompts that diverged, with its Wilson score interval, and where answers
first diverged, as a distribution.

One output is one draw: a study sends each prompt many times and counts the prompts whose answers ever differ.
That count over the prompts is a binomial proportion, and with tens of prompts its uncertainty is as large as the
rate itself, so a rate is never reported without its interval. The Wilson interval is the one used here: unlike
the normal approximation it stays inside [0, 1] and keeps its coverage at 0 of n and n of n, which is where a
batch-invariant stack sits. Pure functions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile: a two-sided 95% interval


@dataclass(frozen=True)
class Rate:
    """`hits` of `total`, with the interval [low, high] at the confidence `z` stands for."""

    hits: int
    total: int
    low: float
    high: float

    @property
    def value(self) -> float | None:
        return self.hits / self.total if self.total else None

    def as_json(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "total": self.total,
            "rate": self.value,
            "low": self.low,
            "high": self.high,
        }


def wilson(hits: int, total: int, z: float = Z95) -> Rate:
    """The Wilson score interval of `hits` successes in `total` trials; [0, 1] when there were none."""
    if not 0 <= hits <= total:
        raise ValueError(f"hits must be between 0 and total, got {hits} of {total}")
    if total == 0:
        return Rate(0, 0, 0.0, 1.0)
    p = hits / total
    z2n = z * z / total
    centre = (p + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p * (1 - p) / total + z2n / (4 * total)) / (1 + z2n)
    # At 0 or n of n one bound is exactly the edge; rounding must not push it past.
    low = 0.0 if hits == 0 else max(0.0, centre - half)
    high = 1.0 if hits == total else min(1.0, centre + half)
    return Rate(hits, total, low, high)


@dataclass(frozen=True)
class Positions:
    """Where answers first diverged (token positions, or characters where a replica gives no tokens)."""

    counts: dict[int, int]  # position -> how many variants first diverged there

    @classmethod
    def of(cls, positions: Iterable[int]) -> Positions:
        return cls(dict(sorted(Counter(positions).items())))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def quantile(self, q: float) -> int | None:
        """The smallest position at or below which a share `q` of the divergences lie (None: none)."""
        if not self.counts:
            return None
        needed = q * self.total
        seen = 0
        for position, count in self.counts.items():
            seen += count
            if seen >= needed:
                return position
        return max(self.counts)

    def as_json(self) -> dict[str, Any]:
        return {
            "count": self.total,
            "first": min(self.counts, default=None),
            "median": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "last": max(self.counts, default=None),
            "histogram": [[position, count] for position, count in self.counts.items()],
        }
