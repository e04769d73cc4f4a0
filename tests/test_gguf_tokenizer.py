"""Specification of the tokenizer built from a GGUF's metadata: the same ids as the tokenizer.json it was
converted from, text split as the named pre-tokenizer splits it, special tokens, BOS and EOS from the metadata,
and errors for what is not supported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer

from pinned_backend.checkpoint import CheckpointError, parse_config
from pinned_backend.gguf_checkpoint import open_gguf
from pinned_backend.gguf_tokenizer import tokenizer_from_gguf
from pinned_backend.tokenizer import ChatTemplateError, Tokenizer
from tests.support.gguf_files import write_gguf
from tests.test_gguf_checkpoint import SMALL, random_tensors
from tests.test_tokenizer import CHATML, SPECIALS

TEXT = [
    "the cat sat on the mat in 2024, at 10:45 and 3.14159",
    "a dog ran in the park; it's 12345 metres away, isn't it?",
    "naïve café — 猫 🐈\n\n\tindented  twice   and more",
] * 10
SAMPLES = [
    "the cat sat in 2024",
    "isn't it 12345?",
    "naïve café — 猫 🐈",
    "  spaces\n\ttabs \n\n",
    "<|im_start|>x",
]


def trained(pre_tokenizer: Any) -> RawTokenizer:
    """A byte-level BPE trained over `pre_tokenizer`'s splits, as a model's tokenizer.json would hold it."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizer
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(TEXT, trainer)
    return raw


def metadata(raw: RawTokenizer, pre: str, **extra: Any) -> dict[str, Any]:
    """The tokenizer keys llama.cpp's converter writes for `raw`."""
    vocab = sorted(raw.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab]
    model = json.loads(raw.to_str())["model"]  # the merges, in order, as the converter reads them
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if token in SPECIALS else 1 for token in tokens],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
        "tokenizer.ggml.eos_token_id": raw.token_to_id("<|im_end|>"),
        "tokenizer.chat_template": CHATML,
        **extra,
    }


GPT2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
# SmolLM's tokenizer.json: each digit alone, then GPT-2's splits.
SMOLLM = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), GPT2])
LLAMA3 = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(
            Regex(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
            behavior="isolated",
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
)


@pytest.mark.parametrize(
    ("pre", "original"),
    [("gpt-2", GPT2), ("smollm", SMOLLM), ("llama-bpe", LLAMA3)],
    ids=["gpt-2", "smollm", "llama3"],
)
def test_ids_are_those_of_the_tokenizer_json_the_file_was_converted_from(pre: str, original: Any) -> None:
    raw = trained(original)
    for special in SPECIALS:
        raw.add_special_tokens([special])
    tokenizer = tokenizer_from_gguf(metadata(raw, pre, **{"tokenizer.ggml.add_bos_token": False}), "m.gguf")
    for text in SAMPLES + TEXT[:3]:
        assert tokenizer.encode(text) == raw.encode(text).ids, text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_the_pre_tokenizer_decides_where_digits_split() -> None:
    raw = trained(GPT2)  # merges that join digits
    plain = tokenizer_from_gguf(metadata(raw, "gpt-2"), "m.gguf")
    digits = tokenizer_from_gguf(metadata(raw, "smollm"), "m.gguf")
    assert len(plain.encode("12345")) < 5, "GPT-2's splits keep a number whole for the merges"
    assert [plain.decode([i]) for i in digits.encode("12345")] == list("12345")


def test_control_tokens_are_special_and_the_eos_ids_come_from_the_metadata() -> None:
    raw = trained(GPT2)
    fields = metadata(raw, "gpt-2", **{"tokenizer.ggml.eot_token_id": raw.token_to_id("<|endoftext|>")})
    tokenizer = tokenizer_from_gguf(fields, "m.gguf")
    ids = tokenizer.encode("<|im_start|>user")
    assert ids[0] == raw.token_to_id("<|im_start|>"), "a control token is matched whole"
    assert tokenizer.decode(ids) == "user"
    assert tokenizer.eos_token_ids == {raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")}
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_chat_template_comes_from_the_metadata() -> None:
    tokenizer = tokenizer_from_gguf(metadata(trained(GPT2), "gpt-2"), "m.gguf")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    fields = metadata(trained(GPT2), "gpt-2")
    del fields["tokenizer.chat_template"]
    with pytest.raises(ChatTemplateError, match=r"m\.gguf \(tokenizer\.chat_template\) has no chat_template"):
        tokenizer_from_gguf(fields, "m.gguf").apply_chat_template([{"role": "user", "content": "x"}])


def test_add_bos_token_puts_the_bos_first_outside_chat() -> None:
    raw = trained(GPT2)
    bos = raw.token_to_id("<s>")
    tokenizer = tokenizer_from_gguf(
        metadata(raw, "gpt-2", **{"tokenizer.ggml.bos_token_id": bos, "tokenizer.ggml.add_bos_token": True}),
        "m.gguf",
    )
    assert tokenizer.encode("the cat")[0] == bos and tokenizer.bos_token == "<s>"
    assert tokenizer.encode("the cat", add_special_tokens=False)[0] != bos
    # Llama 3's pre-tokenizer adds a BOS unless the file says otherwise, as llama.cpp does.
    llama3 = tokenizer_from_gguf(metadata(raw, "llama-bpe", **{"tokenizer.ggml.bos_token_id": bos}), "m.gguf")
    assert llama3.encode("the cat")[0] == bos


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tokenizer.ggml.model": "llama"},
            r"tokenizer\.ggml\.model 'llama' is not supported; supported: 'gpt2'",
        ),
        (
            {"tokenizer.ggml.pre": "default"},
            r"tokenizer\.ggml\.pre 'default' is not supported; supported: gpt-2",
        ),
        ({"tokenizer.ggml.eos_token_id": 100000}, r"eos_token_id 100000 is not a token id below"),
        ({"tokenizer.ggml.token_type": [1, 1]}, r"token_type has 2 entries for \d+ tokens"),
        ({"tokenizer.ggml.merges": ["a b c"]}, r"merges entry 'a b c' is not two tokens"),
        ({"tokenizer.ggml.tokens": []}, r"tokenizer\.ggml\.tokens must be a non-empty array of strings"),
        ({"tokenizer.chat_template": "{% if %}"}, r"chat_template is not valid jinja2"),
    ],
)
def test_unsupported_or_malformed_metadata_is_an_error_naming_the_file(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as info:
        tokenizer_from_gguf({**metadata(trained(GPT2), "gpt-2"), **change}, "dir/m.gguf")
    assert "dir/m.gguf" in str(info.value)


def test_a_gguf_file_carries_its_tokenizer(tmp_path: Path) -> None:
    raw = trained(GPT2)
    for special in SPECIALS:
        raw.add_special_tokens([special])
    config = parse_config(SMALL["llama"])
    path = write_gguf(tmp_path / "m.gguf", "llama", config, random_tensors(config), tokenizer=raw)
    tokenizer = tokenizer_from_gguf(open_gguf(path).fields, str(path))
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.encode(SAMPLES[0]) == raw.encode(SAMPLES[0]).ids
