"""Specification of the rotary embeddings (pinned_backend.rope): both spellings of a config read alike; every recipe's
frequencies and attention factor are transformers' own; LongRoPE's long set serves exactly the positions at and past
the original context."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pinned_backend.config_keys import CheckpointError
from pinned_backend.rope import attention_factor, inv_freq, parse_rope, rope_tables

HEAD_DIM = 16
RECIPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 8.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0],
        "original_max_position_embeddings": 128,
    },
    "yarn, truncated": {
        "rope_type": "yarn",
        "factor": 40.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128,
    },
    "yarn, not truncated": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
}


def hugging_face(recipe: dict[str, Any], theta: float, **init: Any) -> tuple[torch.Tensor, float]:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        rope_parameters={**recipe, "rope_theta": theta},
    )
    freqs, factor = ROPE_INIT_FUNCTIONS[recipe["rope_type"]](config, None, **init)
    return freqs, factor


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_gives_transformers_frequencies_and_attention_factor(name: str) -> None:
    recipe = RECIPES[name]
    raw = {"rope_theta": 150000.0, "rope_scaling": recipe, "max_position_embeddings": 4096}
    theta, scaling = parse_rope(raw, "config.json")
    assert scaling is not None and scaling.kind == recipe["rope_type"]
    expected, factor = hugging_face(recipe, theta)
    assert torch.equal(inv_freq(theta, scaling, HEAD_DIM), expected.float())
    assert attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    if name == "longrope":
        long, _ = hugging_face(recipe, theta, seq_len=129)
        assert torch.equal(inv_freq(theta, scaling, HEAD_DIM, long=True), long.float())


def test_both_spellings_of_a_config_read_alike() -> None:
    recipe = RECIPES["yarn, truncated"]
    hub = parse_rope({"rope_theta": 150000.0, "rope_scaling": recipe}, "config.json")
    written = parse_rope({"rope_parameters": {**recipe, "rope_theta": 150000.0}}, "config.json")
    per_kind = parse_rope(
        {"rope_parameters": {"full_attention": {**recipe, "rope_theta": 150000.0}}},
        "config.json",
        "full_attention",
    )
    assert hub == written == per_kind
    assert parse_rope({"rope_theta": 5e5, "rope_scaling": {"rope_type": "default"}}, "c") == (5e5, None)
    assert parse_rope({}, "c") == (10000.0, None)


def test_longrope_rotates_by_the_short_set_within_the_original_context_and_the_long_set_past_it() -> None:
    raw = {"rope_theta": 10000.0, "rope_scaling": RECIPES["longrope"], "max_position_embeddings": 4096}
    theta, scaling = parse_rope(raw, "config.json")
    assert scaling is not None
    cos, sin = rope_tables(theta, scaling, HEAD_DIM, 256)
    factor = attention_factor(scaling)
    assert factor > 1
    for position, long in ((0, False), (127, False), (128, True), (255, True)):
        angles = position * inv_freq(theta, scaling, HEAD_DIM, long=long)
        assert torch.equal(cos[position], angles.cos() * factor), position
        assert torch.equal(sin[position], angles.sin() * factor), position


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": "x",
                "original_max_position_embeddings": 8,
            },
            "'long_factor' must be a list",
        ),
        ({"rope_type": "yarn", "factor": 4.0}, "missing key 'original_max_position_embeddings'"),
        ({"rope_type": "linear"}, "missing key 'factor'"),
    ],
)
def test_a_recipe_that_cannot_be_computed_is_an_error_naming_what_is_wrong(
    scaling: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        parse_rope({"rope_scaling": scaling}, "config.json")
    assert message in str(info.value)
