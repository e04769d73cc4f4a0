"""Probing's tally: answers grouped by tokens and by bits, each distinct answer placed against the most common."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.evidence.probe import Tally, run_probe


def reply(ids: list[int], logprobs: list[float], *, record: str = "rec_x", stack: str = "s1") -> Any:
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(map(str, ids))}}],
        "stackpin": {"token_ids": ids, "token_logprobs": logprobs},
    }
    return 200, {"Stackpin-Record": record, "Stackpin-Stack": stack}, body


def test_the_most_common_answer_is_the_reference_and_the_others_say_where_they_left_it() -> None:
    tally = Tally()
    for i in range(3):
        tally.add(reply([1, 2, 3, 4], [-0.5, -0.25, -1.0, -2.0], record=f"rec_{i}"))
    tally.add(reply([1, 2, 9, 9], [-0.5, -0.25, -1.0, -2.0], record="rec_token"))
    tally.add(reply([1, 2, 3, 4], [-0.5, -0.25, -1.0000000000000002, -2.0], record="rec_bits"))
    tally.add((500, {}, {"error": {"message": "the replica failed"}}))

    result = tally.result(requests=6, concurrency=2)
    reference, *others = result.variants
    assert (reference.count, reference.diverges_at, reference.records) == (
        3,
        None,
        ["rec_0", "rec_1", "rec_2"],
    )
    placed = {v.records[0]: (v.completion, v.diverges_at, v.reason) for v in others}
    assert placed == {"rec_token": (1, 2, "token"), "rec_bits": (0, 2, "logprob")}, (
        "a bit-level variant is the same completion as the reference; a token variant is another"
    )
    summary = result.summary()
    assert (summary["answered"], summary["distinct_completions"], summary["distinct_bitwise"]) == (5, 2, 3)
    assert summary["largest_group"] == 4, "the bit-level variant reads as the reference's completion"
    assert summary["failures"] == {"the replica failed": 1} and summary["stacks"] == ["s1"]


def test_an_answer_without_choices_is_a_failure_not_a_crash() -> None:
    tally = Tally()
    tally.add((200, {}, {"object": "chat.completion"}))
    assert tally.result(1, 1).failures == {"the answer holds no choice": 1}


async def test_run_probe_never_has_more_than_c_requests_in_flight() -> None:
    in_flight, most = 0, 0

    async def send() -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return reply([1], [-0.5])

    result = await run_probe(send, requests=9, concurrency=3)
    assert result.answered == 9 and most == 3


def test_merged_tallies_count_the_same_answer_once_with_both_counts() -> None:
    low, high = Tally(), Tally()
    low.add(reply([1, 2], [-0.5, -1.0], record="rec_a"))
    high.add(reply([1, 2], [-0.5, -1.0], record="rec_b"))
    high.add(reply([1, 3], [-0.5, -1.0], record="rec_c"))
    high.add((503, {}, {"error": {"message": "busy"}}))
    pooled = Tally()
    pooled.merge(low)
    pooled.merge(high)
    result = pooled.result(4, 1)
    assert [(v.count, v.records) for v in result.variants] == [(2, ["rec_a", "rec_b"]), (1, ["rec_c"])]
    assert result.failures == {"busy": 1} and low.variants[next(iter(low.variants))].count == 1, (
        "merging leaves the tallies it read alone"
    )


def test_without_the_extension_the_logprobs_openai_gives_are_the_bits_compared() -> None:
    def upstream(text: str, logprobs: list[float]) -> Any:
        content = [
            {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(text.split(), logprobs, strict=True)
        ]
        body = {"choices": [{"index": 0, "message": {"content": text}, "logprobs": {"content": content}}]}
        return 200, {"Stackpin-Record": "rec_u", "Stackpin-Stack": "declared"}, body

    tally = Tally()
    tally.add(upstream("Paris is", [-0.5, -0.25]))
    tally.add(upstream("Paris is", [-0.5, -0.25]))
    tally.add(upstream("Paris is", [-0.5, -0.25000000000000006]))
    tally.add((200, {}, {"choices": [{"index": 0, "message": {"content": "Paris is"}}]}))
    summary = tally.result(4, 1).summary()
    assert summary["distinct_completions"] == 1 and summary["distinct_bitwise"] == 3, (
        "by the text; then the bits where given, and an answer without logprobs apart"
    )
