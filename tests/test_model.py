"""Specification of the decoder: it computes what a dense float64 Llama/Qwen forward computes, and in
batch_invariant mode a sequence's logits do not depend on how its tokens were batched or chunked."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pinned_backend.checkpoint import CheckpointError, ModelConfig, expected_shapes, parse_config
from pinned_backend.kernels import select_kernels
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer, rope_inv_freq, silu

CPU = torch.device("cpu")
BLOCK = 16
BASE = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
VARIANTS = {
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    "llama3.2": {
        **BASE,
        "model_type": "llama",
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {**BASE, "model_type": "qwen2", "tie_word_embeddings": False},
}


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif len(shape) == 1:
            weights[name] = 0.1 * torch.randn(shape, generator=generator)
        else:
            weights[name] = torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    return weights


def write_folder(folder: Path, raw: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    weights = random_weights(parse_config(raw), seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(weights, str(folder / "model.safetensors"))
    return weights


def dense_reference(config: ModelConfig, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The whole sequence at once, in float64, written the way the Hugging Face modelling code reads."""
    w = {name: t.double() for name, t in weights.items()}
    n, heads, kv_heads, dim = (
        ids.numel(),
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        bias = w.get(name + ".bias")
        return x @ w[name + ".weight"].T + (0 if bias is None else bias)

    freqs = torch.arange(n).double()[:, None] * rope_inv_freq(config).double()[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]

    def rope(x: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * cos + rotated * sin

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = linear(h, p + "self_attn.q_proj").view(n, heads, dim)
        k = linear(h, p + "self_attn.k_proj").view(n, kv_heads, dim)
        v = linear(h, p + "self_attn.v_proj").view(n, kv_heads, dim)
        if config.qk_norm:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + linear(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * dim), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = linear(h, p + "mlp.gate_proj"), linear(h, p + "mlp.up_proj")
        x = x + linear(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


class Runner:
    """Feeds a model steps of (sequence, tokens) pairs over one shared paged cache; collects every row's logits."""

    def __init__(self, model: Transformer, sequences: list[torch.Tensor], device: torch.device = CPU) -> None:
        self.model = model
        self.sequences = sequences
        self.device = device
        width = max(-(-s.numel() // BLOCK) for s in sequences)
        self.cache = PagedKVCache(model.config, width * len(sequences), BLOCK, device, model.dtype)
        # Sequences' blocks interleaved, so that no sequence owns a contiguous range.
        tables = torch.arange(width * len(sequences), dtype=torch.int32).view(width, -1).T.contiguous()
        self.tables = tables.to(device)
        self.done = [0] * len(sequences)
        self.logits: list[list[torch.Tensor]] = [[] for _ in sequences]

    def step(self, chunks: list[tuple[int, int]]) -> None:
        ids, seq, pos = [], [], []
        for s, count in chunks:
            start = self.done[s]
            ids.append(self.sequences[s][start : start + count])
            seq += [s] * count
            pos += list(range(start, start + count))
            self.done[s] += count
        rows = torch.arange(len(seq), device=self.device)
        logits = self.model.forward(
            torch.cat(ids).to(self.device), torch.tensor(seq, dtype=torch.int32, device=self.device),
            torch.tensor(pos, dtype=torch.int32, device=self.device), self.tables, self.cache, rows,
        )  # fmt: skip
        for row, s in enumerate(seq):
            self.logits[s].append(logits[row])

    def remaining(self, s: int) -> int:
        return self.sequences[s].numel() - self.done[s]


def unfused_forward(
    model: Transformer,
    token_ids: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    block_tables: torch.Tensor,
    cache: PagedKVCache,
    logits_rows: torch.Tensor,
) -> torch.Tensor:
    """The forward pass as it was written before the fused kernel families: one torch op per elementwise step, the
    model's kernels for every reduction."""
    kernels, c, eps = model.kernels, model.config, model.config.rms_norm_eps
    n, half = token_ids.shape[0], c.head_dim // 2
    pos = query_pos.long()
    slots = block_tables[query_seq.long(), pos // BLOCK].long() * BLOCK + pos % BLOCK
    cos, sin = model.rope_cos[pos][:, None, :], model.rope_sin[pos][:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    x = model.embed[token_ids]
    for i, layer in enumerate(model.layers):
        h = kernels.rms_norm(x, layer.input_norm, eps)
        qkv = kernels.matmul(h, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(n, c.num_attention_heads, c.head_dim)
        k = k.reshape(n, c.num_key_value_heads, c.head_dim)
        v = v.reshape(n, c.num_key_value_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = kernels.rms_norm(q.reshape(-1, c.head_dim), layer.q_norm, eps).reshape(q.shape)
            k = kernels.rms_norm(k.reshape(-1, c.head_dim), layer.k_norm, eps).reshape(k.shape)
        q, k = rope(q), rope(k)
        cache.write(i, slots, k, v)
        attended = kernels.attention(
            q, cache.k[i], cache.v[i], block_tables, query_seq, query_pos, 1.0 / math.sqrt(c.head_dim)
        )
        x = x + kernels.matmul(attended.reshape(n, c.q_size), layer.o)
        h = kernels.rms_norm(x, layer.post_norm, eps)
        gate, up = kernels.matmul(h, layer.gate_up).chunk(2, dim=-1)
        g32 = gate.float()
        x = x + kernels.matmul((g32 / (1 + torch.exp(-g32))).to(gate.dtype) * up, layer.down)
    return kernels.matmul(kernels.rms_norm(x[logits_rows], model.norm, eps), model.lm_head).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["default", "batch_invariant"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_forward_gives_the_unfused_forwards_bits(
    tmp_path: Path, variant: str, mode: Any, dtype: torch.dtype
) -> None:
    write_folder(tmp_path, VARIANTS[variant])
    model = Transformer.from_pretrained(tmp_path, select_kernels(mode, CPU, kv_split_size=32), CPU, dtype)
    generator = torch.Generator().manual_seed(6)
    sequences = [torch.randint(0, 512, (50,), generator=generator) for _ in range(2)]
    tables = torch.arange(8, dtype=torch.int32).view(4, 2).T.contiguous()  # [2 sequences, 4 blocks]
    fused_cache, unfused_cache = (PagedKVCache(model.config, 8, BLOCK, CPU, dtype) for _ in range(2))
    done = [0, 0]
    # A prefill of both, a decode step of both, then chunks; logits for some rows, in no particular order.
    for chunks, rows in [
        ([(0, 30), (1, 12)], [29, 41, 0]),
        ([(1, 1), (0, 1)], [1, 0]),
        ([(0, 19), (1, 9)], [27]),
    ]:
        ids, seq, pos = [], [], []
        for s, count in chunks:
            ids.append(sequences[s][done[s] : done[s] + count])
            seq += [s] * count
            pos += range(done[s], done[s] + count)
            done[s] += count
        step = (
            torch.cat(ids),
            torch.tensor(seq, dtype=torch.int32),
            torch.tensor(pos, dtype=torch.int32),
            tables,
        )
        logits_rows = torch.tensor(rows)
        fused = model.forward(*step, fused_cache, logits_rows)
        with torch.inference_mode():
            unfused = unfused_forward(model, *step, unfused_cache, logits_rows)
        assert torch.equal(fused, unfused), (
            f"{mode} {variant} {dtype}: fused logits differ from the unfused ones"
        )
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(fused_cache.k[layer], unfused_cache.k[layer])
            assert torch.equal(fused_cache.v[layer], unfused_cache.v[layer])


@pytest.mark.parametrize("mode", ["default", "batch_invariant"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_the_dense_float64_reference(tmp_path: Path, variant: str, mode: Any) -> None:
    weights = write_folder(tmp_path, VARIANTS[variant])
    model = Transformer.from_pretrained(
        tmp_path, select_kernels(mode, CPU, kv_split_size=32), CPU, torch.float32
    )
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1))
    expected = dense_reference(model.config, weights, ids)
    runner = Runner(model, [ids])
    for count in (30, 1, 20, 19):  # a prefill, a decode step, two chunks
        runner.step([(0, count)])
    logits = torch.stack(runner.logits[0])
    assert logits.dtype == torch.float32 and logits.shape == (70, 512)
    torch.testing.assert_close(logits.double(), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_runs_close_to_the_reference(tmp_path: Path, dtype: torch.dtype) -> None:
    weights = write_folder(tmp_path, VARIANTS["qwen3"])
    model = Transformer.from_pretrained(tmp_path, select_kernels("batch_invariant", CPU), CPU, dtype)
    assert model.embed.dtype == dtype
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2))
    runner = Runner(model, [ids])
    runner.step([(0, 24)])
    expected = dense_reference(model.config, weights, ids)
    torch.testing.assert_close(torch.stack(runner.logits[0]).double(), expected, atol=0.15, rtol=0.05)


def test_only_the_requested_rows_get_logits(tmp_path: Path) -> None:
    write_folder(tmp_path, VARIANTS["qwen3"])
    model = Transformer.from_pretrained(tmp_path, select_kernels("default", CPU), CPU, torch.float32)
    cache = PagedKVCache(model.config, 4, BLOCK, CPU, torch.float32)
    ids = torch.arange(10)
    seq, pos = torch.zeros(10, dtype=torch.int32), torch.arange(10, dtype=torch.int32)
    tables = torch.arange(4, dtype=torch.int32)[None]
    logits = model.forward(ids, seq, pos, tables, cache, torch.tensor([9, 3]))
    assert logits.shape == (2, 512) and logits.dtype == torch.float32
    # A step that only prefills part of a prompt needs no logits at all.
    assert model.forward(ids, seq, pos, tables, cache, torch.zeros(0, dtype=torch.int64)).shape == (0, 512)


def test_a_dtype_that_cannot_serve_is_refused_by_name(tmp_path: Path) -> None:
    write_folder(tmp_path, VARIANTS["qwen3"])
    with pytest.raises(ValueError, match=r"cannot serve weights in torch\.int8; choose one of float32"):
        Transformer.from_pretrained(tmp_path, select_kernels("default", CPU), CPU, torch.int8)


def test_loading_a_folder_without_weights_is_an_error_naming_what_is_missing(tmp_path: Path) -> None:
    write_folder(tmp_path, VARIANTS["llama3.2"])
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        Transformer.from_pretrained(tmp_path, select_kernels("default", CPU), CPU, torch.float32)


def test_llama3_rope_scaling_slows_only_long_wavelengths() -> None:
    scaled = rope_inv_freq(parse_config(VARIANTS["llama3.2"]))
    plain = rope_inv_freq(parse_config({**VARIANTS["llama3.2"], "rope_scaling": None}))
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any()
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    between = ~short & ~long
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_gives_an_element_the_same_bits_whatever_the_tensor_around_it(dtype: torch.dtype) -> None:
    x = (torch.randn(3000, generator=torch.Generator().manual_seed(4)) * 6).to(dtype)
    whole = silu(x)
    torch.testing.assert_close(
        whole, torch.nn.functional.silu(x), atol=1e-6, rtol=1e-2 if dtype != torch.float32 else 1e-6
    )
    for length in (1, 5, 37, 1000):
        pieces = torch.cat([silu(x[i : i + length]) for i in range(0, x.numel(), length)])
        assert torch.equal(pieces, whole), f"silu over pieces of {length} elements differs from silu over all"


def random_schedule_run(
    model: Transformer, sequences: list[torch.Tensor], target_chunks: list[int], seed: int
) -> list[torch.Tensor]:
    """Run sequence 0 in `target_chunks`, one chunk per step, amid the other sequences, which start at random
    steps and advance by random chunks (prefill pieces or single decode tokens). Returns sequence 0's logits."""
    generator = torch.Generator().manual_seed(seed)
    runner = Runner(model, sequences)
    starts = torch.randint(0, len(target_chunks), (len(sequences),), generator=generator).tolist()
    plan = list(target_chunks)
    step = 0
    while plan or any(runner.remaining(s) for s in range(1, len(sequences))):
        chunks = [(0, plan.pop(0))] if plan else []
        for s in range(1, len(sequences)):
            if step >= starts[s] and runner.remaining(s):
                size = (
                    1 if torch.rand(1, generator=generator).item() < 0.5 else 1 + int(torch.randint(20, (1,)))
                )
                chunks.append((s, min(size, runner.remaining(s))))
        order = torch.randperm(
            len(chunks), generator=generator
        ).tolist()  # the target's place in the step varies
        if chunks:
            runner.step([chunks[i] for i in order])
        step += 1
    return runner.logits[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_logits_do_not_depend_on_batching_or_chunking(tmp_path: Path, dtype: torch.dtype) -> None:
    write_folder(tmp_path, VARIANTS["qwen3"])
    model = Transformer.from_pretrained(
        tmp_path, select_kernels("batch_invariant", CPU, kv_split_size=32), CPU, dtype
    )
    generator = torch.Generator().manual_seed(3)
    target = torch.randint(0, 512, (45,), generator=generator)

    alone = Runner(model, [target])
    alone.step([(0, 45)])
    expected = alone.logits[0]

    schedules = {"at once": [45], "in chunks": [7, 1, 16, 21], "token by token": [1] * 45}
    for trial, (name, chunks) in enumerate(schedules.items()):
        others = [
            torch.randint(
                0, 512, (int(torch.randint(1, 70, (1,), generator=generator)),), generator=generator
            )
            for _ in range(int(torch.randint(1, 6, (1,), generator=generator)))
        ]
        got = random_schedule_run(model, [target, *others], chunks, seed=trial)
        for position, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a, b), (
                f"{name} amid {len(others)} other sequences: logits at position {position} differ from the "
                "sequence run alone; batch_invariant mode must give identical bits"
            )
