"""Tensor parallelism whose answers do not depend on the degree: a model cut among 1, 2 or 4 processes (gloo on this
CPU, 4 oversubscribed) serves the bits of one process, alone and amid load, with prefix-cache hits and speculation.

The model here has 6 query heads over 3 KV heads and an intermediate size of 120, so that 2 ranks split its heads
unevenly and 4 ranks leave one without any; a byte-level tokenizer gives it 259 tokens, split unevenly too. Each
degree's backend starts once per module and serves every schedule. Under `default` kernels the row-parallel sums
go through the library's all-reduce, and how often that changes an answer across degrees is reported, not asserted.
SmolLM2 is held to the same property at degree 2, and through the proxy a record served at degree 2 replays
`reproduced` on a degree-1 replica.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_asyncio
import torch
from aiohttp.test_utils import TestServer

from pinned_backend.checkpoint import load_config, load_weights
from pinned_backend.cli import main as backend_main
from pinned_backend.kernels import KernelMode
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model_config import ModelConfig
from pinned_backend.parallel.group import connect
from pinned_backend.parallel.shards import (
    MLP_CHUNKS,
    ShardingError,
    check_shardable,
    plan_shard,
    shard_weights,
)
from pinned_backend.parallel.steps import ParallelModel, RankGone, shard_model
from pinned_backend.runtime import BackendSettings, Runtime, kernels_for, load_runtime
from pinned_backend.sampling import SamplingParams
from pinned_backend.server import create_app
from pinned_backend.stack import DTYPE_NAMES, fingerprint
from tests.support.backend_checkpoint import MOE_CONFIG, SMALL_CONFIG, write_random_checkpoint
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy
from tests.support.scripted_arrivals import Arrival, run_schedule
from tests.support.thread_group import ThreadGroup, run_ranks
from tests.test_invariance import answer, copy_request, crowded_schedule, loaded_schedule, random_request

DEGREES = (1, 2, 4)
CASES = 4
DEFAULT_CASES = 4
TP_CONFIG = {**SMALL_CONFIG, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 120}
SIZES: dict[str, Any] = {
    "kv_cache_mb": 1,
    "block_size": 4,
    "kv_split_size": 8,
    "max_batch_size": 8,
    "max_step_tokens": 24,
    "max_queue": 32,
    "prefix_cache": True,
    "speculative_tokens": 4,
    # One torch thread a process: 4 ranks on this 2-core machine would otherwise each wait on the others' threads.
    "threads": 1,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tensor-parallel") / "random-qwen3"
    return write_random_checkpoint(folder, with_tokenizer="bytes", config=TP_CONFIG)


def settings(
    model: Path, degree: int | None, mode: KernelMode = "batch_invariant", **more: Any
) -> BackendSettings:
    return BackendSettings(model=model, tensor_parallel=degree, kernel_mode=mode, **{**SIZES, **more})


@pytest.fixture(scope="module")
def runtimes(checkpoint: Path) -> Iterator[dict[int, Runtime]]:
    started: dict[int, Runtime] = {}
    try:
        for degree in DEGREES:
            started[degree] = load_runtime(settings(checkpoint, degree))
        yield started
    finally:
        for runtime in started.values():
            runtime.close()


def test_the_degree_is_outside_the_fingerprint_and_the_reduction_tree_inside(
    runtimes: dict[int, Runtime],
) -> None:
    stacks = {degree: runtime.stack for degree, runtime in runtimes.items()}
    assert {degree: stack["batching"]["tensor_parallel"] for degree, stack in stacks.items()} == {
        1: 1,
        2: 2,
        4: 4,
    }
    assert stacks[1]["batching"]["reduction_tree"] == {
        "o_proj_chunks": 3,
        "down_proj_chunks": MLP_CHUNKS,
        "order": "sequential_fp32",
    }
    assert len({fingerprint(stack) for stack in stacks.values()}) == 1
    whole = dict(
        stacks[1], batching={k: v for k, v in stacks[1]["batching"].items() if k != "reduction_tree"}
    )
    assert fingerprint(whole) != fingerprint(stacks[1]), "a model summed whole is another stack"


@pytest.mark.parametrize("seed", range(CASES))
def test_every_degree_serves_the_bits_of_one_process_alone_and_amid_load(
    runtimes: dict[int, Runtime], seed: int
) -> None:
    rng = random.Random(seed)
    target = random_request(rng, "target", 0)
    alone = run_schedule(runtimes[1].engine, [target])["target"]
    assert len(alone) == target.params.max_tokens
    for degree in (2, 4):
        crowded = run_schedule(runtimes[degree].engine, crowded_schedule(rng, target))["target"]
        assert answer(crowded) == answer(alone), f"case {seed}: degree {degree} amid load changed the answer"
        assert answer(run_schedule(runtimes[degree].engine, [target])["target"]) == answer(alone)


def test_prefix_hits_and_speculation_at_every_degree_give_the_bits_of_one_process(
    runtimes: dict[int, Runtime],
) -> None:
    accepted, cached = 0, 0
    for seed in range(CASES):
        rng = random.Random(1000 + seed)
        target = copy_request(rng, "target", 0)
        one = run_schedule(runtimes[1].engine, [target])["target"]
        for degree in (2, 4):
            engine = runtimes[degree].engine
            run_schedule(engine, [dataclasses.replace(target, request_id="warm")])
            hit = run_schedule(engine, loaded_schedule(rng, target, [target.prompt]))["target"]
            assert answer(hit) == answer(one), f"case {seed}: degree {degree} with a hit changed the answer"
            accepted += sum(out.batch.accepted_draft_tokens for out in hit[-1:])
            cached += hit[-1].batch.cached_tokens
    assert cached > 0, "no prefix was ever served from the cache"
    assert accepted > 0, "no draft was ever kept, so no verify pass was compared"


def test_default_kernels_sum_with_the_library_s_all_reduce_and_the_degree_is_reported(
    checkpoint: Path, record_property: pytest.RecordProperty
) -> None:
    one, two = (load_runtime(settings(checkpoint, degree, "default")) for degree in (1, 2))
    try:
        changed = 0
        for seed in range(DEFAULT_CASES):
            target = random_request(random.Random(seed), "target", 0)
            outs = [run_schedule(runtime.engine, [target])["target"] for runtime in (one, two)]
            changed += answer(outs[0]) != answer(outs[1])
        record_property("default_answers_changed_by_degree_2", f"{changed}/{DEFAULT_CASES}")
        assert two.stack["batching"]["tensor_parallel"] == 2
        assert "reduction_tree" in two.stack["batching"]
    finally:
        one.close()
        two.close()


def test_a_rank_that_exits_fails_the_next_step_naming_it(checkpoint: Path) -> None:
    runtime = load_runtime(settings(checkpoint, 2))
    try:
        model = runtime.model
        assert isinstance(model, ParallelModel)
        model.workers.processes[0].kill()
        model.workers.processes[0].wait()
        target = random_request(random.Random(0), "target", 0)
        with pytest.raises(RankGone, match=r"rank 1 \(exit -9\) exited; restart the backend"):
            run_schedule(runtime.engine, [target])
    finally:
        runtime.close()


def test_smollm2_at_degree_2_serves_the_bits_of_one_process(smollm2_gguf: Path) -> None:
    prompts = [[1, 9690, 314, 253, 1341], [1, 504, 3458, 282, 4649, 314, 1069, 30]]
    runs: dict[int, dict[str, Any]] = {}
    for degree in (1, 2):
        runtime = load_runtime(
            settings(smollm2_gguf, degree, kv_cache_mb=16, block_size=16, kv_split_size=128)
        )
        try:
            params = SamplingParams(temperature=0.8, seed=7, max_tokens=6)
            alone = run_schedule(runtime.engine, [Arrival(0, "a", prompts[0], params)])["a"]
            both = run_schedule(
                runtime.engine, [Arrival(0, "a", prompts[0], params), Arrival(0, "b", prompts[1], params)]
            )
            runs[degree] = {"alone": answer(alone), "a": answer(both["a"]), "b": answer(both["b"])}
        finally:
            runtime.close()
    assert runs[1]["alone"] == runs[1]["a"]
    assert runs[2] == runs[1]


class ServedBackend:
    """A backend app on loopback, as a replica the proxy harness can name."""

    def __init__(self, server: TestServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@pytest_asyncio.fixture
async def backends(checkpoint: Path) -> AsyncIterator[list[ServedBackend]]:
    servers = [TestServer(create_app(settings(checkpoint, degree)), host="127.0.0.1") for degree in (2, 1)]
    try:
        for server in servers:
            await server.start_server()
        yield [ServedBackend(server) for server in servers]
    finally:
        for server in servers:
            await server.close()


async def test_a_record_served_at_degree_2_replays_reproduced_on_a_degree_1_replica(
    backends: list[ServedBackend], tmp_path: Path
) -> None:
    body = {"model": "random-qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    async with running_proxy(cast(list[FakeReplica], backends), tmp_path) as harness:
        registry = harness.proxy.registry
        replicas = {name: registry.get(name) for name in ("replica-0", "replica-1")}
        assert replicas["replica-0"] is not None and replicas["replica-1"] is not None
        assert replicas["replica-0"].fingerprint == replicas["replica-1"].fingerprint
        replicas["replica-1"].reachable = False
        status, served, headers = await harness.post(
            "/v1/chat/completions", {**body, "temperature": 0.9, "seed": 3}
        )
        assert status == 200 and served["usage"]["completion_tokens"] > 0
        replicas["replica-1"].reachable, replicas["replica-0"].reachable = True, False
        status, result, _ = await harness.post(f"/v1/records/{headers['Stackpin-Record']}/replay", {})
        assert status == 200 and result["outcome"] == "reproduced", result
        replay = await harness.proxy.store.get_record(result["replay_record"], "local")
        assert replay is not None and replay.replica == "replica-1"


def test_shards_cover_every_head_chunk_and_token_once_at_any_degree() -> None:
    config = _config(TP_CONFIG, vocab_size=259)
    for degree in (1, 2, 3, 4, 5, 8):
        shards = [plan_shard(config, degree, rank) for rank in range(degree)]
        assert [h for s in shards for h in s.kv_heads] == list(range(3))
        assert [h for s in shards for h in s.q_heads] == list(range(6))
        assert [c for s in shards for c in s.mlp_chunks] == list(range(MLP_CHUNKS))
        assert [i for s in shards for i in s.intermediate] == list(range(120))
        assert [t for s in shards for t in s.vocab] == list(range(259))


def test_a_shard_keeps_its_heads_rows_and_columns() -> None:
    config = _config(TP_CONFIG, vocab_size=10, num_hidden_layers=1)
    weights = {name: torch.randn(shape) for name, shape in _shapes(config).items()}
    whole = {name: tensor.clone() for name, tensor in weights.items()}
    shard = plan_shard(config, 2, 1)  # KV heads 1, 2 and their query heads 2..5; MLP chunks 4..7; tokens 5..9
    kept = shard_weights(config, weights, shard)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert torch.equal(kept[a + "q_proj.weight"], whole[a + "q_proj.weight"][32:96])
    assert torch.equal(kept[a + "k_proj.weight"], whole[a + "k_proj.weight"][16:48])
    assert torch.equal(kept[a + "o_proj.weight"], whole[a + "o_proj.weight"][:, 32:96])
    assert torch.equal(kept[m + "up_proj.weight"], whole[m + "up_proj.weight"][60:120])
    assert torch.equal(kept[m + "down_proj.weight"], whole[m + "down_proj.weight"][:, 60:120])
    assert torch.equal(kept["lm_head.weight"], whole["lm_head.weight"][5:10])
    assert torch.equal(kept["model.norm.weight"], whole["model.norm.weight"])
    assert not weights, "the whole tensors are consumed"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mla": True}, "latent attention"),
        ({"qk_norm_span": "projection"}, "across every head"),
        ({"degree": 0}, "at least 1"),
    ],
)
def test_what_cannot_be_cut_is_refused_naming_why(change: dict[str, Any], message: str) -> None:
    config = _config(TP_CONFIG, vocab_size=259)
    degree = change.pop("degree", 2)
    if change.pop("mla", False):
        config = dataclasses.replace(config, mla=cast(Any, object()))
    config = dataclasses.replace(config, **change)
    with pytest.raises(ShardingError, match=message):
        check_shardable(config, degree)


def test_the_cli_refuses_a_degree_below_1(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        backend_main(["serve", "--model", str(checkpoint), "--tensor-parallel", "0"])
    assert exit_info.value.code == 2
    assert "--tensor-parallel" in capsys.readouterr().err


def _config(raw: dict[str, Any], **changes: Any) -> ModelConfig:
    from pinned_backend.checkpoint import parse_config

    return parse_config({**raw, **changes})


def _shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    from pinned_backend.checkpoint import expected_shapes

    return expected_shapes(config)


def sizes_on(device: torch.device) -> dict[str, int]:
    """The KV cache's block and the attention's split: the GPU's attention walks keys in tiles of 64."""
    return (
        {"block_size": 4, "kv_split_size": 8}
        if device.type == "cpu"
        else {"block_size": 16, "kv_split_size": 64}
    )


def two_steps(
    forward: Callable[..., torch.Tensor], cache: PagedKVCache, device: torch.device, vocab: int = 259
) -> torch.Tensor:
    """The logits of a 12-token prefill (two rows) and of one decode step after it, in one sequence."""
    tokens = 12

    def on(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    table = on([0, 1, 2, 3], torch.int32)[None]
    prompt = [(7 * i + 3) % vocab for i in range(tokens)]
    prefill = forward(
        on(prompt, torch.int64),
        on([0] * tokens, torch.int32),
        on(list(range(tokens)), torch.int32),
        table,
        cache,
        on([tokens - 1, 3], torch.int64),
    )
    decode = forward(
        on([5], torch.int64),
        on([0], torch.int32),
        on([tokens], torch.int32),
        table,
        cache,
        on([0], torch.int64),
    )
    return torch.cat([prefill, decode]).cpu()


def threaded_logits(checkpoint: Path, degree: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`two_steps` with the model cut `degree` ways among threads on one device (rank 0's logits); the KV cache
    as `sizes_on` gives it, and on a GPU the matmul plans the whole model's shapes choose, as a served rank's."""
    config = load_config(checkpoint)
    group = ThreadGroup(degree)
    sizes = sizes_on(device)
    served = BackendSettings(model=checkpoint, device=device.type, dtype=DTYPE_NAMES[dtype], **sizes)

    def rank(index: int) -> torch.Tensor:
        kernels, _ = kernels_for(served, config, device)
        weights = load_weights(checkpoint, config, dtype)
        model = shard_model(config, weights, kernels, device, dtype, group.member(index))
        cache = PagedKVCache(model.config, 4, sizes["block_size"], device, dtype)
        return two_steps(model.forward, cache, device, config.vocab_size)

    return run_ranks([functools.partial(rank, index) for index in range(degree)])[0]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE-shaped: 4 experts, 2 a token; the first layer sparse, the second dense."""
    folder = tmp_path_factory.mktemp("tensor-parallel") / "random-qwen3-moe"
    return write_random_checkpoint(folder, with_tokenizer="bytes", config=MOE_CONFIG)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_shards_of_degree_2_and_4_give_one_process_s_logits_on_one_device(
    checkpoint: Path, dtype: torch.dtype
) -> None:
    cpu = torch.device("cpu")
    one = threaded_logits(checkpoint, 1, cpu, dtype)
    for degree in (2, 4):
        assert torch.equal(threaded_logits(checkpoint, degree, cpu, dtype), one), f"degree {degree}"


def test_experts_cut_between_two_processes_serve_one_process_s_bits_amid_load(moe_checkpoint: Path) -> None:
    one, two = (load_runtime(settings(moe_checkpoint, degree)) for degree in (1, 2))
    try:
        for seed in range(3):
            rng = random.Random(seed)
            target = random_request(rng, "target", 0)
            alone = run_schedule(one.engine, [target])["target"]
            crowded = run_schedule(two.engine, crowded_schedule(rng, target))["target"]
            assert answer(crowded) == answer(alone), f"case {seed}: experts on two ranks changed the answer"
    finally:
        one.close()
        two.close()


def test_experts_cut_among_ranks_give_one_process_s_logits(moe_checkpoint: Path) -> None:
    cpu = torch.device("cpu")
    one = threaded_logits(moe_checkpoint, 1, cpu, torch.float32)
    for degree in (2, 3, 4):  # 3: the experts split 1 + 1 + 2
        logits = threaded_logits(moe_checkpoint, degree, cpu, torch.float32)
        assert torch.equal(logits, one), f"degree {degree}"


# Qwen3-1.7B's layer shapes (two layers, a small vocabulary): its weights' shapes are in the shipped plan file, and
# a rank's slice of q/k/v or gate/up is not.
PLANNED_CONFIG = {
    **SMALL_CONFIG,
    "vocab_size": 4096,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_rank_s_slices_take_their_whole_weights_plans_and_give_one_process_s_logits(
    tmp_path: Path,
) -> None:
    checkpoint = write_random_checkpoint(tmp_path / "qwen3-1.7b-layers", config=PLANNED_CONFIG)
    gpu = torch.device("cuda")
    served = settings(checkpoint, None, device="cuda", dtype="bf16", **sizes_on(gpu))
    _, plan_file = kernels_for(served, load_config(checkpoint), gpu)
    assert plan_file is not None and (4096, 2048) in plan_file.plans, "the whole q/k/v takes a tuned plan"
    one = threaded_logits(checkpoint, 1, gpu, torch.bfloat16)
    for degree in (2, 4):
        assert torch.equal(threaded_logits(checkpoint, degree, gpu, torch.bfloat16), one), f"degree {degree}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_one_nccl_rank_and_the_shards_of_degree_2_and_4_give_the_same_logits(
    checkpoint: Path,
) -> None:
    gpu = torch.device("cuda")
    runtime = load_runtime(settings(checkpoint, 1, device="cuda", dtype="bf16", **sizes_on(gpu)))
    try:
        model = runtime.model
        assert isinstance(model, ParallelModel)
        one = two_steps(model.forward, runtime.engine.cache, gpu)
    finally:
        runtime.close()
    for degree in (1, 2, 4):
        assert torch.equal(threaded_logits(checkpoint, degree, gpu, torch.bfloat16), one), f"degree {degree}"


# Rank 1 leaves at once once it has printed what it received: the test is of the wait, not of gloo's teardown.
IDLE_RANK = """
import os, sys, torch
from datetime import timedelta
from pathlib import Path
from pinned_backend.parallel.group import connect
group = connect(Path(sys.argv[1]), 1, 2, torch.device("cpu"), timedelta(seconds=5))
print(group.broadcast(torch.zeros(1), idle=True).item(), flush=True)
os._exit(0)
"""


def test_a_rank_waits_for_the_next_step_past_the_groups_timeout(tmp_path: Path) -> None:
    # A server may idle for hours: the group's timeout bounds each collective, never a rank's wait for the next
    # step, which would otherwise end every other rank once the server had been idle that long.
    store = tmp_path / "store"
    command = [sys.executable, "-c", IDLE_RANK, str(store)]
    other = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group = connect(store, 0, 2, torch.device("cpu"), timedelta(seconds=5))
        time.sleep(8)  # idle past the group's timeout
        group.broadcast(torch.tensor([7.0]))
        out, err = other.communicate(timeout=60)
        group.close()
    finally:
        other.kill()
    assert out.strip() == "7.0", err[-2000:]
