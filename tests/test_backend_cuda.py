"""Specification of `stackpin-backend serve --device cuda`: the real command, on loopback, on a GPU.

It starts on the GPU in either kernel mode, describes the GPU it serves on in its stack, and in `batch_invariant`
mode gives one request the same tokens and logprob bits alone and amid concurrent others, on random weights and on
SmolLM2-135M-Instruct's GGUF file (dequantised to bf16). Needs CUDA and Triton; skipped cleanly without them.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.backend_checkpoint import write_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("cuda") / "random-qwen3", with_tokenizer=True)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)  # type: ignore[no-any-return]


@contextlib.contextmanager
def serving(model: Path, mode: str, tmp_path: Path, *extra: str) -> Iterator[str]:
    """`stackpin-backend serve --device cuda` on `model` (a folder or a GGUF file), yielding its URL."""
    pytest.importorskip("triton")
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    args = ["serve", "--model", str(model), "--port", "0", "--ready-file", str(ready)]
    args += ["--device", "cuda", "--dtype", "bf16", "--kernel-mode", mode, "--kv-cache-mb", "16", *extra]
    process = subprocess.Popen(
        [sys.executable, "-m", "pinned_backend.cli", *args],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert process.poll() is None, f"the server exited early: {process.stderr.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the server never wrote its ready file"
            time.sleep(0.2)
        yield ready.read_text().strip()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        process.stderr.close()  # type: ignore[union-attr]


@pytest.fixture(params=["batch_invariant", "default"])
def server(request: pytest.FixtureRequest, checkpoint: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    with serving(checkpoint, request.param, tmp_path) as url:
        yield url, request.param


def test_serve_on_cuda_describes_the_gpu_in_its_stack(server: tuple[str, str]) -> None:
    url, mode = server
    with urllib.request.urlopen(f"{url}/v1/stack", timeout=30) as response:
        described = json.load(response)
    stack = described.get("stack", described)
    name = torch.cuda.get_device_name(0)
    assert stack["hardware"] == "-".join(name.lower().split())
    assert stack["hardware_detail"]["name"] == name
    assert stack["kernel_mode"] == mode
    assert stack["software"]["cuda"] == torch.version.cuda
    assert stack["software"]["driver"]
    if mode == "batch_invariant":
        # The plan file the matmuls take (or null: the rule for every weight), by name and digest.
        from pinned_backend.kernels.triton import plan_files

        named = stack["hardware_detail"]["matmul_plans"]
        shipped = {f.name: f.sha256 for f in plan_files.shipped()}
        assert named is None or shipped[named["name"]] == named["sha256"]
    else:
        assert "matmul_plans" not in stack["hardware_detail"]


def test_matmul_plans_tuned_at_the_first_load_are_named_in_the_stack_and_taken_at_the_next(
    checkpoint: Path, tmp_path: Path
) -> None:
    # The random checkpoint's shapes are in no shipped plan file: the first start tunes them.
    cache = tmp_path / "plans"
    named = []
    for _ in range(2):
        started = time.monotonic()
        with serving(
            checkpoint, "batch_invariant", tmp_path, "--matmul-plans", "tune", "--plan-cache", str(cache)
        ) as url:
            with urllib.request.urlopen(f"{url}/v1/stack", timeout=30) as response:
                described = json.load(response)
            answer = _post(f"{url}/v1/completions", {"prompt": "stackpin", "max_tokens": 8, "temperature": 0})
        named.append(
            (
                described.get("stack", described)["hardware_detail"]["matmul_plans"],
                answer,
                time.monotonic() - started,
            )
        )
    [kept] = cache.iterdir()
    from pinned_backend.kernels.triton.plan_files import load

    assert named[0][0] == named[1][0] == load(kept).described()
    assert named[0][1]["stackpin"]["token_ids"] == named[1][1]["stackpin"]["token_ids"]
    assert named[0][1]["stackpin"]["token_logprobs"] == named[1][1]["stackpin"]["token_logprobs"]
    print(f"first start {named[0][2]:.1f} s, second {named[1][2]:.1f} s")


def test_batch_invariant_on_cuda_answers_alike_alone_and_amid_others(server: tuple[str, str]) -> None:
    url, mode = server
    if mode != "batch_invariant":
        pytest.skip("only batch_invariant mode promises this")
    assert_alike_alone_and_amid_others(url, {"prompt": "stackpin on a GPU", "max_tokens": 12})


def assert_alike_alone_and_amid_others(url: str, request: dict[str, Any]) -> dict[str, Any]:
    """The same greedy request alone and four times amid twelve sampled others: one set of bits."""
    body = {**request, "temperature": 0, "logprobs": 3}
    alone = _post(f"{url}/v1/completions", body)
    others = [
        {"prompt": "x" * (5 + 13 * i), "max_tokens": 4 + i, "temperature": 0.7, "seed": i} for i in range(12)
    ]
    with ThreadPoolExecutor(max_workers=16) as pool:
        loaded = [pool.submit(_post, f"{url}/v1/completions", body) for _ in range(4)]
        loaded += [pool.submit(_post, f"{url}/v1/completions", other) for other in others]
        answers = [future.result() for future in loaded[:4]]

    def bits(answer: dict[str, Any]) -> Any:
        choice = answer["choices"][0]
        return answer["stackpin"]["token_ids"], json.dumps(choice["logprobs"]), choice["text"]

    assert all(bits(answer) == bits(alone) for answer in answers)
    return alone


def test_a_gguf_served_on_cuda_answers_sensibly_and_alike_alone_and_amid_others(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    with serving(smollm2_gguf, "batch_invariant", tmp_path) as url:
        with urllib.request.urlopen(f"{url}/v1/stack", timeout=30) as response:
            stack = json.load(response)
        stack = stack.get("stack", stack)
        assert stack["quantisation"] == "gguf:Q4_1+Q8_0+F32->bf16"
        prompt = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
        answer = assert_alike_alone_and_amid_others(
            url, {"prompt": prompt + "<|im_start|>assistant\n", "max_tokens": 16}
        )
    assert "Paris" in answer["choices"][0]["text"]
