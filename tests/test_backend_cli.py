"""Specification of `stackpin-backend`: flags, one-line errors and exit codes, the ready file, a clean stop.

Argument errors are checked in process; serving runs the real command in a subprocess on loopback.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pinned_backend.cli import main
from tests.support.backend_checkpoint import write_random_checkpoint
from tests.support.gguf_files import write_small_gguf

CLI = [sys.executable, "-m", "pinned_backend.cli"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("cli") / "random-qwen3", with_tokenizer=True)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((), "required: command"),
        (("serve",), "--model"),
        (("serve", "--model", "/nonexistent"), "is not a directory (nor a .gguf file)"),
        (("serve", "--model", "/nonexistent.gguf"), "/nonexistent.gguf: file not found"),
        (("serve", "--model", ".", "--kernel-mode", "fast"), "invalid choice: 'fast'"),
        (("serve", "--model", ".", "--port", "70000"), "--port"),
        (("serve", "--model", ".", "--max-batch-size", "64", "--max-step-tokens", "8"), "max_step_tokens"),
        (("serve", "--model", ".", "--device", "cuda", "--dtype", "fp32"), "choose --dtype bf16"),
        (("serve", "--model", ".", "--kv-split-size", "100"), "--kv-split-size 100 must be a multiple of"),
        (("serve", "--model", ".", "--device", "cuda", "--kv-split-size", "96"), "choose a multiple of 64"),
        (("serve", "--model", ".", "--max-step-graphs", "-1"), "--max-step-graphs: Input should be greater"),
        (("serve", "--model", ".", "--kv-cache-mb", "lots"), "--kv-cache-mb: 'lots' is neither auto nor"),
        (("serve", "--model", ".", "--kv-cache-mb", "0"), "--kv-cache-mb: Input should be greater than 0"),
        (("tune",), "--model"),
        (("tune", "--model", "/nonexistent"), "has no config.json"),
        (("tune", "--model", "bench/models/qwen3-8b", "--budget-s", "0"), "--budget-s must be positive"),
        (("tune", "--model", "bench/models/qwen3-8b", "--candidates", "few"), "invalid choice: 'few'"),
        (
            ("serve", "--model", ".", "--expert-capacity-factor", "0"),
            "--expert-capacity-factor: Input should be",
        ),
        (
            ("serve", "--model", ".", "--expert-overflow", "next_expert"),
            "applies only with --expert-capacity",
        ),
        (("serve", "--model", ".", "--expert-overflow", "drop"), "invalid choice: 'drop'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    args: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1
    assert words in stderr


def test_a_folder_without_a_tokenizer_exits_1_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_random_checkpoint(tmp_path / "no-tokenizer")
    assert main(["serve", "--model", str(folder), "--port", "0"]) == 1
    assert "tokenizer.json: file not found" in capsys.readouterr().err


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="on a GPU the tune runs (bench/gpu_run.sh tune)"
)
def test_tune_without_a_gpu_exits_1_saying_it_needs_one() -> None:
    done = run("tune", "--model", str(Path(__file__).parent.parent / "bench/models/qwen3-8b"))
    assert done.returncode == 1
    assert "tuning needs a CUDA GPU" in done.stderr


def test_a_gguf_of_an_unsupported_architecture_exits_1_naming_the_file_and_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_small_gguf(tmp_path / "gemma.gguf", architecture="gemma2")
    assert main(["serve", "--model", str(path), "--port", "0"]) == 1
    assert "gemma.gguf: architecture 'gemma2' is not supported" in capsys.readouterr().err


def test_serve_writes_its_url_to_the_ready_file_and_stops_cleanly(checkpoint: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    args = [
        "serve",
        "--model",
        str(checkpoint),
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--kv-cache-mb",
        "1",
    ]
    process = subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert process.poll() is None, f"the server exited early: {process.stderr.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the server never wrote its ready file"
            time.sleep(0.1)
        url = ready.read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as response:
            assert json.load(response)["status"] == "ok"
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps({"prompt": "ab", "max_tokens": 2, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert len(json.load(response)["stackpin"]["token_ids"]) == 2
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        process.stderr.close()  # type: ignore[union-attr]
