"""The GGUF loader against a reference nobody here wrote: Hugging Face transformers loading SmolLM2-135M-Instruct's
GGUF file itself (`from_pretrained(..., gguf_file=...)`, which dequantises with the same gguf package and builds
its own tokenizer), on the CPU in float32.

Both sides load once per module (transformers takes about half a minute); the prompts go through stackpin's model
in one batched step per kernel mode, so the comparison costs little more than the loading.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pinned_backend.kvcache import PagedKVCache
from pinned_backend.runtime import BackendSettings, Runtime, load_runtime
from pinned_backend.sampling import SamplingParams
from tests.support.backend_checkpoint import Collector

transformers = pytest.importorskip("transformers")  # a test dependency; the dev extra installs it

CPU = torch.device("cpu")
MODES = ("default", "batch_invariant")
CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "In 2024 the population was 8,118,835,999; pi is 3.14159265 and e is 2.71828.",
    "naïve café, crème brûlée, Straße, ΑΒΓ, Москва, 東京, 서울, हिन्दी, العربية 🐈‍⬛🚀",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "   leading spaces\tand\ttabs\n\n\nand newlines   \r\n  ",
    "I'm sure they'll say we've done what you'd've done; isn't it?",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "URL: https://example.com/a?b=c&d=e#f, email: someone@example.org, path C:\\Users\\x",
    "ALL CAPS, MiXeD CaSe, snake_case, camelCase, kebab-case, 12ab34cd",
    '{"key": [1, 2.5, null, true], "nested": {"x": "y"}}',
    "…“quoted”—dash–en ‘single’ «guillemets» ¿qué? ¡sí!",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about numbers like 42."},
    ],
    [{"role": "user", "content": "Écris une phrase en français."}],
]
TOPICS = [
    "the sea", "gravity", "a lighthouse", "bread", "the moon", "volcanoes", "chess", "honey bees", "rain",
    "the Roman empire", "prime numbers", "owls", "glaciers", "jazz", "the internet", "coffee",
]  # fmt: skip


def prompts(tokenizer: Any) -> list[list[int]]:
    """32 short prompts, half chat turns and half plain text: the comparison needs many, not long ones."""
    brief = {"role": "system", "content": "Be brief."}
    chats = [tokenizer.encode_chat([brief, {"role": "user", "content": f"About {t}?"}]) for t in TOPICS]
    plain = [tokenizer.encode(f"Three facts about {topic}: 1.") for topic in TOPICS]
    return chats + plain


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Both sides on one CPU thread: the comparison needs no parallel GEMM, and on a busy machine a second thread
    mostly waits at barriers for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> tuple[Any, Any]:
    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path) -> dict[str, Runtime]:
    return {
        mode: load_runtime(BackendSettings(model=smollm2_gguf, kernel_mode=mode, dtype="fp32", threads=1))  # type: ignore[arg-type]
        for mode in MODES
    }


def last_logits(runtime: Runtime, batch: Sequence[Sequence[int]]) -> torch.Tensor:
    """Every prompt's last-position logits from one prefill step of the whole batch. [P, vocab]"""
    model, block = runtime.engine.model, 16
    widths = [-(-len(ids) // block) for ids in batch]
    cache = PagedKVCache(model.config, sum(widths), block, CPU, torch.float32)
    tables = torch.zeros(len(batch), max(widths), dtype=torch.int32)
    start = 0
    for s, width in enumerate(widths):
        tables[s, :width] = torch.arange(start, start + width)
        start += width
    seq = torch.cat([torch.full((len(ids),), s, dtype=torch.int32) for s, ids in enumerate(batch)])
    pos = torch.cat([torch.arange(len(ids), dtype=torch.int32) for ids in batch])
    rows = torch.cumsum(torch.tensor([len(ids) for ids in batch]), 0) - 1
    tokens = torch.tensor([t for ids in batch for t in ids])
    return model.forward(tokens, seq, pos, tables, cache, rows)


def greedy(runtime: Runtime, batch: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    engine, sinks = runtime.engine, []
    for i, ids in enumerate(batch):
        sinks.append(Collector())
        engine.submit(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=max_tokens), sinks[-1])
    while not all(sink.done.is_set() for sink in sinks):
        engine.step()
    return [sink.tokens for sink in sinks]


def _until_eos(ids: list[int], eos: int) -> list[int]:
    """A continuation up to and including its EOS (a batch's finished rows are padded with more of it)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_the_tokenizers_agree_id_for_id(reference: tuple[Any, Any], ours: dict[str, Runtime]) -> None:
    theirs, mine = reference[0], ours["default"].tokenizer
    for text in CORPUS:
        assert mine.encode(text) == theirs(text)["input_ids"], text
        assert mine.decode(mine.encode(text)) == theirs.decode(
            theirs(text)["input_ids"], skip_special_tokens=True
        )
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert mine.apply_chat_template(messages) == text
        assert mine.encode_chat(messages) == theirs(text, add_special_tokens=False)["input_ids"]
    assert mine.eos_token_ids == {theirs.eos_token_id}


def test_last_position_logits_agree_within_float32_tolerance(
    reference: tuple[Any, Any], ours: dict[str, Runtime]
) -> None:
    batch = prompts(ours["default"].tokenizer)
    assert len(batch) >= 32
    # Padded on the right, every prompt in one forward: a causal model's real positions never see the padding.
    lengths = torch.tensor([len(ids) for ids in batch])
    padded = torch.zeros(len(batch), int(lengths.max()), dtype=torch.int64)
    for row, ids in enumerate(batch):
        padded[row, : len(ids)] = torch.tensor(ids)
    with torch.inference_mode():
        expected = reference[1](padded).logits[torch.arange(len(batch)), lengths - 1]
    for mode, runtime in ours.items():
        logits = last_logits(runtime, batch)
        torch.testing.assert_close(
            logits, expected, atol=2e-4, rtol=1e-4, msg=lambda m, mode=mode: f"{mode}: {m}"
        )
        assert torch.equal(logits.argmax(-1), expected.argmax(-1)), mode


def test_greedy_continuations_are_identical(reference: tuple[Any, Any], ours: dict[str, Runtime]) -> None:
    tokenizer, model = reference
    batch = [ours["default"].tokenizer.encode_chat(messages) for messages in CONVERSATIONS]
    # Padded on the left, as generate() expects; the attention mask keeps the padding out of every answer.
    width = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id
    padded = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    with torch.inference_mode():
        out = model.generate(
            padded,
            attention_mask=mask,
            max_new_tokens=32,
            do_sample=False,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
    expected = [_until_eos(row[width:].tolist(), tokenizer.eos_token_id) for row in out]
    for mode, runtime in ours.items():
        assert greedy(runtime, batch, 32) == expected, (
            f"{mode}: the greedy continuations differ from transformers'"
        )
    assert "Paris" in tokenizer.decode(expected[0])
