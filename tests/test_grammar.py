"""Specification of pinned_backend.grammar: grammars compiled against the served tokenizer, the layout of
constrained JSON, refusals that name what cannot be honoured, the bounded cache, and the per-sequence matcher. (A
GGUF file's tokenizer is compiled against in tests/test_structured_outputs.py, which serves SmolLM2's.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pinned_backend.grammar import (
    Grammar,
    GrammarCompiler,
    GrammarError,
    choice_grammar,
    engine_version,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from pinned_backend.tokenizer import Tokenizer
from tests.support.backend_checkpoint import write_random_checkpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("grammar") / "bytes", with_tokenizer="bytes")
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def allows(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar: Grammar, text: str) -> tuple[bool, bool]:
    """(every token of `text` is allowed in turn, the grammar then accepts the output as complete)."""
    matcher = compiler.compile(grammar).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.valid_prefix(ids) < len(ids):
        return False, False
    for token in ids:
        matcher.commit(token)
    return True, matcher.state().accepting


def test_a_schema_allows_exactly_the_json_that_validates_in_json_dumps_layout(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    grammar = json_schema_grammar(PERSON)
    good = {"name": "Ada", "age": 36, "tags": ["a", "b"]}
    assert allows(compiler, tokenizer, grammar, json.dumps(good)) == (True, True)
    assert allows(compiler, tokenizer, grammar, json.dumps(good)[:-1]) == (True, False), (
        "incomplete is not done"
    )
    for bad in (
        {**good, "age": -1},
        {**good, "tags": ["c"]},
        {**good, "extra": 1},
        {"name": "Ada", "age": 36},
        {**good, "name": "x" * 21},
    ):
        assert allows(compiler, tokenizer, grammar, json.dumps(bad))[1] is False, bad
    # One layout: json.dumps's separators, no other whitespace, so a model cannot pad forever.
    assert allows(compiler, tokenizer, grammar, json.dumps(good, separators=(",", ":")))[0] is False
    assert allows(compiler, tokenizer, grammar, json.dumps(good, indent=1))[0] is False


def test_properties_come_in_the_schema_s_order_so_order_is_part_of_the_grammar(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    reordered = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    grammar = json_schema_grammar(reordered)
    assert grammar != json_schema_grammar(PERSON)
    value = {"tags": [], "age": 1, "name": "x"}
    assert allows(compiler, tokenizer, grammar, json.dumps(value)) == (True, True)
    assert allows(compiler, tokenizer, json_schema_grammar(PERSON), json.dumps(value))[0] is False


def test_the_same_schema_spelled_another_way_is_one_grammar() -> None:
    spaced = json.loads(json.dumps(PERSON, indent=4))
    assert json_schema_grammar(spaced) == json_schema_grammar(PERSON)
    assert json_schema_grammar(spaced).key == json_schema_grammar(PERSON).key


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
        ({"type": "object", "if": {}, "then": {}}, '"if", "then"'),
        ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "string"}}, "contains"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
        ({"type": "string", "format": "postcode"}, "postcode"),
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
        ({"$ref": "http://example.com/schema.json"}, "http://example.com/schema.json"),
        # A schema cannot ask the engine to drop what it does not implement.
        ({"type": "object", "unevaluatedProperties": False, "x-guidance": {"lenient": True}}, "unevaluated"),
    ],
)
def test_a_keyword_the_engine_cannot_honour_is_an_error_that_names_it(
    compiler: GrammarCompiler, schema: dict[str, Any], named: str
) -> None:
    with pytest.raises(GrammarError, match=named.replace("$", r"\$")):
        compiler.compile(json_schema_grammar(schema))


def test_a_schema_that_is_not_plain_json_is_an_error() -> None:
    with pytest.raises(GrammarError, match="not plain JSON"):
        json_schema_grammar({"type": "number", "maximum": float("nan")})


def test_regex_choice_and_lark_grammars(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    assert allows(compiler, tokenizer, regex_grammar("[a-c]{3}"), "abc") == (True, True)
    assert allows(compiler, tokenizer, regex_grammar("[a-c]{3}"), "abd")[0] is False
    assert allows(compiler, tokenizer, choice_grammar(["yes", "no"]), "no") == (True, True)
    assert allows(compiler, tokenizer, choice_grammar(["yes", "no"]), "maybe")[0] is False
    tagged = lark_grammar('start: "<call>" %json{"type": "object"} "</call>"')
    assert allows(compiler, tokenizer, tagged, '<call>{"a":1}</call>') == (True, True)
    with pytest.raises(GrammarError, match="unknown name"):
        compiler.compile(lark_grammar("start: nothing"))
    with pytest.raises(GrammarError, match="at least one"):
        choice_grammar([])


def test_a_grammar_that_allows_nothing_more_stops_and_reports_its_captures(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = compiler.compile(
        lark_grammar('start: "<tag>" name "</tag>"\nname[capture]: /[a-z]+/')
    ).matcher()
    for token in tokenizer.encode("<tag>ab</tag>", add_special_tokens=False):
        assert not matcher.stopped
        matcher.commit(token)
    assert matcher.stopped
    state = matcher.state(final=True)
    assert (state.accepting, state.stopped) == (True, True)
    assert ("name", b"ab") in state.captures
    assert matcher.state().captures == (), "captures are copied only for the last token"


def test_each_sequence_has_its_own_matcher_and_checking_drafts_moves_none(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    compiled = compiler.compile(regex_grammar("ab|cd"))
    first, second = compiled.matcher(), compiled.matcher()
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    assert first.valid_prefix([a, b, a]) == 2
    assert first.valid_prefix([c]) == 1, "checking drafts left the state where it was"
    first.commit(a)
    assert second.valid_prefix([c]) == 1, "another sequence's matcher is untouched"
    with pytest.raises(RuntimeError, match="refused"):
        first.commit(c)


def test_compiled_grammars_are_cached_and_the_least_recently_used_leave_first(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, capacity=2)
    a, b, c = (regex_grammar(p) for p in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)
    assert len(compiler) == 2
    assert compiler.compile(a) is first, "the most recently used stays"
    assert compiler.compile(b) is not None and len(compiler) == 2


def test_masks_cover_a_logits_row_wider_than_the_vocabulary(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size + 64, tokenizer.eos_token_ids)
    assert compiler.compile(regex_grammar("a")).vocab_size == tokenizer.vocab_size + 64


def test_a_tokenizer_llguidance_cannot_read_refuses_every_grammar(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path / "chars", with_tokenizer=True)  # a Fuse decoder
    tokenizer = Tokenizer.from_pretrained(folder)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    for _ in range(2):  # the reason is kept, not looked for again
        with pytest.raises(GrammarError, match="tokenizer cannot be constrained"):
            compiler.compile(regex_grammar("a"))


def test_the_engine_names_its_installed_version() -> None:
    from importlib.metadata import version

    assert engine_version() == version("llguidance")
