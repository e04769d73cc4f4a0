"""Specification of the mixture-of-experts layer (pinned_backend.moe) and the models built on it: their logits are
Hugging Face's on the same weights, and in batch_invariant mode a token's output does not depend on how many tokens
each expert got in the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pinned_backend.checkpoint import parse_config
from pinned_backend.kernels import select_kernels
from pinned_backend.model import Transformer
from pinned_backend.moe import ExpertWeights, moe_mlp
from pinned_backend.routing import DROPLESS, ExpertRouting
from tests.support.backend_checkpoint import MOE_CONFIG, SMALL_CONFIG, write_random_checkpoint
from tests.test_model import Runner

CPU = torch.device("cpu")
MIXTRAL_CONFIG = {
    **{k: v for k, v in SMALL_CONFIG.items() if k != "model_type"},
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": None,
}
FAMILIES = {
    "qwen3_moe": (MOE_CONFIG, "Qwen3MoeForCausalLM"),
    "mixtral": (MIXTRAL_CONFIG, "MixtralForCausalLM"),
}


@pytest.mark.parametrize("mode", ["default", "batch_invariant"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_agree_with_hugging_face_on_the_same_weights(tmp_path: Path, family: str, mode: Any) -> None:
    transformers = pytest.importorskip("transformers")
    config, architecture = FAMILIES[family]
    folder = write_random_checkpoint(tmp_path / family, seed=3, config=config)
    reference = getattr(transformers, architecture).from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    model = Transformer.from_pretrained(
        folder, select_kernels(mode, CPU, kv_split_size=32), CPU, torch.float32
    )
    runner = Runner(model, [ids])
    for count in (20, 1, 19):  # a prefill, a decode step, a chunk
        runner.step([(0, count)])
    torch.testing.assert_close(torch.stack(runner.logits[0]), expected, atol=1e-4, rtol=1e-4)


def random_experts(
    generator: torch.Generator, experts: int = 8, hidden: int = 64, size: int = 32
) -> ExpertWeights:
    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5

    return ExpertWeights(
        matrix(experts, hidden), matrix(experts, 2 * size, hidden), matrix(experts, hidden, size)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_experts_give_a_token_the_same_bits_whatever_the_step_around_it(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    weights = random_experts(generator)
    weights = ExpertWeights(*(w.to(dtype) for w in (weights.router, weights.gate_up, weights.down)))
    moe = parse_config(MOE_CONFIG).moe
    assert moe is not None
    kernels = select_kernels("batch_invariant", CPU)
    h = torch.randn(70, 64, generator=generator).to(dtype)
    whole = moe_mlp(kernels, weights, h, moe, DROPLESS)
    # Alone, in a pair, and amid others: each expert gets a different number of tokens every time.
    for rows in ([0], [69], [3, 4], list(range(10, 27)), list(range(0, 70, 3))):
        part = moe_mlp(kernels, weights, h[rows], moe, DROPLESS)
        assert torch.equal(part, whole[rows]), f"rows {rows[:3]}...: other bits than in the step of 70 tokens"


def test_default_and_invariant_experts_compute_the_same_function() -> None:
    generator = torch.Generator().manual_seed(6)
    weights, h = random_experts(generator), torch.randn(33, 64, generator=generator)
    moe = parse_config(MOE_CONFIG).moe
    assert moe is not None
    invariant = moe_mlp(select_kernels("batch_invariant", CPU), weights, h, moe, DROPLESS)
    default = moe_mlp(select_kernels("default", CPU), weights, h, moe, DROPLESS)
    torch.testing.assert_close(invariant, default, atol=1e-5, rtol=1e-5)


def test_a_passed_through_token_gets_no_expert_output() -> None:
    generator = torch.Generator().manual_seed(7)
    weights = random_experts(generator)
    moe = parse_config({**MOE_CONFIG, "num_experts_per_tok": 1}).moe
    assert moe is not None
    h = torch.randn(1, 64, generator=generator).repeat(
        8, 1
    )  # eight copies: all want one expert, of capacity 1
    capped = ExpertRouting(capacity_factor=1.0, overflow="pass_through")
    out = moe_mlp(select_kernels("batch_invariant", CPU), weights, h, moe, capped)
    assert out[0].abs().sum() > 0 and out[1:].eq(0).all()


def test_a_capacity_factor_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path / "dense")
    with pytest.raises(ValueError, match="applies to mixture-of-experts models; this qwen3 is dense"):
        Transformer.from_pretrained(
            folder, select_kernels("default", CPU), CPU, torch.float32, routing=ExpertRouting(1.0)
        )
