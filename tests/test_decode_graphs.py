"""Specification of decode steps padded to captured batch sizes (pinned_backend/decode_graphs.py).

Padding is sound only because the kernels are batch invariant: every request gets the same tokens and logprob
bits with padded decode steps as without. On the CPU the padded steps run eagerly; on a GPU they replay CUDA graphs.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pinned_backend.decode_graphs import DecodeGraphs
from pinned_backend.engine import Engine, RequestTooLarge
from pinned_backend.sampling import SamplingParams
from tests.backend_checkpoint import Collector, make_engine, write_random_checkpoint


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


def test_padded_decode_steps_give_every_request_the_same_bits_as_unpadded_ones(checkpoint: Path) -> None:
    sizes = {
        "max_batch_size": 7,
        "max_step_tokens": 12,
        "num_blocks": 64,
        "block_size": 4,
        "kv_split_size": 8,
    }
    plain = _serve_all(make_engine(checkpoint, **sizes), seed=3)
    padded_engine = make_engine(checkpoint, **sizes, decode_graphs=True)
    padded = _serve_all(padded_engine, seed=3)
    assert padded == plain
    graphs = padded_engine._graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 7]
    assert graphs.steps > 0 and graphs.padded_rows > 0, "no decode step was padded: the test proves nothing"
    assert {width for _, width in graphs.shapes} == {16, 32}, "steps should have run at two table widths"


def test_decode_graphs_are_refused_under_kernels_that_are_not_batch_invariant(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="only batch-invariant kernels"):
        make_engine(checkpoint, "default", decode_graphs=True)


def test_the_padding_block_is_not_offered_to_requests(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_blocks=8, block_size=4, decode_graphs=True)
    with pytest.raises(RequestTooLarge, match="28 tokens"):
        engine.submit("big", [1] * 20, SamplingParams(temperature=0, max_tokens=12), Collector())
    engine.submit("fits", [1] * 20, SamplingParams(temperature=0, max_tokens=8), Collector())


def test_a_batch_outside_the_captured_sizes_is_refused() -> None:
    graphs = DecodeGraphs(
        None, None, 0, max_batch=5, table_width=4, device=torch.device("cpu"), capture=False
    )
    assert [graphs.size_for(b) for b in range(1, 6)] == [1, 2, 4, 4, 5]
    with pytest.raises(ValueError, match=r"1\.\.5"):
        graphs.size_for(6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_steps_give_the_same_bits_as_eager_ones(checkpoint: Path) -> None:
    pytest.importorskip("triton")
    sizes = {
        "max_batch_size": 7,
        "max_step_tokens": 12,
        "num_blocks": 64,
        "block_size": 16,
        "kv_split_size": 64,
    }
    on_gpu = {"device": torch.device("cuda"), "dtype": torch.bfloat16}
    plain = _serve_all(make_engine(checkpoint, **sizes, **on_gpu), seed=4)
    graphed_engine = make_engine(checkpoint, **sizes, **on_gpu, decode_graphs=True)
    graphed = _serve_all(graphed_engine, seed=4)
    assert graphed == plain
    graphs = graphed_engine._graphs
    assert graphs is not None and graphs.steps > 0 and graphs.padded_rows > 0
