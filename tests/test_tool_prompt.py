"""Specification of pinned_backend.tool_prompt and tool_format: a conversation with tools as a template receives
it, for a template that renders tools itself and, in the generic format, for one that does not."""

from __future__ import annotations

import json
from typing import Any

import tokenizers
from tokenizers import models

from pinned_backend.protocol import ChatRequest, parse_request
from pinned_backend.tokenizer import Tokenizer
from pinned_backend.tool_format import call_text, normal_arguments, tools_block
from pinned_backend.tool_prompt import chat_prompt, renders_tools
from pinned_backend.tools import tool_plan

# A template that knows nothing of tools, as SmolLM2's: every message's role and content, as they are.
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# One that renders tools itself, shaped as Qwen3's: the tools in the system turn, calls in the assistant's turn with
# their arguments as JSON, results as a user turn of <tool_response> blocks.
WITH_TOOLS = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# The function as it is listed: the parameters' keys in the order a record keeps them (RFC 8785's).
OFFERED = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(
        tokenizers.Tokenizer(models.WordLevel({"x": 0}, unk_token="x")), template, None, None, frozenset()
    )


def prompt(template: str, **fields: Any) -> str:
    request = parse_request(ChatRequest, {"messages": CONVERSATION, **fields})
    chat = tokenizer(template)
    messages, extra = chat_prompt(
        request.messages, tool_plan(request), renders_tools(template, chat.takes_tools)
    )
    return chat.apply_chat_template(messages, **extra)


def test_a_template_that_reads_tools_is_told_so() -> None:
    assert tokenizer(WITH_TOOLS).takes_tools
    assert not tokenizer(PLAIN).takes_tools


def test_a_template_renders_tools_itself_only_in_the_spelling_the_grammar_writes() -> None:
    assert renders_tools(WITH_TOOLS, tokenizer(WITH_TOOLS).takes_tools)
    assert not renders_tools(PLAIN, False)
    other = WITH_TOOLS.replace("<tool_call>", "<|python_tag|>").replace("</tool_call>", "<|eom_id|>")
    assert tokenizer(other).takes_tools and not renders_tools(other, True), (
        "a template that spells calls otherwise would teach the model what the grammar forbids"
    )


def test_the_generic_format_is_the_spelling_of_qwens_own_template() -> None:
    own = prompt(WITH_TOOLS, tools=[WEATHER])
    assert call_text("get_weather", '{"city":"Paris"}') in own
    assert call_text("get_weather", '{"city":"Paris"}') == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    listed = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "type": "object",
            },
        },
    }
    assert json.dumps(listed) in own, (
        "OpenAI's tool objects, the parameters' keys in the order a record keeps"
    )


def test_without_template_support_tools_join_the_system_turn_and_results_one_user_turn() -> None:
    text = prompt(PLAIN, tools=[WEATHER])
    block = tools_block([OFFERED])
    assert text.startswith(f"<|im_start|>system\n{block}<|im_end|>\n"), (
        "the tools block becomes the system turn"
    )
    calls = "\n".join([call_text("get_weather", '{"city": "Paris"}')] * 2)
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in text, "calls are written into the assistant's text"
    results = "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text, "consecutive results make one user turn"
    assert "<|im_start|>tool" not in text


def test_an_existing_system_message_keeps_its_text_before_the_tools_block() -> None:
    request = parse_request(
        ChatRequest,
        {"messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION], "tools": [WEATHER]},
    )
    messages, _ = chat_prompt(request.messages, tool_plan(request), own_tools=False)
    assert messages[0] == {"role": "system", "content": f"Be brief.\n\n{tools_block([OFFERED])}"}


def test_tools_are_not_offered_when_the_answer_may_not_call_but_past_calls_still_render() -> None:
    for template in (PLAIN, WITH_TOOLS):
        text = prompt(template, tools=[WEATHER], tool_choice="none")
        assert 'get_weather", "parameters' not in text and "# Tools" not in text
        assert "<tool_call>" in text and "<tool_response>" in text
    assert "<tool_call>" in prompt(PLAIN), "a conversation's calls render even with no tools offered"


def test_legacy_function_turns_render_as_tool_turns() -> None:
    request = parse_request(
        ChatRequest,
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}},
                {"role": "function", "name": "get_weather", "content": "sunny"},
            ],
            "functions": [WEATHER["function"]],
        },
    )
    plain, _ = chat_prompt(request.messages, tool_plan(request), own_tools=False)
    assert plain[2]["content"] == call_text("get_weather", "{}")
    assert plain[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    own, extra = chat_prompt(request.messages, tool_plan(request), own_tools=True)
    assert own[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {}}
    assert own[2] == {"role": "tool", "name": "get_weather", "content": "sunny"}
    assert extra["tools"][0]["function"]["name"] == "get_weather"


def test_arguments_are_spelled_as_the_grammar_spells_them_and_kept_if_not_json() -> None:
    assert normal_arguments('{"a":1,"b":[1,2]}') == '{"a": 1, "b": [1, 2]}'
    assert normal_arguments("not json") == '"not json"'
