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

from pinned_backend.checkpoint import CheckpointError, parse_config
from pinned_backend.engine import Engine
from pinned_backend.kernels import select_kernels
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer
from pinned_backend.routing import ExpertRouting
from pinned_backend.sampling import SamplingParams
from tests.support.backend_checkpoint import make_engine
from tests.support.family_checkpoints import FAMILIES, VOCAB, write_family_checkpoint
from tests.support.scripted_arrivals import Arrival, run_schedule
from tests.test_invariance import (
    CPU_SIZES,
    DRAFTS,
    GPU_SIZES,
    answer,
    copy_request,
    crowded_schedule,
    engine_for,
    loaded_schedule,
    on_gpu,
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
        rows, cache = [out.logits[0]], out.cache
        for t in range(first, ids.numel()):
            out = model(ids[None, t : t + 1], cache=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.cache
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


def served_four_ways(
    folder: Path, seed: int, sizes: dict[str, Any] = CPU_SIZES, **device: Any
) -> tuple[dict[str, tuple[list[int], list[str]]], int]:
    """One request whose prompt repeats a piece of itself (so prompt lookup drafts), served alone; amid load; amid
    load from a warm prefix cache; and amid load with speculation and the cache: each answer's tokens and logprob
    bits, and the prompt tokens the last found cached. `device`: make_engine's settings for another device."""
    rng = random.Random(seed)
    # Up to 64 prompt tokens (four times that with the GPU's blocks of 16): past every window, into cached blocks.
    target = copy_request(rng, "target", 0, scale=2 if sizes["block_size"] <= 4 else 8)

    def engine(**features: Any) -> Engine:
        return engine_for(folder, "batch_invariant", sizes, **device, **features)

    runs = {}
    runs["alone"] = run_schedule(engine(), [target])["target"]
    runs["amid load"] = run_schedule(engine(), crowded_schedule(rng, target, most=6))["target"]
    cached = engine(prefix_cache=True)
    run_schedule(cached, [replace(target, request_id="warm")])
    runs["from the cache"] = run_schedule(cached, loaded_schedule(rng, target, [target.prompt]))["target"]
    both = engine(prefix_cache=True, speculative_tokens=DRAFTS)
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


def parsed(family: str, **changes: Any) -> Any:
    return parse_config({**FAMILIES[family], **changes})


def test_each_family_reads_the_variants_it_adds() -> None:
    gemma2, gemma3 = parsed("gemma2"), parsed("gemma3_text")
    assert (
        gemma2.norm_layout == gemma3.norm_layout == "sandwich" and gemma2.norm_offset and gemma3.norm_offset
    )
    assert (
        gemma2.activation == "gelu_tanh" and gemma2.embed_scale == 32**0.5 and gemma2.attn_scale == 16**-0.5
    )
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (2.0, 3.0) and gemma2.sliding_layers == {0}
    assert gemma3.qk_norm and gemma3.local_rope_theta == 10000.0 and gemma3.rope_theta == 1e6
    assert gemma3.rope_scaling is not None and gemma3.rope_scaling.kind == "linear"
    assert parsed("mistral").sliding_layers == {0, 1} and parsed("ministral").sliding_layers == {0}
    assert parsed("ministral3").query_scale_beta == 0.1 and parsed("phi3").fused_projections
    assert parsed("olmo2").norm_layout == "post" and parsed("olmo2").qk_norm_span == "projection"
    assert parsed("olmo3").sliding_layers == {0} and parsed("olmo3").local_rope_theta == 500_000.0
    granite = parsed("granite")
    assert (granite.embed_scale, granite.residual_scale, granite.attn_scale, granite.logits_divisor) == (
        12.0,
        0.22,
        0.25,
        2.0,
    )
    assert parsed("smollm3").nope_layers == {1}
    gpt_oss = parsed("gpt_oss")
    assert (
        gpt_oss.sinks and gpt_oss.o_bias and gpt_oss.moe is not None and gpt_oss.moe.scoring == "topk_softmax"
    )
    assert gpt_oss.moe.router_bias and gpt_oss.moe.expert_bias and gpt_oss.moe.activation == "clamped_swiglu"
    deepseek = parsed("deepseek_v3")
    assert deepseek.mla is not None and deepseek.head_dim == 8 and deepseek.cache_shape == (1, 24, 0)
    assert (
        deepseek.moe is not None and deepseek.moe.sparse_layers == {1} and deepseek.moe.scoring == "sigmoid"
    )
    assert (deepseek.moe.n_group, deepseek.moe.topk_group, deepseek.moe.shared_intermediate_size) == (
        4,
        2,
        16,
    )


def test_hugging_faces_defaults_fill_what_a_config_leaves_out() -> None:
    bare = {
        k: v for k, v in FAMILIES["gemma2"].items() if "softcapping" not in k and k != "query_pre_attn_scalar"
    }
    gemma2 = parse_config(bare)
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attn_scale) == (50.0, 30.0, 256**-0.5)
    no_types = {k: v for k, v in FAMILIES["gemma3_text"].items() if k != "layer_types"}
    assert parse_config({**no_types, "num_hidden_layers": 12}).sliding_layers == set(range(12)) - {5, 11}
    smollm3 = {k: v for k, v in FAMILIES["smollm3"].items() if k != "no_rope_layers"}
    assert parse_config({**smollm3, "num_hidden_layers": 8}).nope_layers == {3, 7}


def test_gemma3s_two_spellings_of_its_rotary_embeddings_read_alike() -> None:
    hub = FAMILIES["gemma3_text"]
    written = {
        k: v for k, v in hub.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")
    }
    written["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert parse_config(written) == parse_config(hub)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("mistral", {"model_type": "mamba"}, "model_type 'mamba' is not supported; supported: llama, qwen2"),
        (
            "gemma3_text",
            {"use_bidirectional_attention": True},
            "use_bidirectional_attention=True is not supported",
        ),
        (
            "gemma2",
            {"hidden_activation": "gelu"},
            "hidden_act 'gelu' is not supported; only 'gelu_pytorch_tanh'",
        ),
        ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
        (
            "phi3",
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "need 4",
        ),
        ("ministral", {"layer_types": ["sliding_attention"]}, "'layer_types' must list 2 of"),
        (
            "deepseek_v3",
            {"scoring_func": "softmax"},
            "scoring_func='softmax' is not supported; only 'sigmoid'",
        ),
        ("deepseek_v3", {"n_group": 3}, "is not a valid grouping"),
        ("gpt_oss", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
        ("smollm3", {"no_rope_layers": [1]}, "'no_rope_layers' must be a list of 2 zeros and ones"),
    ],
)
def test_a_config_asking_for_what_is_not_computed_is_refused_by_name(
    family: str, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        parse_config({**FAMILIES[family], **change}, where="folder/config.json")
    assert message in str(info.value)


def test_a_capacity_factor_is_refused_for_routers_it_is_not_defined_for(
    checkpoint: Callable[[str], Path],
) -> None:
    with pytest.raises(ValueError, match="applies to softmax routers; this deepseek_v3 routes by sigmoid"):
        Transformer.from_pretrained(
            checkpoint("deepseek_v3"),
            select_kernels("default", CPU),
            CPU,
            torch.float32,
            routing=ExpertRouting(1.0),
        )


def test_latent_attentions_cache_holds_one_latent_and_one_rotated_key_per_token(
    checkpoint: Callable[[str], Path],
) -> None:
    model = Transformer.from_pretrained(
        checkpoint("deepseek_v3"), select_kernels("default", CPU), CPU, torch.float32
    )
    cache = PagedKVCache(model.config, 4, 16, CPU, torch.float32)
    assert cache.k[0].shape == (4, 16, 1, 16 + 8) and cache.v[0] is cache.k[0]
    assert PagedKVCache.bytes_per_block(model.config, 16, torch.float32) == 2 * 16 * 24 * 4


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    folders: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gpu-families")

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = write_family_checkpoint(root / family, family, gpu=True)
        return folders[family]

    return get


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", NAMES)
def test_on_a_gpu_with_cuda_graphs_answers_are_bit_identical_and_logits_as_close_as_transformers_bf16(
    family: str, gpu_checkpoint: Callable[[str], Path]
) -> None:
    transformers = pytest.importorskip("transformers")
    folder = gpu_checkpoint(family)
    answers, hit = served_four_ways(folder, seed=3, sizes=GPU_SIZES, **on_gpu())
    for name, got in answers.items():
        assert got == answers["alone"], f"{family} on a GPU: the answer {name} differs from the one alone"
    assert hit > 0, "the prefix cache served nothing, so nothing was tested"
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    sequences = prompts(4, seed=6, longest=32 if family == "phi3" else 48)
    expected = torch.stack([reference_logits(reference, family, ids)[-1] for ids in sequences])
    # transformers' own bf16 error sets the bar: a mixture of experts in bf16 may send a token to other experts.
    halved = torch.stack(
        [reference_logits(reference.to(torch.bfloat16), family, ids)[-1] for ids in sequences]
    )
    bar = max(3 * float((halved.float() - expected).norm() / expected.norm()), 0.03)
    cuda = torch.device("cuda")
    for mode in ("default", "batch_invariant"):
        kernels = select_kernels(mode, cuda, kv_split_size=64)  # type: ignore[arg-type]
        model = Transformer.from_pretrained(folder, kernels, cuda, torch.bfloat16)
        runner = Runner(model, sequences, device=cuda)
        runner.step([(s, ids.numel()) for s, ids in enumerate(sequences)])
        last = torch.stack([runner.logits[s][-1] for s in range(len(sequences))]).cpu()
        error = float((last - expected).norm() / expected.norm())
        assert error < bar, (
            f"{family} {mode} on a GPU: relative error {error:.4f} of the last logits (bar {bar:.4f})"
        )
