"""Text to token ids and back, and chat messages to a prompt, as the checkpoint defines them.

Reads `tokenizer.json` through the `tokenizers` library, the chat template and special tokens from
`tokenizer_config.json`, and the end-of-sequence ids from both that file and `generation_config.json`. The chat
template is rendered in a sandboxed jinja2 environment with the settings Hugging Face uses (trim_blocks,
lstrip_blocks, loop controls, a `tojson` that does not escape HTML, `raise_exception`). A GGUF file's tokenizer is
built by gguf_tokenizer.py and wrapped here the same way. `strftime_now` is
deliberately not provided: a template that asks for today's date then falls back to its fixed default, so the
same messages always render to the same prompt. This module knows nothing of models, sampling or HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import tokenizers

from pinned_backend.checkpoint import CheckpointError, read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no template, malformed messages, or the template refused them."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores a special token either as its text or as a serialised AddedToken object.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _pick_template(raw: Any, where: str) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    # Newer configs hold a list of named templates; the one named "default" is the chat template.
    if isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str):
                    return template
    raise CheckpointError(f"{where}: 'chat_template' must be a string or a list with a 'default' entry")


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: frozenset[int],
        where: str = TOKENIZER_CONFIG_FILE,
    ) -> None:
        """`where` names the file (or the part of it) that holds the chat template, for error messages."""
        self._tokenizer = tokenizer
        self._where = where
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = eos_token_ids
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self._template: jinja2.Template | None = None
        # Whether the template renders tool definitions itself (it reads a `tools` variable, as Qwen3's does).
        self.takes_tools = False
        if chat_template is not None:
            try:
                self._template = env.from_string(chat_template)
                self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"{where}: chat_template is not valid jinja2: {exc}") from None

    @classmethod
    def from_pretrained(cls, folder: Path) -> Tokenizer:
        folder = Path(folder)
        tokenizer_path = folder / TOKENIZER_FILE
        if not tokenizer_path.exists():
            raise CheckpointError(f"{tokenizer_path}: file not found")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise CheckpointError(f"{tokenizer_path}: not a valid tokenizer file: {exc}") from None

        config_path = folder / TOKENIZER_CONFIG_FILE
        config = read_json(config_path) if config_path.exists() else {}
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object at the top level")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos_ids: set[int] = set()
        if eos is not None:
            eos_id = tokenizer.token_to_id(eos)
            if eos_id is None:
                raise CheckpointError(f"{config_path}: eos_token {eos!r} is not in {TOKENIZER_FILE}")
            eos_ids.add(eos_id)
        eos_ids.update(_generation_eos_ids(folder / GENERATION_CONFIG_FILE, tokenizer.get_vocab_size()))
        template = _pick_template(config.get("chat_template"), str(config_path))
        return cls(tokenizer, template, bos, eos, frozenset(eos_ids))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds (a BOS)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def serialized(self) -> str:
        """The `tokenizers` library's JSON of this tokenizer (vocabulary, merges, pre-tokenizer, decoder)."""
        return self._tokenizer.to_str()

    def is_added_token(self, text: str) -> bool:
        """Whether `text` is a token added to the vocabulary (special or not), as a chat format's tags often are."""
        return any(token.content == text for token in self._tokenizer.get_added_tokens_decoder().values())

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` (`{"role": ..., "content": ...}` dicts); `extra` reaches the template."""
        if self._template is None:
            raise ChatTemplateError(f"this model's {self._where} has no chat_template")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]], **extra: Any) -> list[int]:
        # The template writes any BOS itself, so the post-processor must not add a second one.
        return self.encode(self.apply_chat_template(messages, **extra), add_special_tokens=False)


def _generation_eos_ids(path: Path, vocab_size: int) -> set[int]:
    if not path.exists():
        return set()
    config = read_json(path)
    raw = config.get("eos_token_id") if isinstance(config, dict) else None
    if raw is None:
        return set()
    ids = raw if isinstance(raw, list) else [raw]
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise CheckpointError(f"{path}: eos_token_id {value!r} is not a token id below {vocab_size}")
    return set(ids)
