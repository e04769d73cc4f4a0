"""Probing: send one request N times at concurrency C and count the distinct answers that come back.

Answers are grouped twice: by their tokens (token ids, or the text where a replica gives no ids), which is what a
reader sees, and by their tokens and the bits of every logprob, which is what reproducibility means (the logprobs of
the `stackpin` extension, or else those of OpenAI's `logprobs` field when the request asked for them). Each distinct
answer is compared with the most common one by the replay comparison (`proxy/evidence/compare.py`), which says where it
diverged. How a request is sent is the caller's: `stackpin probe` posts to a proxy over HTTP, the audit page
calls the proxy's serving path in process. Everything here but `run_probe` is pure.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.endpoints import CHAT
from proxy.evidence.answers import Tokens, View, tokens_of, view_of
from proxy.evidence.compare import compare

SAMPLE_RECORDS = 5  # record ids kept per distinct answer, to open a few of them

Reply = tuple[int, Mapping[str, str], Any]  # status, headers, JSON body
Send = Callable[[], Awaitable[Reply]]


def probe_body(model: str, prompt: str, *, max_tokens: int, temperature: float) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }


@dataclass
class Variant:
    """One distinct answer, bit for bit, and how often it came back."""

    tokens: Tokens
    count: int = 0
    view: View | None = None  # the whole answer as a replay compares it
    records: list[str] = field(default_factory=list)
    completion: int = 0  # which distinct completion (by tokens) it is; 0 is the most common
    diverges_at: int | None = None  # where it leaves the most common answer; None for that answer itself
    reason: str | None = None  # "token", "logprob", "length", "text", ..., as a replay would say

    @property
    def length(self) -> int:
        ids = self.tokens.token_ids
        return len(ids) if ids is not None else len(self.tokens.text)


@dataclass
class ProbeResult:
    requests: int
    concurrency: int
    variants: list[Variant]  # most common first
    stacks: list[str]
    failures: dict[str, int]

    @property
    def answered(self) -> int:
        return sum(v.count for v in self.variants)

    @property
    def distinct_completions(self) -> int:
        return len({v.completion for v in self.variants})

    def summary(self) -> dict[str, Any]:
        by_completion: Counter[int] = Counter()
        for variant in self.variants:
            by_completion[variant.completion] += variant.count
        return {
            "requests": self.requests,
            "concurrency": self.concurrency,
            "answered": self.answered,
            "distinct_completions": self.distinct_completions,
            "distinct_bitwise": len(self.variants),
            "largest_group": max(by_completion.values(), default=0),
            "stacks": self.stacks,
            "failures": self.failures,
            "variants": [
                {
                    "count": v.count,
                    "completion": v.completion,
                    "diverges_at": v.diverges_at,
                    "reason": v.reason,
                    "text": v.tokens.text,
                    "records": v.records,
                }
                for v in self.variants
            ],
        }


@dataclass
class Tally:
    """Answers as they arrive, grouped bit for bit."""

    variants: dict[str, Variant] = field(default_factory=dict)
    stacks: set[str] = field(default_factory=set)
    failures: Counter[str] = field(default_factory=Counter)

    def add(self, reply: Reply) -> None:
        status, headers, body = reply
        if status != 200 or not isinstance(body, dict):
            error = body.get("error", {}) if isinstance(body, dict) else {}
            message = error.get("message") if isinstance(error, dict) else None
            self.failures[str(message or f"HTTP {status}")] += 1
            return
        try:
            tokens = tokens_of(body)
        except (KeyError, IndexError, TypeError):
            self.failures["the answer holds no choice"] += 1
            return
        if (
            tokens.token_logprobs is None
        ):  # a replica without the extension: the logprobs OpenAI's format gives
            tokens = replace(tokens, token_logprobs=_choice_logprobs(body))
        self.stacks.add(headers.get("Stackpin-Stack", "?"))
        variant = self.variants.setdefault(_bitwise_key(tokens), Variant(tokens, view=view_of(CHAT, body)))
        variant.count += 1
        record = headers.get("Stackpin-Record")
        if record is not None and len(variant.records) < SAMPLE_RECORDS:
            variant.records.append(record)

    def merge(self, other: Tally) -> None:
        """Counts what `other` counted as well, grouped alike (a prompt's answers at several loads, as one)."""
        for key, theirs in other.variants.items():
            mine = self.variants.get(key)
            if mine is None:
                self.variants[key] = Variant(theirs.tokens, theirs.count, theirs.view, list(theirs.records))
                continue
            mine.count += theirs.count
            mine.records.extend(theirs.records[: max(0, SAMPLE_RECORDS - len(mine.records))])
        self.stacks |= other.stacks
        self.failures.update(other.failures)

    def result(self, requests: int, concurrency: int) -> ProbeResult:
        return ProbeResult(
            requests=requests,
            concurrency=concurrency,
            variants=rank(list(self.variants.values())),
            stacks=sorted(self.stacks),
            failures=dict(self.failures),
        )


def rank(variants: list[Variant]) -> list[Variant]:
    """Most common first; each compared with the first, and numbered by its tokens.

    Ties go by the answers themselves (their tokens, then bits), never by when they arrived: the same answers give
    the same ranking whether they are tallied as they come or read back from the log, newest first."""
    ordered = sorted(variants, key=lambda v: (-v.count, _bitwise_key(v.tokens)))
    if not ordered:
        return ordered
    reference = ordered[0]
    completions: dict[str, int] = {}
    for variant in ordered:
        variant.completion = completions.setdefault(_token_key(variant.tokens), len(completions))
        if variant is not reference and reference.view is not None and variant.view is not None:
            comparison = compare(reference.view, variant.view)
            variant.diverges_at, variant.reason = comparison.position, comparison.reason
    return ordered


async def run_probe(send: Send, *, requests: int, concurrency: int) -> ProbeResult:
    """Sends `requests` requests, at most `concurrency` at a time; what `send` raises ends the probe."""
    semaphore = asyncio.Semaphore(max(1, concurrency))
    tally = Tally()

    async def one() -> None:
        async with semaphore:
            tally.add(await send())

    await asyncio.gather(*(one() for _ in range(requests)))
    return tally.result(requests, concurrency)


def _choice_logprobs(body: dict[str, Any]) -> list[float] | None:
    """Choice 0's `logprobs.content[*].logprob` (or a completion's `logprobs.token_logprobs`), when given whole."""
    logprobs = body["choices"][0].get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    values = (
        [item.get("logprob") for item in content if isinstance(item, dict)]
        if isinstance(content, list)
        else logprobs.get("token_logprobs")
    )
    if not isinstance(values, list) or not values:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return [float(v) for v in values]


def _token_key(tokens: Tokens) -> str:
    return json.dumps(tokens.token_ids) if tokens.token_ids is not None else json.dumps(tokens.text)


def _bitwise_key(tokens: Tokens) -> str:
    bits = [(float(lp) + 0.0).hex() for lp in tokens.token_logprobs or []]
    return json.dumps([_token_key(tokens), bits, tokens.text])
