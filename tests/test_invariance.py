"""The property the backend exists for: a request's answer does not depend on what else the server is doing, nor on
how the server computed it.

For many random prompts, the completion a request gets when served alone must equal, token for token and logprob
bit for bit, the completion it gets amid 1 to 16 other requests of random lengths that arrive at random steps. So
must the completion it gets with a prefix-cache hit (its prompt sharing a prefix of random length with one served
before: inside a block, on a block boundary, or the whole prompt), and with speculative decoding on (greedy and
seeded), alone and amid load, hits and speculation together. The engine's step loop is driven directly from a
scripted arrival schedule, so every run is deterministic and fast; `test_http_answers_do_not_depend_on_concurrent_load`
checks the first property through the HTTP server. The same comparisons run on a GPU, with CUDA graphs, where one
is present.

In `default` mode the same schedules run and the differences found are reported, not asserted: whether plain
PyTorch kernels change a row's result with the batch, a hit or a verify pass depends on the hardware.

The mixture-of-experts model (Qwen3-MoE-shaped) is held to the same property with dropless routing. With an expert
capacity factor, a token's experts depend on the rest of the step by design; how often that changes an answer is
reported, not asserted.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from pinned_backend.engine import Engine, TokenOutput
from pinned_backend.kernels import KernelMode
from pinned_backend.routing import DROPLESS, OVERFLOW_POLICIES, ExpertRouting
from pinned_backend.runtime import BackendSettings
from pinned_backend.sampling import SamplingParams
from pinned_backend.server import create_app
from pinned_backend.step_graphs import DEFAULT_MAX_GRAPHS
from tests.support.backend_checkpoint import MOE_CONFIG, make_engine, write_random_checkpoint
from tests.support.scripted_arrivals import Arrival, run_schedule

CASES = 24
DEFAULT_CASES = 12  # the default mode is only reported, so fewer cases keep the suite quick
MOE_CASES = 6  # fewer: the dense cases above already cover the engine; these cover the experts
CAPACITY_FACTOR = 1.0
CAPACITY_CASES = 4  # per overflow policy; reported, not asserted
VOCAB = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("invariance") / "random-qwen3")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("invariance") / "random-qwen3-moe", config=MOE_CONFIG
    )


def random_request(rng: random.Random, request_id: str, step: int) -> Arrival:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    greedy = rng.random() < 0.5
    params = SamplingParams(
        temperature=0 if greedy else rng.choice([0.7, 1.0, 1.3]),
        top_p=1.0 if greedy else rng.choice([1.0, 0.9]),
        top_k=0 if greedy else rng.choice([0, 20]),
        seed=None if greedy else rng.getrandbits(32),
        max_tokens=rng.randint(1, 16),
    )
    return Arrival(step, request_id, prompt, params)


def answer(outputs: list[TokenOutput]) -> tuple[list[int], list[str]]:
    """Token ids and the exact bits of their logprobs."""
    return [o.token_id for o in outputs], [float.hex(o.logprob) for o in outputs]


def crowded_schedule(rng: random.Random, target: Arrival, most: int = 16) -> list[Arrival]:
    others = [random_request(rng, f"other-{i}", rng.randint(0, 12)) for i in range(rng.randint(1, most))]
    return [Arrival(rng.randint(0, 12), "target", target.prompt, target.params), *others]


def compare_alone_and_crowded(
    checkpoint: Path, mode: KernelMode, seed: int, routing: ExpertRouting = DROPLESS, **device: Any
) -> tuple[bool, bool, int]:
    """Serve one random request alone and amid others: (same bits?, same tokens?, largest batch it shared).
    `device`: make_engine's settings for another device (sizes, dtype, step graphs)."""
    rng = random.Random(seed)
    target = random_request(rng, "target", 0)
    sizes = {"num_blocks": 96, "max_batch_size": 8, "max_step_tokens": 24, "max_queue": 32, **device}
    engine = make_engine(checkpoint, mode, routing=routing, **sizes)
    alone = run_schedule(engine, [target])["target"]
    crowded = run_schedule(engine, crowded_schedule(rng, target))["target"]
    assert len(alone) == target.params.max_tokens
    same_tokens = answer(alone)[0] == answer(crowded)[0]
    return answer(alone) == answer(crowded), same_tokens, crowded[-1].batch.max


@pytest.mark.parametrize("seed", range(CASES))
def test_batch_invariant_answers_do_not_depend_on_the_batch(checkpoint: Path, seed: int) -> None:
    same, _, shared = compare_alone_and_crowded(checkpoint, "batch_invariant", seed)
    assert same, f"case {seed}: the answer changed when served amid others (largest batch {shared})"


def test_default_mode_is_reported(checkpoint: Path, record_property: pytest.RecordProperty) -> None:
    results = [compare_alone_and_crowded(checkpoint, "default", seed) for seed in range(DEFAULT_CASES)]
    bits = sum(1 for same, _, _ in results if not same)
    tokens = sum(1 for _, same_tokens, _ in results if not same_tokens)
    record_property("default_mode_differing_logprob_bits", f"{bits}/{DEFAULT_CASES}")
    record_property("default_mode_differing_tokens", f"{tokens}/{DEFAULT_CASES}")
    print(
        f"default mode on this CPU: amid others, {bits} of {DEFAULT_CASES} answers changed logprob bits, {tokens} tokens"
    )


@pytest.mark.parametrize("seed", range(MOE_CASES))
def test_dropless_mixture_of_experts_answers_do_not_depend_on_the_batch(
    moe_checkpoint: Path, seed: int
) -> None:
    same, _, shared = compare_alone_and_crowded(moe_checkpoint, "batch_invariant", seed)
    assert same, (
        f"case {seed}: the MoE model's answer changed when served amid others (largest batch {shared})"
    )


def test_expert_capacity_divergence_is_reported(
    moe_checkpoint: Path, record_property: pytest.RecordProperty
) -> None:
    for overflow in OVERFLOW_POLICIES:
        routing = ExpertRouting(CAPACITY_FACTOR, overflow)
        results = [
            compare_alone_and_crowded(moe_checkpoint, "batch_invariant", seed, routing)
            for seed in range(CAPACITY_CASES)
        ]
        bits = sum(1 for same, _, _ in results if not same)
        tokens = sum(1 for _, same_tokens, _ in results if not same_tokens)
        record_property(f"capacity_{overflow}_differing_logprob_bits", f"{bits}/{CAPACITY_CASES}")
        record_property(f"capacity_{overflow}_differing_tokens", f"{tokens}/{CAPACITY_CASES}")
        print(
            f"expert capacity factor {CAPACITY_FACTOR}, overflow {overflow}: amid others, {bits} of {CAPACITY_CASES} "
            f"answers changed logprob bits, {tokens} tokens"
        )


def test_default_mode_repeats_itself_under_an_identical_schedule(checkpoint: Path) -> None:
    rng = random.Random(1234)
    schedule = crowded_schedule(rng, random_request(rng, "target", 0))
    first = run_schedule(make_engine(checkpoint, "default", max_batch_size=8, max_step_tokens=24), schedule)
    second = run_schedule(make_engine(checkpoint, "default", max_batch_size=8, max_step_tokens=24), schedule)
    assert {k: answer(v) for k, v in first.items()} == {k: answer(v) for k, v in second.items()}, (
        "Same schedule, same kernels: the answers must be identical."
    )


async def test_http_answers_do_not_depend_on_concurrent_load(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path / "random-qwen3", seed=7, with_tokenizer=True)
    settings = BackendSettings(model=folder, block_size=4, kv_split_size=8, kv_cache_mb=1, max_step_tokens=32)
    rng = random.Random(99)
    async with TestClient(TestServer(create_app(settings), host="127.0.0.1")) as client:

        async def complete(prompt: list[int], max_tokens: int, seed: int | None) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0 if seed is None else 1.0}
            response = await client.post("/v1/completions", json={**body, "seed": seed})
            assert response.status == 200, await response.text()
            return (await response.json())["stackpin"]

        shared = []
        for _ in range(4):
            prompt = [rng.randrange(3, 72) for _ in range(rng.randint(1, 30))]
            seed = rng.choice([None, rng.getrandbits(32)])
            alone = await complete(prompt, 10, seed)
            others = [
                complete([rng.randrange(3, 72) for _ in range(rng.randint(1, 40))], rng.randint(1, 16), None)
                for _ in range(rng.randint(1, 16))
            ]
            crowded, *_ = await asyncio.gather(complete(prompt, 10, seed), *others)
            assert crowded["token_ids"] == alone["token_ids"]
            assert [float.hex(x) for x in crowded["token_logprobs"]] == [
                float.hex(x) for x in alone["token_logprobs"]
            ]
            shared.append(crowded["batch"]["max"])
        assert max(shared) > 1, "the concurrent requests never shared a step, so nothing was tested"


# Prefix-cache hits and speculative decoding. Blocks of 4 tokens, so that shares inside a block and on a block
# boundary both come up among prompts of a few dozen tokens; on a GPU, blocks of 16 and longer prompts.
FEATURE_CASES = 12
SPECULATION_CASES = 8  # each runs the target five ways
FEATURE_DEFAULT_CASES = 6
DRAFTS = 4
CPU_SIZES: dict[str, Any] = {
    "num_blocks": 160,
    "block_size": 4,
    "kv_split_size": 8,
    "max_batch_size": 8,
    "max_step_tokens": 24,
    "max_queue": 32,
}


def engine_for(checkpoint: Path, mode: KernelMode, sizes: dict[str, Any], **features: Any) -> Engine:
    return make_engine(checkpoint, mode, **sizes, **features)


def shared_prefix_case(rng: random.Random, block: int, scale: int) -> tuple[list[int], Arrival, int]:
    """A prompt to cache, a target request whose prompt shares a prefix with it, and the prompt tokens a hit must
    serve. The share ends inside a block, on a block boundary, or covers the whole prompt."""
    base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 40 * scale))]
    kind = rng.choice(["inside", "boundary", "whole"])
    if kind == "whole":
        prompt = base
    else:
        if kind == "boundary" and len(base) >= block:
            share = block * rng.randint(1, len(base) // block)
        else:
            share = rng.randint(1, len(base))
        suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12 * scale))]
        if share < len(base) and suffix[0] == base[share]:
            suffix[0] = (suffix[0] + 1) % VOCAB  # the share ends exactly where it says
        prompt = base[:share] + suffix
    share = len(prompt) if kind == "whole" else share
    expected = min(share, len(prompt) - 1) // block * block
    return base, replace(random_request(rng, "target", 0), prompt=prompt), expected


def loaded_schedule(rng: random.Random, target: Arrival, prefixes: list[list[int]] = ()) -> list[Arrival]:  # type: ignore[assignment]
    """The target amid 1 to 8 random others, some of whose prompts start with a prefix of one of `prefixes`."""
    schedule = crowded_schedule(rng, target, most=8)
    for i, other in enumerate(schedule[1:], start=1):
        if prefixes and rng.random() < 0.5:
            prefix = rng.choice(prefixes)
            schedule[i] = replace(other, prompt=prefix[: rng.randint(1, len(prefix))] + other.prompt)
    return schedule


def compare_cold_and_hit(
    checkpoint: Path, mode: KernelMode, seed: int, sizes: dict[str, Any] = CPU_SIZES, **device: Any
) -> tuple[list[bool], int]:
    """Serve a target cold, then with a hit alone and amid load (others hitting too): (same bits each time, the
    prompt tokens its lone hit found cached)."""
    rng = random.Random(seed)
    scale = 1 if sizes["block_size"] <= 4 else 3
    cached, target, expected = shared_prefix_case(rng, sizes["block_size"], scale)
    cold = run_schedule(engine_for(checkpoint, mode, sizes, **device), [target])["target"]
    engine = engine_for(checkpoint, mode, sizes, prefix_cache=True, **device)
    run_schedule(engine, [Arrival(0, "warm", cached, random_request(rng, "warm", 0).params)])
    hit = run_schedule(engine, [target])["target"]
    assert hit[-1].batch.cached_tokens == expected, (
        f"case {seed}: the hit served {hit[-1].batch.cached_tokens}"
    )
    crowded = run_schedule(engine, loaded_schedule(rng, target, [cached, target.prompt]))["target"]
    assert crowded[-1].batch.cached_tokens >= expected
    return [answer(cold) == answer(hit), answer(cold) == answer(crowded)], expected


@pytest.mark.parametrize("seed", range(FEATURE_CASES))
def test_a_prefix_cache_hit_gives_the_cold_answer_alone_and_amid_load(checkpoint: Path, seed: int) -> None:
    same, _ = compare_cold_and_hit(checkpoint, "batch_invariant", seed)
    assert same == [True, True], f"case {seed}: a hit changed the answer (alone, amid load): {same}"


def test_the_prefix_cases_share_inside_blocks_on_boundaries_and_whole_prompts() -> None:
    kinds = set()
    for seed in range(FEATURE_CASES):
        base, target, expected = shared_prefix_case(random.Random(seed), 4, 1)
        shared = next(
            (i for i, (a, b) in enumerate(zip(base, target.prompt, strict=False)) if a != b),
            len(target.prompt),
        )
        kinds.add("whole" if target.prompt == base else "boundary" if shared % 4 == 0 else "inside")
        assert expected % 4 == 0 and expected <= min(shared, len(target.prompt) - 1)
    assert kinds == {"inside", "boundary", "whole"}


def copy_request(rng: random.Random, request_id: str, step: int, scale: int = 1) -> Arrival:
    """A random request whose prompt repeats a piece of itself, so that prompt lookup has drafts to offer."""
    piece = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12 * scale))]
    noise = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8 * scale))]
    request = random_request(rng, request_id, step)
    params = replace(request.params, max_tokens=rng.randint(8, 24))
    return replace(request, prompt=piece + noise + piece[: rng.randint(1, len(piece))], params=params)


def compare_speculation(
    checkpoint: Path, mode: KernelMode, seed: int, sizes: dict[str, Any] = CPU_SIZES, **device: Any
) -> tuple[list[bool], int]:
    """Serve a target with speculation off, then on alone, on amid load, and on amid load with hits: (same bits
    each time, drafts accepted over the three)."""
    rng = random.Random(seed)
    target = copy_request(rng, "target", 0, 1 if sizes["block_size"] <= 4 else 3)
    off = run_schedule(engine_for(checkpoint, mode, sizes, **device), [target])["target"]
    runs = [run_schedule(engine_for(checkpoint, mode, sizes, speculative_tokens=DRAFTS, **device), [target])]
    loaded = loaded_schedule(rng, target)
    runs.append(
        run_schedule(engine_for(checkpoint, mode, sizes, speculative_tokens=DRAFTS, **device), loaded)
    )
    both = engine_for(checkpoint, mode, sizes, speculative_tokens=DRAFTS, prefix_cache=True, **device)
    run_schedule(both, [replace(target, request_id="warm")])
    runs.append(run_schedule(both, loaded_schedule(rng, target, [target.prompt])))
    outs = [run["target"] for run in runs]
    assert outs[2][-1].batch.cached_tokens > 0 or len(target.prompt) <= sizes["block_size"]
    return [answer(off) == answer(out) for out in outs], sum(
        out[-1].batch.accepted_draft_tokens for out in outs
    )


def test_speculation_gives_the_answer_without_it_greedy_and_seeded(checkpoint: Path) -> None:
    changed, accepted = [], {"greedy": 0, "seeded": 0}
    for seed in range(SPECULATION_CASES):
        same, kept = compare_speculation(checkpoint, "batch_invariant", seed)
        if same != [True, True, True]:
            changed.append((seed, same))
        accepted["greedy" if copy_request(random.Random(seed), "target", 0).params.greedy else "seeded"] += (
            kept
        )
    assert not changed, f"speculation changed answers (case, [alone, amid load, with hits]): {changed}"
    assert all(accepted.values()), f"no draft was ever kept, so nothing was verified: {accepted}"


def test_default_mode_hits_and_verify_passes_are_reported(
    checkpoint: Path, record_property: pytest.RecordProperty
) -> None:
    hits = [compare_cold_and_hit(checkpoint, "default", seed)[0] for seed in range(FEATURE_DEFAULT_CASES)]
    verified = [compare_speculation(checkpoint, "default", seed)[0] for seed in range(FEATURE_DEFAULT_CASES)]
    hit_rate = sum(not all(same) for same in hits)
    verify_rate = sum(not all(same) for same in verified)
    record_property("default_mode_hits_changing_bits", f"{hit_rate}/{FEATURE_DEFAULT_CASES}")
    record_property("default_mode_speculation_changing_bits", f"{verify_rate}/{FEATURE_DEFAULT_CASES}")
    print(
        f"default mode on this CPU: a prefix-cache hit changed the answer's bits in {hit_rate} of {FEATURE_DEFAULT_CASES} "
        f"cases, speculation in {verify_rate} of {FEATURE_DEFAULT_CASES}"
    )


GPU_CASES = 6
GPU_SIZES: dict[str, Any] = {
    **CPU_SIZES,
    "num_blocks": 256,
    "block_size": 16,
    "kv_split_size": 64,
    "max_step_tokens": 64,
}


def on_gpu() -> dict[str, Any]:
    pytest.importorskip("triton")
    return {"device": torch.device("cuda"), "dtype": torch.bfloat16, "step_graphs": DEFAULT_MAX_GRAPHS}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_with_cuda_graphs_hits_and_speculation_change_no_bit(checkpoint: Path) -> None:
    device = on_gpu()
    hits = [
        compare_cold_and_hit(checkpoint, "batch_invariant", seed, GPU_SIZES, **device)
        for seed in range(GPU_CASES)
    ]
    assert [same for same, _ in hits] == [[True, True]] * GPU_CASES
    assert any(cached for _, cached in hits)
    verified = [
        compare_speculation(checkpoint, "batch_invariant", s, GPU_SIZES, **device) for s in range(GPU_CASES)
    ]
    assert [same for same, _ in verified] == [[True, True, True]] * GPU_CASES
    assert sum(kept for _, kept in verified) > 0, "no draft was ever kept, so nothing was verified"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_default_mode_hits_and_verify_passes_are_reported(
    checkpoint: Path, record_property: pytest.RecordProperty
) -> None:
    device = on_gpu()
    hits = [
        compare_cold_and_hit(checkpoint, "default", seed, GPU_SIZES, **device)[0] for seed in range(GPU_CASES)
    ]
    verified = [
        compare_speculation(checkpoint, "default", s, GPU_SIZES, **device)[0] for s in range(GPU_CASES)
    ]
    hit_rate, verify_rate = sum(not all(s) for s in hits), sum(not all(s) for s in verified)
    record_property("gpu_default_mode_hits_changing_bits", f"{hit_rate}/{GPU_CASES}")
    record_property("gpu_default_mode_speculation_changing_bits", f"{verify_rate}/{GPU_CASES}")
    print(
        f"default mode on {torch.cuda.get_device_name(0)}: a prefix-cache hit changed the answer's bits in "
        f"{hit_rate} of {GPU_CASES} cases, speculation in {verify_rate} of {GPU_CASES}"
    )


# The MoE model on a GPU: its experts in grouped launches (kernels/triton/expert_matmul.py), dropless steps replayed
# from CUDA graphs; up to 16 requests share a step.
MOE_GPU_CASES = 8
MOE_GPU_SIZES: dict[str, Any] = {
    "num_blocks": 256,
    "block_size": 16,
    "kv_split_size": 64,
    "max_batch_size": 16,
    "max_step_tokens": 64,
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(MOE_GPU_CASES))
def test_on_a_gpu_dropless_mixture_of_experts_answers_do_not_depend_on_the_batch(
    moe_checkpoint: Path, seed: int
) -> None:
    same, _, shared = compare_alone_and_crowded(
        moe_checkpoint, "batch_invariant", seed, **MOE_GPU_SIZES, **on_gpu()
    )
    assert same, (
        f"case {seed}: the MoE model's answer changed amid others on the GPU (largest batch {shared})"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_mixture_of_experts_default_and_capacity_are_reported(
    moe_checkpoint: Path, record_property: pytest.RecordProperty
) -> None:
    device = {**MOE_GPU_SIZES, **on_gpu()}
    runs = {
        "default": [
            compare_alone_and_crowded(moe_checkpoint, "default", s, **device) for s in range(MOE_GPU_CASES)
        ],
        # Capacity-limited steps run eagerly, as the backend serves them.
        "capacity_pass_through": [
            compare_alone_and_crowded(
                moe_checkpoint,
                "batch_invariant",
                s,
                ExpertRouting(CAPACITY_FACTOR),
                **{**device, "step_graphs": 0},
            )
            for s in range(MOE_GPU_CASES)
        ],
    }
    for name, results in runs.items():
        bits = sum(1 for same, _, _ in results if not same)
        record_property(f"gpu_moe_{name}_differing_logprob_bits", f"{bits}/{MOE_GPU_CASES}")
        print(
            f"MoE model, {name} on {torch.cuda.get_device_name(0)}: {bits} of {MOE_GPU_CASES} answers changed bits"
        )
