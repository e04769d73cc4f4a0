"""Specification of programmatic dependent launch (pinned_backend/kernels/triton/dependent_launch.py, switched by
a kernel set's `Launches`): kernels on a CUDA device of compute capability 9.0 or later may start while the kernel
before them finishes, and that changes no request's bits."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from pinned_backend.kernels.triton.launches import Launches
from pinned_backend.step_graphs import DEFAULT_MAX_GRAPHS
from tests.support.backend_checkpoint import make_engine, write_random_checkpoint
from tests.test_step_graphs import _serve_all


def test_a_cpu_never_launches_dependents_and_a_gpu_only_where_it_can() -> None:
    assert Launches(dependent_launch=True).dependent(torch.device("cpu")) is False
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    triton_runs = importlib.util.find_spec("triton") is not None and not os.environ.get("TRITON_INTERPRET")
    assert Launches().dependent(torch.device("cuda")) is (hopper and triton_runs)
    assert Launches(dependent_launch=False).dependent(torch.device("cuda")) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_requests_get_the_same_bits_with_dependent_launch_as_without(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    checkpoint = write_random_checkpoint(tmp_path / "random-qwen3")
    sizes = {
        "max_batch_size": 7,
        "max_step_tokens": 12,
        "num_blocks": 64,
        "block_size": 16,
        "kv_split_size": 64,
    }
    on_gpu = {"device": torch.device("cuda"), "dtype": torch.bfloat16}
    one_after_another = _serve_all(make_engine(checkpoint, **sizes, **on_gpu, dependent_launch=False), seed=5)
    eager = _serve_all(make_engine(checkpoint, **sizes, **on_gpu), seed=5)
    graphed = _serve_all(make_engine(checkpoint, **sizes, **on_gpu, step_graphs=DEFAULT_MAX_GRAPHS), seed=5)
    assert eager == one_after_another
    assert graphed == one_after_another
