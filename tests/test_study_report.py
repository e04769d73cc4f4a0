"""What a study found: each prompt's distinct answers and where they diverged; over the set, the share of prompts
that diverged (by tokens, and by logprob bits) with its interval, per side and load and pooled over the loads."""

from __future__ import annotations

from typing import Any

from proxy.evidence.study import Load, Side
from proxy.evidence.study_report import Shape, StudyTally, headline, study_report

SIDES = [Side("a", "kernel_mode=batch_invariant"), Side("b", "kernel_mode=default")]
LOADS = [Load(1), Load(8, 4)]
SHAPE = Shape(SIDES, LOADS, {0: "first prompt", 1: "second prompt"})


def reply(ids: list[int], logprobs: list[float] | None = None, record: str = "rec_x") -> Any:
    extension: dict[str, Any] = {"token_ids": ids}
    if logprobs is not None:
        extension["token_logprobs"] = logprobs
    body = {"choices": [{"index": 0, "message": {"content": " ".join(map(str, ids))}}], "stackpin": extension}
    return 200, {"Stackpin-Record": record, "Stackpin-Stack": "fp"}, body


STEADY = ([1, 2, 3], [-0.5, -0.25, -1.0])
OTHER_BITS = ([1, 2, 3], [-0.5, -0.25000000000000006, -1.0])
OTHER_TOKEN = ([1, 7, 3], [-0.5, -0.25, -1.0])


def tally() -> StudyTally:
    """Side a steady everywhere; side b: prompt 0 other bits at c8+b4, prompt 1 another token at c8+b4."""
    found = StudyTally()
    for side in ("a", "b"):
        for load in ("c1", "c8+b4"):
            for prompt in (0, 1):
                for k in range(3):
                    found.add(side, load, prompt, reply(*STEADY, record=f"rec_{side}{load}{prompt}{k}"))
    found.add("b", "c8+b4", 0, reply(*OTHER_BITS, record="rec_bits"))
    found.add("b", "c8+b4", 1, reply(*OTHER_TOKEN, record="rec_token"))
    found.add("b", "c8+b4", 1, (503, {}, {"error": {"message": "busy"}}))
    return found


def test_each_side_has_its_rates_with_intervals_per_load_and_over_all_loads() -> None:
    report = study_report(tally(), SHAPE, {"study": "st-0123456789ab"})
    a, b = report["sides"]
    assert report["study"] == "st-0123456789ab" and (a["key"], b["pin"]) == ("a", "kernel_mode=default")
    assert a["overall"]["diverged"]["hits"] == 0 and a["overall"]["diverged_bits"]["hits"] == 0
    assert a["overall"]["diverged"]["high"] < 0.85, "0 of 2 still leaves most of the range open"
    quiet, loaded = b["loads"]
    assert (quiet["load"], loaded["load"], loaded["concurrency"], loaded["background"]) == (
        "c1",
        "c8+b4",
        8,
        4,
    )
    assert quiet["diverged_bits"]["hits"] == 0
    assert (loaded["diverged"]["hits"], loaded["diverged_bits"]["hits"], loaded["prompts"]) == (1, 2, 2)
    assert loaded["positions"]["histogram"] == [[1, 1]], "the other token at position 1"
    assert loaded["bit_positions"]["histogram"] == [[1, 1]], "the other bits at position 1"
    assert loaded["failures"] == 1 and loaded["answers"] == 8
    assert b["overall"]["diverged"]["hits"] == 1 and b["overall"]["answers"] == 14
    assert loaded["most_common_share"] == {"median": 0.875, "lowest": 0.75}, (
        "by completion: bits alone do not split"
    )
    assert b["overall"]["bits_given"] and b["overall"]["stacks"] == ["fp"]


def test_each_prompt_lists_its_distinct_answers_and_where_each_left_the_most_common() -> None:
    report = study_report(tally(), SHAPE)
    second = report["prompts"][1]
    assert (second["index"], second["label"]) == (1, "second prompt")
    pooled = second["sides"]["b"]["overall"]
    assert (pooled["answers"], pooled["distinct_completions"], pooled["distinct_bitwise"]) == (7, 2, 2)
    assert pooled["most_common_share"] == 6 / 7
    reference, other = pooled["variants"]
    assert reference["count"] == 6 and reference["diverges_at"] is None and reference["text"] == "1 2 3"
    assert (other["diverges_at"], other["reason"], other["records"]) == (1, "token", ["rec_token"])
    first = report["prompts"][0]["sides"]["b"]["loads"]["c8+b4"]
    assert first["distinct_completions"] == 1 and first["distinct_bitwise"] == 2
    assert "text" not in first["variants"][1], "the same tokens: its text is the reference's"


def test_without_logprobs_bits_are_not_claimed() -> None:
    found = StudyTally()
    found.add("a", "c1", 0, reply([1, 2]))
    found.add("a", "c1", 0, reply([1, 2]))
    report = study_report(found, Shape([SIDES[0]], [Load(1)], {0: "only"}))
    side = report["sides"][0]
    assert not side["overall"]["bits_given"]
    assert headline(side) == (
        "kernel_mode=batch_invariant: 0 of 1 prompts diverged (0%, 95% CI 0%-79%); "
        "no logprobs given, so bits are not compared"
    )


def test_the_headline_says_the_rate_and_its_interval_in_words() -> None:
    b = study_report(tally(), SHAPE)["sides"][1]
    assert headline(b) == (
        "kernel_mode=default: 1 of 2 prompts diverged (50%, 95% CI 9%-91%); "
        "in logprob bits 2 of 2 (100%, 95% CI 34%-100%)"
    )
    assert headline(b, b["loads"][0]).startswith("kernel_mode=default: 0 of 2 prompts diverged")


def test_a_prompt_without_answers_counts_in_no_rate() -> None:
    found = StudyTally()
    found.add("a", "c1", 0, reply(*STEADY))
    found.add("a", "c1", 1, (503, {}, {"error": {"message": "busy"}}))
    side = study_report(found, Shape([SIDES[0]], [Load(1)], {0: "x", 1: "y"}))["sides"][0]
    assert side["overall"]["prompts"] == 1 and side["overall"]["diverged"]["total"] == 1
    assert side["overall"]["failures"] == 1
