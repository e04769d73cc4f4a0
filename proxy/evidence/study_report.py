"""What a study found: per prompt, how many distinct answers came back and where each left the most common one;
over the set, the share of prompts whose answers ever differed, with its interval, and where they first differed;
each per side (pin) and per load level, and pooled over the loads.

A prompt's answers are tallied as a probe tallies one request's (proxy/evidence/probe.py): grouped by their tokens
(distinct completions, what a reader sees) and by their tokens and logprob bits (distinct bitwise, what
reproducibility means), each distinct answer compared with the most common by the replay comparison. A prompt
*diverged* when it came back as more than one completion; it *diverged in bits* when it came back as more than
one bitwise answer. Where a replica gives no logprobs the two are the same and the report says so. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.evidence.probe import ProbeResult, Reply, Tally
from proxy.evidence.rates import Positions, wilson
from proxy.evidence.study import Done, Load, Side

TEXT_CHARS = 300  # of each distinct completion, in the report


@dataclass
class StudyTally:
    """A study's answers, as they arrive or as they are read back from the log, per (side, load, prompt)."""

    tallies: dict[tuple[str, str, int], Tally] = field(default_factory=dict)

    def add(self, side: str, load: str, prompt: int, reply: Reply) -> None:
        self.tallies.setdefault((side, load, prompt), Tally()).add(reply)

    def done(self) -> Done:
        done = Done()
        for (side, load, prompt), tally in self.tallies.items():
            answered = sum(v.count for v in tally.variants.values())
            if answered:
                done.add(side, load, prompt, answered)
        return done

    def failures(self) -> int:
        return sum(sum(t.failures.values()) for t in self.tallies.values())


@dataclass(frozen=True)
class Shape:
    """What the report is laid out by: the sides, the loads in order, the prompts' labels."""

    sides: list[Side]
    loads: list[Load]
    labels: Mapping[int, str]


def study_report(tally: StudyTally, shape: Shape, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report as JSON: `meta` (the plan, times) first, then each side's rates, then each prompt's answers."""
    prompts = sorted(shape.labels)
    results: dict[tuple[str, str, int], ProbeResult] = {}
    for side in shape.sides:
        for prompt in prompts:
            pooled = Tally()
            for load in shape.loads:
                found = tally.tallies.get((side.key, load.label, prompt))
                if found is not None:
                    results[(side.key, load.label, prompt)] = _result(found)
                    pooled.merge(found)
            results[(side.key, "all", prompt)] = _result(pooled)
    sides = [
        {
            "key": side.key,
            "pin": side.pin,
            "overall": _set_summary([results[(side.key, "all", p)] for p in prompts]),
            "loads": [
                {
                    "load": load.label,
                    "concurrency": load.concurrency,
                    "background": load.background,
                    **_set_summary(
                        [results[k] for p in prompts if (k := (side.key, load.label, p)) in results]
                    ),
                }
                for load in shape.loads
            ],
        }
        for side in shape.sides
    ]
    per_prompt = [
        {
            "index": prompt,
            "label": shape.labels[prompt],
            "sides": {
                side.key: {
                    "overall": _prompt_summary(results[(side.key, "all", prompt)]),
                    "loads": {
                        load.label: _prompt_summary(results[k])
                        for load in shape.loads
                        if (k := (side.key, load.label, prompt)) in results
                    },
                }
                for side in shape.sides
            },
        }
        for prompt in prompts
    ]
    return {**(meta or {}), "sides": sides, "prompts": per_prompt}


def _result(tally: Tally) -> ProbeResult:
    answered = sum(v.count for v in tally.variants.values())
    return tally.result(requests=answered + sum(tally.failures.values()), concurrency=0)


def _prompt_summary(result: ProbeResult) -> dict[str, Any]:
    summary = result.summary()
    answered = summary["answered"]
    shown: set[int] = set()
    variants = []
    for variant in result.variants:
        entry = {
            "count": variant.count,
            "completion": variant.completion,
            "diverges_at": variant.diverges_at,
            "reason": variant.reason,
            "records": variant.records,
        }
        if variant.completion not in shown:  # the text once per completion: the others share its tokens
            shown.add(variant.completion)
            entry["text"] = variant.tokens.text[:TEXT_CHARS]
        variants.append(entry)
    return {
        "answers": answered,
        "failures": sum(result.failures.values()),
        "distinct_completions": summary["distinct_completions"],
        "distinct_bitwise": summary["distinct_bitwise"],
        "most_common_share": summary["largest_group"] / answered if answered else None,
        "bits_given": _bits_given(result),
        "stacks": result.stacks,
        "variants": variants,
    }


def _bits_given(result: ProbeResult) -> bool:
    return bool(result.variants) and all(v.tokens.token_logprobs is not None for v in result.variants)


def _set_summary(results: list[ProbeResult]) -> dict[str, Any]:
    answered = [r for r in results if r.answered]
    tokens = [v.diverges_at for r in answered for v in r.variants[1:] if v.reason != "logprob"]
    bits = [v.diverges_at for r in answered for v in r.variants[1:] if v.reason == "logprob"]
    shares = [max(_completion_counts(r).values()) / r.answered for r in answered]
    return {
        "prompts": len(answered),
        "answers": sum(r.answered for r in answered),
        "failures": sum(sum(r.failures.values()) for r in results),
        "diverged": wilson(sum(r.distinct_completions > 1 for r in answered), len(answered)).as_json(),
        "diverged_bits": wilson(sum(len(r.variants) > 1 for r in answered), len(answered)).as_json(),
        "bits_given": bool(answered) and all(_bits_given(r) for r in answered),
        "positions": Positions.of(p for p in tokens if p is not None).as_json(),
        "bit_positions": Positions.of(p for p in bits if p is not None).as_json(),
        "most_common_share": {
            "median": statistics.median(shares) if shares else None,
            "lowest": min(shares, default=None),
        },
        "stacks": sorted({s for r in answered for s in r.stacks}),
    }


def _completion_counts(result: ProbeResult) -> dict[int, int]:
    counts: dict[int, int] = {}
    for variant in result.variants:
        counts[variant.completion] = counts.get(variant.completion, 0) + variant.count
    return counts


def headline(side: Mapping[str, Any], summary: Mapping[str, Any] | None = None) -> str:
    """One line: `kernel_mode=default: 14 of 20 prompts diverged (70%, 95% CI 48-85%); in bits 20 of 20 (...)`."""
    summary = summary or side["overall"]
    line = f"{side['pin'] or '(no pin)'}: {_rate_words(summary['diverged'], 'prompts diverged')}"
    if summary["bits_given"]:
        line += f"; in logprob bits {_rate_words(summary['diverged_bits'], '')}"
    else:
        line += "; no logprobs given, so bits are not compared"
    return line


def _rate_words(rate: Mapping[str, Any], what: str) -> str:
    if not rate["total"]:
        return f"no answers ({what})".replace(" ()", "")
    words = f"{rate['hits']} of {rate['total']}" + (f" {what}" if what else "")
    return f"{words} ({rate['rate']:.0%}, 95% CI {rate['low']:.0%}-{rate['high']:.0%})"
