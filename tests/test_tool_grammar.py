"""Specification of pinned_backend.tool_grammar: which answers each tool choice allows, compiled by the backend's own
grammar compiler against a byte-level tokenizer, and the 400s that name what cannot be constrained."""

from __future__ import annotations

from typing import Any

import pytest
import tokenizers

from pinned_backend.grammar import GrammarCompiler
from pinned_backend.protocol import BadRequest, ChatRequest, parse_request
from pinned_backend.tokenizer import Tokenizer
from pinned_backend.tool_format import SEPARATOR, call_text
from pinned_backend.tool_grammar import answer_constraint, tag_tokens
from pinned_backend.tools import tool_plan
from tests.support.backend_checkpoint import write_random_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
PARIS = call_text("get_weather", '{"city": "Paris"}')
NOW = call_text("get_time", "{}")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Tokenizer]:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("grammar") / "bytes", with_tokenizer="bytes")
    tokenizer = Tokenizer.from_pretrained(folder)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids), tokenizer


def allows(compiler: tuple[GrammarCompiler, Tokenizer], text: str, **fields: Any) -> bool:
    """Whether the request's answer may be exactly `text`."""
    grammars, tokenizer = compiler
    request = parse_request(ChatRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})
    constraint = answer_constraint(request, tool_plan(request))
    assert constraint is not None
    matcher = grammars.compile(constraint.grammar).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.valid_prefix(ids) == len(ids) and _accepts(matcher, ids)


def _accepts(matcher: Any, ids: list[int]) -> bool:
    for token in ids:
        matcher.commit(token)
    return bool(matcher.state().accepting)


def test_auto_allows_free_text_or_text_then_calls(compiler: tuple[GrammarCompiler, Tokenizer]) -> None:
    tools = {"tools": [WEATHER, TIME]}
    assert allows(compiler, "No call needed.", **tools)
    assert allows(compiler, "Let me check.\n" + PARIS, **tools)
    assert allows(compiler, PARIS + SEPARATOR + NOW, **tools)


def test_once_the_tag_is_written_the_call_is_constrained(compiler: tuple[GrammarCompiler, Tokenizer]) -> None:
    tools = {"tools": [WEATHER, TIME]}
    assert not allows(compiler, "<tool_call> anything", **tools)
    assert not allows(compiler, call_text("get_weather", '{"town": "Paris"}'), **tools), "city is required"
    assert not allows(compiler, call_text("get_news", "{}"), **tools), "only offered functions"
    assert not allows(compiler, PARIS.replace('", "', '","'), **tools), "JSON's default spacing, no other"
    assert not allows(compiler, PARIS + " and more text", **tools), "the answer ends after its calls"


def test_required_and_a_named_function_allow_calls_only(compiler: tuple[GrammarCompiler, Tokenizer]) -> None:
    required = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    assert not allows(compiler, "No call needed.", **required)
    assert allows(compiler, PARIS, **required) and allows(compiler, PARIS + SEPARATOR + NOW, **required)
    named = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    assert allows(compiler, NOW, **named) and not allows(compiler, PARIS, **named)
    assert not allows(compiler, call_text("get_time", '{"x": 1}'), **named), "no parameters: an empty object"
    assert not allows(compiler, NOW + SEPARATOR + NOW, **named), "a named function is called once"


def test_parallel_tool_calls_false_allows_one_call(compiler: tuple[GrammarCompiler, Tokenizer]) -> None:
    single = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    assert allows(compiler, PARIS, **single)
    assert not allows(compiler, PARIS + SEPARATOR + NOW, **single)
    legacy = {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    assert allows(compiler, PARIS, **legacy) and not allows(compiler, PARIS + SEPARATOR + PARIS, **legacy)


def test_auto_with_a_response_format_is_that_json_or_calls(
    compiler: tuple[GrammarCompiler, Tokenizer],
) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    fields = {
        "tools": [WEATHER],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    assert allows(compiler, '{"answer": "sunny"}', **fields)
    assert allows(compiler, PARIS, **fields)
    assert not allows(compiler, "It is sunny.", **fields)


def test_tags_that_are_tokens_of_their_own_are_allowed_as_tokens_and_spelled_out() -> None:
    # As Qwen's vocabulary has them: added tokens, which the grammar engine never spells out of text.
    plain = _byte_level()
    raw = tokenizers.Tokenizer.from_str(plain.to_str())
    raw.add_tokens(
        [tokenizers.AddedToken("<tool_call>", special=False), tokenizers.AddedToken("</tool_call>")]
    )
    tokenizer = Tokenizer(raw, None, None, "<|im_end|>", frozenset({0}))
    assert tag_tokens(tokenizer) and not tag_tokens(Tokenizer(plain, None, None, None, frozenset()))
    grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    as_tokens, spelled = raw.encode(PARIS).ids, plain.encode(PARIS).ids
    assert len(as_tokens) < len(spelled) and tokenizer.token_to_id("<tool_call>") in as_tokens
    compiled: dict[str, Any] = {}
    for choice in ("auto", "required"):
        request = parse_request(
            ChatRequest,
            {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": choice},
        )
        constraint = answer_constraint(request, tool_plan(request), tag_tokens=True)
        assert constraint is not None
        compiled[choice] = grammars.compile(constraint.grammar)
        for ids in (as_tokens, spelled):
            assert compiled[choice].matcher().valid_prefix(ids) == len(ids), (
                f"{choice}: tags as tokens or spelled"
            )
    text_then_tag = [*raw.encode("Sure.").ids, as_tokens[0]]
    free_after = compiled["auto"].matcher().valid_prefix([*text_then_tag, *raw.encode(" anything").ids])
    assert free_after == len(text_then_tag), "under auto, text then the tag token, and from there a call only"


def _byte_level() -> tokenizers.Tokenizer:
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    raw = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={t: i for i, t in enumerate(["<|im_end|>", *alphabet])}, merges=[])
    )
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    raw.add_special_tokens(["<|im_end|>"])
    return raw


def test_no_tool_grammar_when_no_call_may_be_made() -> None:
    request = parse_request(
        ChatRequest,
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "none"},
    )
    assert answer_constraint(request, tool_plan(request)) is None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}
                ]
            },
            "tools.0.function.parameters",
            "not",
        ),
        (
            {
                "functions": [
                    {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strang"}}}}
                ]
            },
            "functions.0.parameters",
            "strang",
        ),
        ({"tools": [WEATHER], "guided_regex": "a+"}, "guided_regex", "send guided_regex without tools"),
    ],
)
def test_what_cannot_be_constrained_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    request = parse_request(ChatRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})
    with pytest.raises(BadRequest) as caught:
        answer_constraint(request, tool_plan(request))
    assert caught.value.param == param
    assert words in caught.value.message
