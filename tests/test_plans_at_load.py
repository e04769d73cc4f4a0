"""Specification of `--matmul-plans tune` (pinned_backend/tune.py's `plans_at_load`): which plan file a model takes
at load, when it is tuned, and what the cache keeps. Tuning itself needs a GPU (`bench/gpu_tune_at_load.py` runs it
on one); here a stand-in tuner returns the rule's plan for each shape it is asked about, and records the asking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pinned_backend.kernels.triton.matmul_plans import rule_plan, rule_split
from pinned_backend.kernels.triton.plan_files import Proven, load, shipped
from pinned_backend.kernels.triton.tuner import ShapeTune
from pinned_backend.tune import plans_at_load

H200 = next(f for f in shipped() if f.models == ("qwen3-1.7b",))
# Qwen3-1.7B's shapes, which a shipped file holds, and two more that no shipped file holds.
KNOWN = {f"w{i}": shape for i, shape in enumerate(sorted(H200.plans))}
NEW = {**KNOWN, "o_proj": (3584, 3584), "down": (3584, 18944)}


class Tuner:
    def __init__(self, passes: bool = True) -> None:
        self.asked: list[set[tuple[int, int]]] = []
        self.passes = passes

    def __call__(
        self, shapes: dict[tuple[int, int], list[str]], budget_s: float, **_: Any
    ) -> list[ShapeTune]:
        self.asked.append(set(shapes))
        return [
            ShapeTune(n, k, names, rule_split(k), rule_plan(n, k) if self.passes else None)
            for (n, k), names in shapes.items()
        ]


def take(shapes: dict[str, tuple[int, int]], cache: Path, tuner: Tuner, proven: Proven = H200.proven) -> Any:
    return plans_at_load(proven, "a-model", shapes, cache, lambda _: None, budget_s=1, tuner=tuner)


def test_a_model_the_shipped_plans_hold_whole_takes_them_and_tunes_nothing(tmp_path: Path) -> None:
    tuner = Tuner()
    assert take(KNOWN, tmp_path, tuner) == H200
    assert tuner.asked == [] and not any(tmp_path.iterdir())


def test_the_first_load_tunes_only_what_no_shipped_file_holds_and_keeps_the_shipped_plans(
    tmp_path: Path,
) -> None:
    tuner = Tuner()
    chosen = take(NEW, tmp_path, tuner)
    assert tuner.asked == [{(3584, 3584), (3584, 18944)}]
    assert set(chosen.plans) == set(NEW.values())
    assert all(chosen.plans[shape] == H200.plans[shape] for shape in KNOWN.values())
    [kept] = tmp_path.iterdir()
    assert kept.name == chosen.name and kept.name.startswith("nvidia-h200_triton-3.6.0_tuned-")
    assert load(kept) == chosen and chosen.proven == H200.proven
    assert set(chosen.models) == {"a-model", "qwen3-1.7b"}


def test_a_later_load_takes_the_kept_file_without_tuning(tmp_path: Path) -> None:
    first = take(NEW, tmp_path, Tuner())
    again = Tuner()
    assert take(NEW, tmp_path, again) == first
    assert again.asked == []
    assert take(NEW, tmp_path / "elsewhere", Tuner()).sha256 == first.sha256, (
        "the same tuner's plans, the same file"
    )


def test_other_shapes_or_another_gpu_get_a_file_of_their_own(tmp_path: Path) -> None:
    first = take(NEW, tmp_path, Tuner())
    other_model = take({**NEW, "lm_head": (152064, 3584)}, tmp_path, Tuner())
    other_gpu = Tuner()
    elsewhere = take(NEW, tmp_path, other_gpu, Proven("NVIDIA B200", (10, 0), "3.6.0"))
    assert len({first.name, other_model.name, elsewhere.name}) == 3
    assert other_gpu.asked == [set(NEW.values())], (
        "no shipped file was proven on that GPU: every shape is tuned"
    )


def test_no_tile_passing_leaves_the_rule_and_writes_nothing(tmp_path: Path) -> None:
    assert take(NEW, tmp_path, Tuner(passes=False), Proven("NVIDIA B200", (10, 0), "3.6.0")) is None
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_backend_takes_tune_as_a_plan_setting_with_a_cache_of_its_choosing(tmp_path: Path) -> None:
    from pinned_backend.runtime import BackendSettings

    settings = BackendSettings(model=tmp_path, matmul_plans="tune", plan_cache=tmp_path / "plans")
    assert settings.matmul_plans == "tune" and settings.plan_cache == tmp_path / "plans"
