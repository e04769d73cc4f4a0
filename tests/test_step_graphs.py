"""Specification of steps padded to captured shapes (pinned_backend/step_graphs.py): decode, prefill and mixed.

Padding is sound only because the kernels are batch invariant: every request gets the same tokens and logprob
bits with padded steps as without. On the CPU the padded steps run eagerly; on a GPU they replay CUDA graphs.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from pinned_backend.engine import Engine, EngineConfig, RequestTooLarge, StepStats
from pinned_backend.sampling import SamplingParams
from pinned_backend.step_graphs import DEFAULT_MAX_GRAPHS, StepGraphs, StepShape, token_sizes
from tests.support.backend_checkpoint import Collector, make_engine, write_random_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("graphs") / "random-qwen3")


def _serve_all(engine: Engine, seed: int) -> dict[str, tuple[object, ...]]:
    """Random requests (greedy and seeded, with top logprobs) arriving over the first steps, one long one last, so
    that decode-only steps come at several batch sizes and two block-table widths; what each request got."""
    rng = random.Random(seed)
    collectors: dict[str, Collector] = {}
    jobs = []
    for i in range(9):
        prompt = [rng.randrange(90) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(4, 24), top_logprobs=3
        )
        jobs.append((f"r{i}", prompt, params))
    jobs.insert(
        0, ("long", [rng.randrange(90) for _ in range(70)], SamplingParams(temperature=0, max_tokens=8))
    )
    while jobs or engine.has_work():
        for _ in range(rng.randint(1, 3)):
            if jobs:
                rid, prompt, params = jobs.pop()
                collectors[rid] = Collector()
                engine.submit(rid, prompt, params, collectors[rid])
        engine.step()
    return {
        rid: tuple((o.token_id, o.logprob, o.top_logprobs) for o in c.outputs)
        for rid, c in collectors.items()
    }


# Prompts of up to 20 tokens and one of 70 under a budget of 40 tokens a step: decode-only steps at several batch
# sizes, and prefill and mixed steps of many token counts, chunked where a prompt outgrows the budget.
SIZES = {"max_batch_size": 7, "max_step_tokens": 40, "num_blocks": 64, "block_size": 4, "kv_split_size": 8}


def test_padded_steps_give_every_request_the_same_bits_as_unpadded_ones(checkpoint: Path) -> None:
    plain = _serve_all(make_engine(checkpoint, **SIZES), seed=3)
    stats: list[StepStats] = []
    padded_engine = make_engine(checkpoint, **SIZES, step_graphs=DEFAULT_MAX_GRAPHS, on_step=stats.append)
    padded = _serve_all(padded_engine, seed=3)
    assert padded == plain
    graphs = padded_engine._graphs
    assert graphs is not None and graphs.sequence_sizes == [1, 2, 4, 7]
    assert graphs.padded_tokens > 0 and graphs.padded_sequences > 0, "nothing was padded: it proves nothing"
    assert sum(s.padded_tokens for s in stats) == graphs.padded_tokens
    assert {s.launch for s in stats if s.sequences} == {"eager"}, "without capture, padded steps run eagerly"
    decode_batches = {s.sequences for s in stats if s.sequences and s.prefill_tokens == 0}
    assert len(decode_batches) >= 2, "decode-only steps should have run at several batch sizes"
    assert len({s for s in graphs.shapes if s.tokens != s.sequences}) >= 3, (
        "and prefill or mixed steps at several"
    )
    assert {shape.width for shape in graphs.shapes} == {16, 32}, "steps should have run at two table widths"


def test_padded_verify_passes_and_prefix_hits_give_the_bits_of_unpadded_ones(checkpoint: Path) -> None:
    features = {"speculative_tokens": 3, "prefix_cache": True}
    plain_engine = make_engine(checkpoint, **SIZES, **features)
    plain = [_serve_all(plain_engine, seed=5), _serve_all(plain_engine, seed=5)]  # the second from the cache
    stats: list[StepStats] = []
    engine = make_engine(
        checkpoint, **SIZES, **features, step_graphs=DEFAULT_MAX_GRAPHS, on_step=stats.append
    )
    assert [_serve_all(engine, seed=5), _serve_all(engine, seed=5)] == plain
    assert engine._graphs is not None and any(shape.rows for shape in engine._graphs.shapes), (
        "no step wanted more logits rows than sequences: no verify pass was padded"
    )
    assert sum(s.accepted_draft_tokens for s in stats) > 0 and sum(s.cached_tokens for s in stats) > 0


def test_default_kernels_run_padded_steps_too_and_answer_every_request_in_full(checkpoint: Path) -> None:
    # Padding may round a default-mode row otherwise, which that mode never promised; it must still serve.
    engine = make_engine(checkpoint, "default", **SIZES, step_graphs=DEFAULT_MAX_GRAPHS)
    served = _serve_all(engine, seed=3)
    plain = _serve_all(make_engine(checkpoint, "default", **SIZES), seed=3)
    assert {rid: len(tokens) for rid, tokens in served.items()} == {rid: len(t) for rid, t in plain.items()}
    assert engine._graphs is not None and engine._graphs.padded_tokens > 0


def test_the_padding_block_is_neither_offered_to_requests_nor_counted_as_used(checkpoint: Path) -> None:
    stats: list[StepStats] = []
    engine = make_engine(
        checkpoint, num_blocks=8, block_size=4, step_graphs=DEFAULT_MAX_GRAPHS, on_step=stats.append
    )
    with pytest.raises(RequestTooLarge, match="28 tokens"):
        engine.submit("big", [1] * 20, SamplingParams(temperature=0, max_tokens=12), Collector())
    fits = Collector()
    engine.submit("fits", [1] * 20, SamplingParams(temperature=0, max_tokens=8), fits)
    while engine.has_work():
        engine.step()
    assert len(fits.outputs) == 8 and fits.outputs[-1].finish_reason == "length"
    assert stats[0].kv_used_ratio == 1.0, "the request holds all 7 blocks that requests may hold"
    assert engine.allocator.free_blocks == 7 and stats[-1].kv_used_ratio == 0.0


def _graphs(max_batch: int = 5, max_tokens: int = 300, table_width: int = 100) -> StepGraphs:
    cpu = torch.device("cpu")
    return StepGraphs(None, None, 0, max_batch, max_tokens, table_width, device=cpu, capture=False)


def test_decode_only_steps_take_the_next_batch_size_and_other_steps_the_next_token_size() -> None:
    graphs = _graphs()
    assert [graphs.shape_for(b, b, 1).tokens for b in range(1, 6)] == [1, 2, 4, 4, 5]
    assert graphs.shape_for(3, 3, 1) == StepShape(tokens=4, sequences=4, width=16)
    assert graphs.shape_for(17, 3, 1) == StepShape(tokens=20, sequences=4, width=16)
    assert graphs.shape_for(300, 5, 1).tokens == 300
    assert [graphs.shape_for(2, 1, blocks).width for blocks in (1, 16, 17, 64, 65, 100)] == [
        16,
        16,
        32,
        64,
        100,
        100,
    ]


def test_a_step_wanting_more_logits_rows_than_sequences_takes_the_next_token_size_of_rows() -> None:
    graphs = StepGraphs(None, None, 0, 5, 300, 100, device=torch.device("cpu"), capture=False, max_rows=25)
    assert graphs.shape_for(10, 3, 1, rows=3).rows == 0, "one row a sequence, as a step without drafts"
    assert graphs.shape_for(10, 2, 1, rows=10) == StepShape(tokens=12, sequences=2, width=16, rows=12)
    assert graphs.shape_for(24, 5, 1, rows=23).rows == 24
    assert graphs.shape_for(40, 5, 1, rows=25).rows == 25, "never more than the engine's most rows"
    with pytest.raises(ValueError, match="26 logits rows"):
        graphs.shape_for(40, 5, 1, rows=26)


def test_a_step_outside_the_captured_shapes_is_refused() -> None:
    graphs = _graphs()
    with pytest.raises(ValueError, match=r"6 sequences; this engine runs 1\.\.5"):
        graphs.shape_for(6, 6, 1)
    with pytest.raises(ValueError, match=r"301 tokens; this engine runs 1\.\.300"):
        graphs.shape_for(301, 5, 1)
    with pytest.raises(ValueError, match="tables hold 100"):
        graphs.shape_for(4, 2, 101)
    with pytest.raises(ValueError, match="at least 5 tokens"):
        _graphs(max_batch=5, max_tokens=4)


def test_token_sizes_pad_a_step_of_more_than_12_tokens_by_at_most_a_quarter() -> None:
    sizes = token_sizes(8192)
    assert sizes[:9] == [1, 2, 4, 8, 12, 16, 20, 24, 28] and sizes[-1] == 8192
    assert all(next(s for s in sizes if s >= n) <= 1.25 * n for n in range(13, 8193))
    assert token_sizes(100)[-2:] == [96, 100], "the largest step is always a size of its own"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kept", [1, 2])
def test_cuda_graph_steps_give_the_same_bits_as_eager_ones(checkpoint: Path, kept: int) -> None:
    pytest.importorskip("triton")
    sizes = {**SIZES, "block_size": 16, "kv_split_size": 64}
    on_gpu = {"device": torch.device("cuda"), "dtype": torch.bfloat16}
    plain = _serve_all(make_engine(checkpoint, **sizes, **on_gpu), seed=4)
    # Few graphs kept, so that graphs are dropped and captured again along the way (one: the pool's only user).
    graphed_engine = make_engine(checkpoint, **sizes, **on_gpu, step_graphs=kept)
    graphs = graphed_engine._graphs
    assert graphs is not None and graphs.max_graphs == kept
    stats: list[StepStats] = []
    graphed_engine.on_step = stats.append
    graphed = _serve_all(graphed_engine, seed=4)
    assert graphed == plain
    assert graphs.padded_tokens > 0 and len(graphs.shapes) > graphs.max_graphs
    assert graphs.captures > len(graphs.shapes), "no dropped graph was captured again"
    launches = Counter(s.launch for s in stats if s.sequences)
    assert launches == Counter(capture=graphs.captures, graph=graphs.steps - graphs.captures)


def test_step_graphs_are_a_count_of_graphs_to_keep_not_a_switch() -> None:
    with pytest.raises(ValueError, match="step_graphs is a count"):
        EngineConfig(max_model_len=8, num_blocks=4, block_size=4, step_graphs=True)
    with pytest.raises(ValueError, match="step_graphs is a count"):
        EngineConfig(max_model_len=8, num_blocks=4, block_size=4, step_graphs=-1)
