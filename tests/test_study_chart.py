"""A study report's chart geometry: each side's rate and interval on one 0-100% axis, first divergence positions
bucketed on one scale for every side, and a cell per prompt shaded by how many answers it came back as."""

from __future__ import annotations

from typing import Any

from proxy.evidence.study import Load, Side
from proxy.evidence.study_report import Shape, StudyTally, study_report
from proxy.ui.study_chart import FOREST_LEFT, FOREST_WIDTH, HIST_HEIGHT, forest, histograms, prompt_maps


def reply(ids: list[int], bits: float = -0.25) -> Any:
    body = {
        "choices": [{"index": 0, "message": {"content": str(ids)}}],
        "stackpin": {"token_ids": ids, "token_logprobs": [-0.5, bits, -1.0][: len(ids)]},
    }
    return 200, {"Stackpin-Record": "rec_x", "Stackpin-Stack": "fp"}, body


def report(loads: list[Load]) -> dict[str, Any]:
    tally = StudyTally()
    for load in loads:
        for prompt in range(4):
            tally.add("a", load.label, prompt, reply([1, 2, 3]))
            tally.add("b", load.label, prompt, reply([1, 2, 3]))
        tally.add("b", load.label, 1, reply([1, 2, 3], bits=-0.25000000000000006))
        tally.add("b", load.label, 2, reply([1, 9, 3]))
        tally.add("b", load.label, 3, reply([1, 9, 3]))
        tally.add("b", load.label, 3, reply([1, 2, 7]))
    sides = [Side("a", "kernel_mode=batch_invariant"), Side("b", "kernel_mode=default")]
    return study_report(tally, Shape(sides, loads, {p: f"prompt {p}" for p in range(4)}))


def test_the_forest_plots_each_side_at_each_load_on_one_axis_and_pooled_when_there_are_several() -> None:
    one = forest(report([Load(4)]))
    assert [row.label for row in one.rows] == ["a · c4", "b · c4"]
    a, b = one.rows
    assert a.tokens is not None and a.tokens.x == FOREST_LEFT and a.tokens.low == FOREST_LEFT
    assert b.tokens is not None and b.tokens.x == FOREST_LEFT + FOREST_WIDTH * 0.5, "2 of 4 prompts"
    assert b.tokens.low < b.tokens.x < b.tokens.high and b.tokens.words.startswith("2 of 4, 50% (")
    assert b.bits is not None and b.bits.x == FOREST_LEFT + FOREST_WIDTH * 0.75
    assert one.ticks[0] == (FOREST_LEFT, "0%") and one.ticks[-1] == (FOREST_LEFT + FOREST_WIDTH, "100%")
    several = forest(report([Load(1), Load(8, 4)]))
    assert [row.label for row in several.rows][:2] == ["a · all loads", "b · all loads"]
    assert len(several.rows) == 6 and several.height == 6 * 26


def test_histograms_share_one_axis_and_scale_and_stack_tokens_under_bits() -> None:
    a, b = histograms(report([Load(4)]))
    assert a.empty and not a.buckets and not b.empty
    assert b.last == 2, "positions 0 to 2 at one token a bucket"
    by_first = {bucket.first: bucket for bucket in b.buckets}
    assert set(by_first) == {1, 2}
    assert by_first[1].counts == (2, 1) and by_first[2].counts == (1, 0)
    assert by_first[1].tokens + by_first[1].bits == HIST_HEIGHT, "the tallest bucket fills the height"


def test_each_prompt_is_a_cell_shaded_by_its_distinct_answers() -> None:
    a, b = prompt_maps(report([Load(4)]))
    assert [cell.kind for cell in a.cells] == ["same"] * 4
    assert [cell.kind for cell in b.cells] == ["same", "bits", "two", "many"]
    assert b.cells[3].words.startswith("prompt 3: 3 completion(s), 3 bitwise, the most common 33% of 3")
    assert (b.cells[1].x, b.cells[1].y) == (14, 0) and b.pin == "kernel_mode=default"
