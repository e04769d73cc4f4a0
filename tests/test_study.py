"""What a study is: its load levels, its tags, and what is left of it to send (round-robin over the prompts,
skipping the answers already in hand)."""

from __future__ import annotations

import pytest

from proxy.evidence.prompt_set import Defaults, read_prompt_set
from proxy.evidence.study import (
    Done,
    Load,
    Side,
    StudyPlan,
    Tag,
    new_study_id,
    parse_tag,
    remaining,
    schedule,
    valid_study_id,
)

PROMPTS = read_prompt_set("one\ntwo\nthree", name="p.txt", defaults=Defaults("m", 8))


def plan(**overrides: object) -> StudyPlan:
    fields: dict[str, object] = {
        "study": "st-0123456789ab",
        "prompts": PROMPTS,
        "repeats": 2,
        "loads": [Load(1), Load(8, 4)],
        "sides": [Side("a", "kernel_mode=batch_invariant"), Side("b", "kernel_mode=default")],
    }
    return StudyPlan(**{**fields, **overrides})  # type: ignore[arg-type]


def test_a_load_is_written_c_or_c_plus_b_and_named_by_its_label() -> None:
    assert Load.parse("8") == Load(8, 0) and Load.parse(" 16+8 ") == Load(16, 8)
    assert Load(8, 4).label == "c8+b4" and Load(1).label == "c1"
    assert Load.from_label("c8+b4") == Load(8, 4) and Load.from_label("c1") == Load(1)
    for wrong in ("0", "8+", "+4", "eight", "8+4+2", "-1"):
        with pytest.raises(ValueError, match="a load is C or C"):
            Load.parse(wrong)
    assert Load.from_label("c8+b0") is None, "a label has one spelling"


def test_a_tag_names_the_study_side_load_and_prompt_and_reads_back() -> None:
    tag = Tag("st-0123456789ab", "b", "c8+b4", 17)
    assert str(tag) == "study/st-0123456789ab/b/c8+b4/17" and parse_tag(str(tag)) == tag
    background = Tag("st-0123456789ab", "a", "c1", None)
    assert str(background) == "study/st-0123456789ab/a/c1/bg" and parse_tag(str(background)) == background
    for other in ("mine", "study/x/c/c1/1", "study/x/a/c0/1", "study/x/a/c1/one", "study/x/a/c1/1/2"):
        assert parse_tag(other) is None, other


def test_study_ids_are_drawn_fresh_and_recognised() -> None:
    ids = {new_study_id() for _ in range(50)}
    assert len(ids) == 50 and all(valid_study_id(i) for i in ids)
    assert not valid_study_id("st-XYZ") and not valid_study_id("../etc")


def test_the_schedule_goes_round_robin_and_skips_what_is_done() -> None:
    assert schedule(3, 2, {}) == [0, 1, 2, 0, 1, 2]
    assert schedule(3, 3, {0: 3, 1: 1}) == [2, 1, 2, 1, 2], "prompt 1 from its second repeat, prompt 0 done"
    assert schedule(2, 2, {0: 5}) == [1, 1], "more answers than repeats is simply done"


def test_what_remains_is_each_load_in_order_with_each_side_in_turn() -> None:
    done = Done()
    done.add("a", "c1", 0, 2)
    done.add("a", "c1", 1)
    steps = [(load.label, side.key, order) for load, side, order in remaining(plan(), done)]
    assert steps == [
        ("c1", "a", [2, 1, 2]),
        ("c1", "b", [0, 1, 2, 0, 1, 2]),
        ("c8+b4", "a", [0, 1, 2, 0, 1, 2]),
        ("c8+b4", "b", [0, 1, 2, 0, 1, 2]),
    ]
    assert plan().requests == 3 * 2 * 2 * 2


def test_a_plans_identity_is_what_must_match_to_continue_it() -> None:
    same = plan(study="st-ffffffffffff")
    assert plan().identity() == same.identity(), "the id is drawn per study; the plan is what it sends"
    assert plan().identity() != plan(repeats=3).identity()
    assert plan().identity() != plan(sides=[Side("a", "kernel_mode=default")]).identity()
    with pytest.raises(ValueError):
        plan(loads=[Load(1), Load(1)])
    with pytest.raises(ValueError):
        plan(repeats=0)
