"""The tokenizer a GGUF file describes, built with the `tokenizers` library from the file's metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, each token's type, the special
token ids, the chat template and the name of a pre-tokenizer (`tokenizer.ggml.pre`), whose regular expressions
live in llama.cpp's source. This module maps each supported name to the same splits as `tokenizers` objects (the
expressions are those of the models' own tokenizer.json files, which llama.cpp transcribes), so the text is cut
where the merges were learned; an unknown name is an error rather than a guess, since a wrong split gives other ids
for the same text. Byte-level BPE (`tokenizer.ggml.model` `gpt2`, which Llama 3, Qwen and SmolLM use) is
supported; SentencePiece vocabularies (`llama`, as Llama 2 and Mistral files have) are not. Encoding, decoding and
the chat template are the `Tokenizer` wrapper's (tokenizer.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RawTokenizer

from pinned_backend.checkpoint import CheckpointError
from pinned_backend.tokenizer import Tokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_DIGIT = r"\p{N}"
# `tokenizer.ggml.pre` -> the expressions applied in turn (each splits what the one before left), and whether a
# word that is itself in the vocabulary skips the merges (Llama 3's `ignore_merges`).
PRE_TOKENIZERS: Mapping[str, tuple[tuple[str, ...], bool]] = {
    "gpt-2": ((_GPT2,), False),
    "smollm": ((_DIGIT, _GPT2), False),
    "starcoder": ((_DIGIT, _GPT2), False),
    "refact": ((_DIGIT, _GPT2), False),
    "llama3": ((_LLAMA3,), True),
    "llama-v3": ((_LLAMA3,), True),
    "llama-bpe": ((_LLAMA3,), True),
    "qwen2": ((_QWEN2,), False),
    "deepseek-r1-qwen": ((_QWEN2,), False),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types; 1 is a normal token, 6 a byte
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def tokenizer_from_gguf(fields: Mapping[str, Any], where: str) -> Tokenizer:
    """The tokenizer described by a GGUF's metadata (`fields`: key -> value); errors name `where`."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{where}: tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    pre = fields.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens = _strings(fields, "tokenizer.ggml.tokens", where)
    merges = [_merge(line, where) for line in _strings(fields, "tokenizer.ggml.merges", where)]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    splits, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    raw = RawTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    raw.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) are special: matched whole, dropped when decoding skips specials; user-defined
    # ones (<think>) are matched whole and kept.
    raw.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    raw.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    bos = _token(fields, "tokenizer.ggml.bos_token_id", tokens, where)
    eos_ids = {_id(fields, key, len(tokens), where) for key in _EOS_KEYS if key in fields}
    eos = _token(fields, "tokenizer.ggml.eos_token_id", tokens, where)
    add_bos = fields.get("tokenizer.ggml.add_bos_token", ignore_merges)  # llama.cpp's default for Llama 3
    add_eos = fields.get("tokenizer.ggml.add_eos_token", False)
    _set_post_processor(raw, bos if add_bos else None, eos if add_eos else None, vocab, where)
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{where}: tokenizer.chat_template must be a string")
    return Tokenizer(raw, template, bos, eos, frozenset(eos_ids), where=f"{where} (tokenizer.chat_template)")


def _strings(fields: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = fields.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where}: {key} must be a non-empty array of strings")
    return value


def _merge(line: str, where: str) -> tuple[str, str]:
    parts = line.split(" ")
    if len(parts) != 2 or not all(parts):
        raise CheckpointError(f"{where}: tokenizer.ggml.merges entry {line!r} is not two tokens and a space")
    return parts[0], parts[1]


def _id(fields: Mapping[str, Any], key: str, vocab_size: int, where: str) -> int:
    value = fields[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise CheckpointError(f"{where}: {key} {value!r} is not a token id below {vocab_size}")
    return value


def _token(fields: Mapping[str, Any], key: str, tokens: list[str], where: str) -> str | None:
    return tokens[_id(fields, key, len(tokens), where)] if key in fields else None


def _set_post_processor(
    raw: RawTokenizer, bos: str | None, eos: str | None, vocab: dict[str, int], where: str
) -> None:
    if bos is None and eos is None:
        return
    for name, token in (("bos", bos), ("eos", eos)):
        if token is not None and token not in vocab:
            raise CheckpointError(f"{where}: the {name} token {token!r} is not in the vocabulary")
    single = " ".join(t for t in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if t)
    pair = " ".join(t for t in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if t)
    specials = [(t, vocab[t]) for t in dict.fromkeys(t for t in (bos, eos) if t is not None)]
    raw.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
