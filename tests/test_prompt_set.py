"""A study's prompt set: JSONL of chat or completions requests, or plain text, one prompt a line; defaults filled
in where a line leaves them out, and every mistake named by its line."""

from __future__ import annotations

import json

import pytest

from proxy.endpoints import CHAT, COMPLETIONS
from proxy.evidence.prompt_set import Defaults, PromptSetError, digest, read_prompt_set

DEFAULTS = Defaults(model="smollm2-135m-instruct", max_tokens=32)


def test_a_text_file_is_one_user_message_a_line_with_the_defaults_filled_in() -> None:
    prompts = read_prompt_set(
        "What is 2+2?\n\n# a comment\n  Name a colour.  \n", name="p.txt", defaults=DEFAULTS
    )
    assert [p.index for p in prompts] == [0, 1]
    assert prompts[1].endpoint == CHAT and prompts[1].label == "Name a colour."
    assert prompts[0].body == {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 32,
        "temperature": 0.0,
    }


def test_jsonl_lines_are_requests_sent_as_written_chat_or_completions() -> None:
    lines = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there"}],
         "max_tokens": 5, "seed": 3, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"model": "other", "prompt": "Once upon a time", "temperature": 0.7, "max_completion_tokens": 9},
    ]  # fmt: skip
    text = "\n".join(json.dumps(line) for line in lines)
    chat, completion = read_prompt_set(text, name="set.JSONL", defaults=DEFAULTS)
    assert chat.endpoint == CHAT and chat.label == "Hi there", "the last user message, on one line"
    assert chat.body == {"model": "smollm2-135m-instruct", **lines[0], "temperature": 0.0}
    assert completion.endpoint == COMPLETIONS and completion.body == lines[1], "nothing it set is replaced"


def test_a_long_prompt_is_labelled_by_its_start() -> None:
    (prompt,) = read_prompt_set("word " * 100, name="long.txt", defaults=DEFAULTS)
    assert len(prompt.label) == 80 and prompt.label.endswith("…")
    assert prompt.body["messages"][0]["content"] == ("word " * 100).strip()


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "line 2 is not JSON"),
        ("[1, 2]", "line 2 must be a JSON object"),
        ('{"max_tokens": 3}', "either 'messages'"),
        ('{"messages": [], "prompt": "x"}', "either 'messages'"),
        ('{"messages": [{"role": "user", "content": "x"}], "stream": true}', "leave 'stream' out"),
        ('{"prompt": "x", "stackpin": {"kernel_mode": "default"}}', "--pin and --compare"),
        ('{"messages": []}', "line 2: 'messages' must be a non-empty list"),
        ('{"prompt": "x", "temperature": NaN}', "NaN"),
        ('{"prompt": "x", "seed": 123456789012345678901}', "'seed'"),
    ],
)
def test_a_wrong_line_is_named(line: str, says: str) -> None:
    with pytest.raises(PromptSetError, match=None) as raised:
        read_prompt_set('{"prompt": "fine"}\n' + line, name="set.jsonl", defaults=DEFAULTS)
    assert says in str(raised.value) and "set.jsonl" in str(raised.value)


def test_an_empty_set_is_refused_and_the_digest_names_the_requests() -> None:
    with pytest.raises(PromptSetError, match="holds no prompt"):
        read_prompt_set("\n# only a comment\n", name="p.txt", defaults=DEFAULTS)
    a = read_prompt_set("one\ntwo", name="p.txt", defaults=DEFAULTS)
    assert digest(a) == digest(read_prompt_set("one\n\ntwo\n", name="q.txt", defaults=DEFAULTS))
    assert digest(a) != digest(read_prompt_set("two\none", name="p.txt", defaults=DEFAULTS))
    assert digest(a) != digest(read_prompt_set("one\ntwo", name="p.txt", defaults=Defaults("m", 8)))
