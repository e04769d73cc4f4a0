"""Specification of gpt-oss's chat format as the backend reads answers in it (pinned_backend.harmony): an answer's
text is its final channel's, growing only by extension as tokens arrive, and a harmony checkpoint's runtime decodes
its answers so."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from pinned_backend.harmony import answer_text, final_text, is_harmony, messages
from pinned_backend.runtime import BackendSettings, load_runtime
from tests.support.family_checkpoints import write_family_checkpoint

SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
ANSWER = [
    "<|channel|>", "analysis", "<|message|>", "The user greets. Reply briefly.", "<|end|>",
    "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hello! How can I help?", "<|return|>",
]  # fmt: skip
CALL = [
    "<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>",
    '{"city": "Paris"}', "<|call|>",
]  # fmt: skip
# A template in the shape of gpt-oss's: enough for the backend to know the format.
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}{# <|channel|>final #}"
)


def test_an_answers_text_is_its_final_channel() -> None:
    found = messages("".join(ANSWER))
    assert [(m.channel, m.ended) for m in found] == [("analysis", True), ("final", True)]
    assert final_text("".join(ANSWER)) == "Hello! How can I help?"
    call = messages("".join(CALL))
    assert [(m.channel, m.recipient, m.text) for m in call] == [
        ("commentary", "functions.get_weather", '{"city": "Paris"}')
    ]
    assert final_text("".join(CALL)) == ""


def test_the_text_grows_only_by_extension_as_the_answer_arrives() -> None:
    # Special tokens arrive whole; other text may arrive a character at a time.
    prefixes = [
        "".join(ANSWER[:i]) + (piece[:j] if piece not in SPECIALS else "")
        for i, piece in enumerate(ANSWER)
        for j in range(len(piece) + 1)
    ]
    shown = ""
    for prefix in [*prefixes, "".join(ANSWER)]:
        now = final_text(prefix)
        assert now.startswith(shown), f"the text shrank at {prefix!r}"
        shown = now
    assert shown == "Hello! How can I help?"


def write_harmony_tokenizer(folder: Path) -> list[int]:
    """A character tokenizer with harmony's special tokens and a harmony template; the ids of ANSWER."""
    chars = sorted({c for piece in ANSWER + CALL if piece not in SPECIALS for c in piece})
    vocab = {token: i for i, token in enumerate(["<unk>", *SPECIALS, *chars])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return [i for p in ANSWER for i in ([vocab[p]] if p in SPECIALS else [vocab[c] for c in p])]


def test_a_harmony_checkpoints_runtime_answers_with_the_final_channel(tmp_path: Path) -> None:
    folder = write_family_checkpoint(tmp_path / "gpt-oss", "gpt_oss")
    ids = write_harmony_tokenizer(folder)
    runtime = load_runtime(BackendSettings(model=folder, kv_cache_mb=1))
    assert is_harmony(runtime.tokenizer.chat_template)
    assert runtime.engine.detokenize(ids) == "Hello! How can I help?"
    plain = answer_text(runtime.tokenizer.decode)
    assert plain(ids[3:7]) == runtime.tokenizer.decode(ids[3:7])  # no channel marker: decoded as it is
    assert runtime.tokenizer.eos_token_ids == {ids[-1]}  # <|return|> ends the answer
