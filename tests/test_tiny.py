"""Specification of stackpin-tiny: a real-format checkpoint, byte-identical on every run, whose greedy output
reads as English words."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pinned_backend.checkpoint import load_config, weights_sha256
from pinned_backend.kernels import select_kernels
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer
from pinned_backend.tiny import TINY_NAME, corpus_text, ensure_tiny
from pinned_backend.tokenizer import Tokenizer

CPU = torch.device("cpu")
FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
MAKE = "import sys; from pathlib import Path; from pinned_backend.tiny import make_tiny; make_tiny(Path(sys.argv[1]))"


@pytest.fixture(scope="module")
def two_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # The session's tiny model was made in this process; the second run is a process of its own, sharing nothing.
    parent = tmp_path_factory.mktemp("second")
    assert subprocess.run([sys.executable, "-c", MAKE, str(parent)]).returncode == 0, "make_tiny failed"
    return tiny_model, parent / TINY_NAME


def test_two_runs_write_byte_identical_files(two_runs: tuple[Path, Path]) -> None:
    first, second = two_runs
    assert sorted(p.name for p in first.iterdir()) == FILES
    assert sorted(p.name for p in second.iterdir()) == FILES
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs between two runs"
    assert weights_sha256(first) == weights_sha256(second)


def test_only_the_finished_folder_is_left_behind(two_runs: tuple[Path, Path]) -> None:
    assert [p.name for p in two_runs[0].parent.iterdir()] == [TINY_NAME]


def test_ensure_tiny_keeps_a_finished_folder(two_runs: tuple[Path, Path]) -> None:
    folder = two_runs[1]
    before = {name: (folder / name).stat().st_mtime_ns for name in FILES}
    assert ensure_tiny(folder.parent) == folder
    assert {name: (folder / name).stat().st_mtime_ns for name in FILES} == before


def test_it_is_a_small_qwen3_checkpoint_with_a_chatml_tokenizer(two_runs: tuple[Path, Path]) -> None:
    folder = two_runs[0]
    assert folder.name == "stackpin-tiny"
    assert sum(p.stat().st_size for p in folder.iterdir()) < 5_000_000
    config = load_config(folder)
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token_ids == {
        tokenizer.token_to_id("<|im_end|>"),
        tokenizer.token_to_id("<|endoftext|>"),
    }


def greedy(model: Transformer, prompt: list[int], count: int) -> list[int]:
    cache = PagedKVCache(model.config, 16, 16, CPU, model.dtype)
    tables = torch.arange(16, dtype=torch.int32)[None]
    ids, out = prompt, []
    for _ in range(count):
        start = len(prompt) + len(out) - len(ids)
        seq = torch.zeros(len(ids), dtype=torch.int32)
        pos = torch.arange(start, start + len(ids), dtype=torch.int32)
        logits = model.forward(torch.tensor(ids), seq, pos, tables, cache, torch.tensor([len(ids) - 1]))
        ids = [int(logits[0].argmax())]
        out += ids
    return out


def test_greedy_output_reads_as_words(two_runs: tuple[Path, Path]) -> None:
    folder = two_runs[0]
    model = Transformer.from_pretrained(folder, select_kernels("batch_invariant", CPU), CPU, torch.float32)
    tokenizer = Tokenizer.from_pretrained(folder)
    known = set(re.findall(r"[a-z]+", corpus_text().lower()))
    for prompt in ("The children", "In the morning"):
        text = tokenizer.decode(greedy(model, tokenizer.encode(prompt), 40))
        words = re.findall(r"[a-z]+", text.lower())
        assert len(words) >= 10, f"too few words after {prompt!r}: {text!r}"
        real = sum(word in known for word in words) / len(words)
        assert real >= 0.7, f"only {real:.0%} of the words after {prompt!r} are English: {text!r}"
