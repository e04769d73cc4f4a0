"""Specification of the tokenizer wrapper: tokenizer.json, the chat template, special tokens and EOS ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pinned_backend.checkpoint import CheckpointError
from pinned_backend.tokenizer import ChatTemplateError, Tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEXT = ["the cat sat on the mat", "a dog ran in the park", "hello there, how are you today?"] * 10


def write_tokenizer(folder: Path, config: dict[str, Any] | None, *, with_bos: bool = False) -> RawTokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(TEXT, trainer)
    if with_bos:  # as Llama 3's tokenizer.json does: the post-processor puts a BOS in front
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return raw


def load(tmp_path: Path, template: Any = CHATML, **config: Any) -> Tokenizer:
    write_tokenizer(tmp_path, {"eos_token": "<|im_end|>", "chat_template": template, **config})
    return Tokenizer.from_pretrained(tmp_path)


def test_encode_and_decode_round_trip_bytes_of_any_text(tmp_path: Path) -> None:
    tokenizer = load(tmp_path)
    for text in ("the cat sat", "naïve café — 猫 🐈", "  spaces\n\ttabs "):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_in_text_become_their_ids_and_decode_can_skip_them(tmp_path: Path) -> None:
    tokenizer = load(tmp_path)
    ids = tokenizer.encode("<|im_start|>user")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids) == "user"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


def test_chat_template_renders_messages_and_the_generation_prompt(tmp_path: Path) -> None:
    tokenizer = load(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_encode_chat_adds_no_second_bos_when_the_template_writes_one(tmp_path: Path) -> None:
    write_tokenizer(
        tmp_path,
        {"bos_token": "<s>", "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        with_bos=True,
    )
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("hi")[0] == 0, "plain encoding keeps the post-processor's BOS"
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert ids.count(0) == 1 and ids[0] == 0


def test_a_template_asking_for_the_date_gets_its_fixed_default(tmp_path: Path) -> None:
    template = (
        '{% if strftime_now is defined %}{{ strftime_now("%d %b %Y") }}{% else %}26 Jul 2024{% endif %}'
    )
    assert load(tmp_path, template).apply_chat_template([]) == "26 Jul 2024"


def test_tojson_keeps_html_characters_and_non_ascii(tmp_path: Path) -> None:
    tokenizer = load(tmp_path, "{{ messages[0]['content'] | tojson }}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == '"<b>é</b>"'


def test_raise_exception_in_the_template_is_a_chat_template_error(tmp_path: Path) -> None:
    tokenizer = load(
        tmp_path, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_the_template_runs_sandboxed(tmp_path: Path) -> None:
    tokenizer = load(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_messages_without_a_role_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be an object with a string 'role'"):
        load(tmp_path).apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])


def test_a_model_without_chat_template_says_so(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, None)
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_named_template_list_uses_the_default_entry(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert load(tmp_path, templates).apply_chat_template([]) == "plain"


def test_eos_ids_join_the_eos_token_and_generation_config(tmp_path: Path) -> None:
    raw = write_tokenizer(tmp_path, {"eos_token": {"content": "<|im_end|>", "special": True}})
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [raw.token_to_id("<|endoftext|>")]})
    )
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.eos_token_ids == {raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"tokenizer.json": "{broken"}, r"tokenizer\.json: not a valid tokenizer file"),
        ({"tokenizer_config.json": "[1]"}, r"tokenizer_config\.json: expected a JSON object"),
        (
            {"tokenizer_config.json": '{"eos_token": "<nope>"}'},
            r"eos_token '<nope>' is not in tokenizer\.json",
        ),
        ({"generation_config.json": '{"eos_token_id": 100000}'}, r"eos_token_id 100000 is not a token id"),
        ({"tokenizer_config.json": '{"chat_template": "{% if %}"}'}, "chat_template is not valid jinja2"),
    ],
)
def test_malformed_files_are_errors_naming_the_file(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    write_tokenizer(tmp_path, {})
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_tokenizer_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        Tokenizer.from_pretrained(tmp_path)


def test_templates_may_use_the_jinja_features_real_chat_templates_use(tmp_path: Path) -> None:
    # namespace(), loop controls, reversed loops, `is string`, string methods and attribute access on dicts,
    # all of which Qwen3's and Llama 3's templates rely on.
    template = (
        "{% set ns = namespace(last_user=-1) %}"
        "{% for m in messages[::-1] %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% break %}"
        "{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.content is string %}"
        "{{ m.role }}={{ m.content.split('</think>')[-1].lstrip('\\n') | trim }};"
        "{% endif %}{% if loop.last %}[{{ ns.last_user }}]{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x</think>\n b "}]
    assert load(tmp_path, template).apply_chat_template(messages) == "user=a;assistant=b;[1]"
