"""Specification of the model families: each computes what transformers' own modelling code computes on the same
checkpoint, and in batch_invariant mode answers bit-identically alone, amid load, from a prefix-cache hit and with
speculative decoding.

Every family is a tiny random checkpoint (tests/support/family_checkpoints.py) written in the Hub's layout; the
reference is transformers' model loaded from that folder (eager attention). For each family: the last position's
logits of 16 prompts (chunked prefill, amid the other prompts) agree with transformers' to float32 tolerance in both
kernel modes; greedy continuations are transformers' token for token; and the invariance comparisons of
tests/test_invariance.py hold. Prompts run up to 48 tokens, past every sliding window (8 or 16), past Ministral 3's
16-token context of its query scale and, decoding, past Phi-3's 32-token original context. Phi-3's LongRoPE takes
its long factors from position 32 on (rope.py says why): transformers is run as it decodes, the first 32 tokens at
once and the rest one at a time, which is the same rule. How each family reads its config is specified here too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pinned_backend.kernels import select_kernels
from pinned_backend.model import Transformer
from pinned_backend.sampling import SamplingParams
from tests.support.backend_checkpoint import make_engine
from tests.support.family_checkpoints import FAMILIES, VOCAB, write_family_checkpoint
from tests.support.scripted_arrivals import Arrival, run_schedule
from tests.test_invariance import (
    CPU_SIZES,
    DRAFTS,
    answer,
    copy_request,
    crowded_schedule,
    engine_for,
    loaded_schedule,
)
from tests.test_model import Runner

CPU = torch.device("cpu")
NAMES = list(FAMILIES)
PROMPTS = 16
# transformers' LongRoPE picks its factors by the longest position of a call; fed as it decodes, it agrees with the
# per-position rule the backend keeps.
PREFILL_LIMIT = {"phi3": 32}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    folders: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("families")

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = write_family_checkpoint(root / family, family)
        return folders[family]

    return get


@pytest.fixture(scope="module")
def reference(checkpoint: Callable[[str], Path]) -> Callable[[str], Any]:
    transformers = pytest.importorskip("transformers")
    models: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in models:
            models[family] = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint(family), dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return models[family]

    return get


def prompts(count: int, seed: int, longest: int = 48) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


def reference_logits(model: Any, family: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [L, vocab] for every position of `ids`: a forward of the first tokens, the rest one at a
    time over its cache where the family's rotation depends on how far a call reaches."""
    first = min(ids.numel(), PREFILL_LIMIT.get(family, ids.numel()))
    with torch.no_grad():
        out = model(ids[None, :first], use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for t in range(first, ids.numel()):
            out = model(ids[None, t : t + 1], past_key_values=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(rows)


@pytest.mark.parametrize("family", NAMES)
def test_last_position_logits_agree_with_transformers_in_both_modes(
    family: str, checkpoint: Callable[[str], Path], reference: Callable[[str], Any]
) -> None:
    sequences = prompts(PROMPTS, seed=1)
    expected = torch.stack([reference_logits(reference(family), family, ids)[-1] for ids in sequences])
    for mode in ("default", "batch_invariant"):
        kernels = select_kernels(mode, CPU, kv_split_size=32)  # type: ignore[arg-type]
        model = Transformer.from_pretrained(checkpoint(family), kernels, CPU, torch.float32)
        runner = Runner(model, sequences)
        # Every prompt's first half in one step, the rest in a second: chunked prefill amid the others.
        runner.step([(s, -(-ids.numel() // 2)) for s, ids in enumerate(sequences)])
        runner.step([(s, runner.remaining(s)) for s in range(len(sequences)) if runner.remaining(s)])
        last = torch.stack([runner.logits[s][-1] for s in range(len(sequences))])
        assert torch.allclose(last, expected, atol=1e-4, rtol=1e-4), (
            f"{family} {mode}: logits differ from transformers' by up to {(last - expected).abs().max():.2e}"
        )


@pytest.mark.parametrize("family", NAMES)
def test_greedy_continuations_are_transformers_own(
    family: str, checkpoint: Callable[[str], Path], reference: Callable[[str], Any]
) -> None:
    sequences = prompts(4, seed=2, longest=24)
    with torch.no_grad():
        expected = [
            reference(family)
            .generate(ids[None], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, ids.numel() :
            ]
            .tolist()
            for ids in sequences
        ]
    engine = make_engine(checkpoint(family), "batch_invariant", max_batch_size=4, max_step_tokens=32)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    arrivals = [Arrival(0, f"r{i}", ids.tolist(), greedy) for i, ids in enumerate(sequences)]
    outputs = run_schedule(engine, arrivals)
    got = [[o.token_id for o in outputs[f"r{i}"]] for i in range(len(sequences))]
    assert got == expected, f"{family}: greedy continuations differ from transformers'"


def served_four_ways(folder: Path, seed: int) -> tuple[dict[str, tuple[list[int], list[str]]], int]:
    """One request whose prompt repeats a piece of itself (so prompt lookup drafts), served alone; amid load; amid
    load from a warm prefix cache; and amid load with speculation and the cache: each answer's tokens and logprob
    bits, and the prompt tokens the last found cached."""
    rng = random.Random(seed)
    target = copy_request(rng, "target", 0, scale=2)  # up to 64 prompt tokens: past every window
    runs = {}
    runs["alone"] = run_schedule(engine_for(folder, "batch_invariant", CPU_SIZES), [target])["target"]
    crowded = crowded_schedule(rng, target, most=6)
    runs["amid load"] = run_schedule(engine_for(folder, "batch_invariant", CPU_SIZES), crowded)["target"]
    cached = engine_for(folder, "batch_invariant", CPU_SIZES, prefix_cache=True)
    run_schedule(cached, [replace(target, request_id="warm")])
    runs["from the cache"] = run_schedule(cached, loaded_schedule(rng, target, [target.prompt]))["target"]
    both = engine_for(folder, "batch_invariant", CPU_SIZES, prefix_cache=True, speculative_tokens=DRAFTS)
    run_schedule(both, [replace(target, request_id="warm")])
    runs["speculated"] = run_schedule(both, loaded_schedule(rng, target, [target.prompt]))["target"]
    hit = min(runs[name][-1].batch.cached_tokens for name in ("from the cache", "speculated"))
    return {name: answer(outputs) for name, outputs in runs.items()}, hit


@pytest.mark.parametrize("family", NAMES)
def test_batch_invariant_answers_are_bit_identical_alone_amid_load_from_the_cache_and_speculated(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    answers, hit = served_four_ways(checkpoint(family), seed=3)
    assert hit > 0, "the prefix cache served nothing, so nothing was tested"
    for name, got in answers.items():
        assert got == answers["alone"], f"{family}: the answer {name} differs from the one alone"
