"""Grammars that constrain a completion, compiled against the served tokenizer, and the matcher each request follows.

The grammar engine is llguidance (docs/structured.md says why). Its contract, as the rest of the backend uses it:

- `Grammar` is what a request asks its output to be, in llguidance's own form: the grammar string that
  `llguidance.grammar_from("lark" | "json_schema" | "regex" | ..., text)` returns (a TopLevelGrammar in JSON), which
  may hold a Lark grammar with `%json{...}` schemas embedded in it. `Grammar(spec)` takes any such string;
  `json_schema_grammar`, `regex_grammar`, `choice_grammar` and `lark_grammar` build one. A JSON schema is compiled
  from its compact JSON in its own key order (the output lists properties in the order the schema does, so the
  order is part of the grammar; whitespace is not) with `JSON_OPTIONS`, and JSON is written as `json.dumps` writes
  it (`", "` and `": "`, no other whitespace: a model cannot wander into
  whitespace that never ends). A schema embedded in a Lark grammar should carry `"x-guidance": JSON_OPTIONS` for
  the same layout.
- `GrammarCompiler(tokenizer, vocab_size)` compiles a `Grammar` against the served tokenizer (`compile`), keeping
  the most recently used compiled grammars (`capacity`) keyed by the grammar string; it is thread-safe and may take
  milliseconds to seconds for a large grammar, so a server calls it off its event loop. A grammar it cannot honour
  (a JSON-schema keyword llguidance does not implement, a malformed regex or Lark grammar, a tokenizer llguidance
  cannot read) raises `GrammarError`, whose message names the keyword or the problem: the caller answers a 400,
  never an unconstrained answer.
- A `CompiledGrammar` goes on the request in `SamplingParams.grammar`; the engine gives each sequence its own
  `Matcher` (`CompiledGrammar.matcher()`), masks the logits rows it draws from (masks.py), and commits every token it
  emits. Each `TokenOutput` carries the `GrammarState` after its token (accepting, stopped, and on the last token
  the grammar's named captures), for whoever streams the answer.
- A constrained sequence ends with finish_reason `stop` when the model draws an end-of-sequence token where the
  grammar accepts, or at once when the grammar allows nothing more (it has stopped: after the closing brace of a
  JSON value, after the last symbol of a Lark grammar); `length` at max_tokens as always.

This module knows nothing of requests, HTTP or scheduling.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import llguidance

from pinned_backend.tokenizer import Tokenizer

DEFAULT_CAPACITY = 64
# How every JSON value is laid out: json.dumps's separators and no other whitespace.
JSON_OPTIONS: Final[Mapping[str, Any]] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Applied after a schema's own "x-guidance" options: a keyword llguidance does not implement stays an error, never
# a constraint quietly dropped.
_JSON_OVERRIDES: Final[Mapping[str, Any]] = {"lenient": False}


def engine_version() -> str:
    """The grammar engine's version, as its distribution declares it; the stack names it."""
    return str(llguidance.__version__)


class GrammarError(ValueError):
    """A grammar this backend cannot honour; the message says which keyword or what is wrong."""


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar string (`llguidance.grammar_from(...)`'s result)."""

    spec: str

    @property
    def key(self) -> str:
        return hashlib.sha256(self.spec.encode()).hexdigest()


def json_schema_grammar(schema: Mapping[str, Any]) -> Grammar:
    """Output that is one JSON value valid against `schema` (a JSON Schema object)."""
    try:
        # Compact, but in the schema's own key order: the output lists an object's properties in the order its
        # schema does (as OpenAI's does), so two orders are two grammars.
        canonical = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the schema is not plain JSON: {exc}") from None
    spec = llguidance.LLMatcher.grammar_from_json_schema(
        canonical, defaults=dict(JSON_OPTIONS), overrides=dict(_JSON_OVERRIDES)
    )
    return Grammar(spec)


def regex_grammar(pattern: str) -> Grammar:
    """Output that matches `pattern` whole (Rust regex syntax)."""
    return Grammar(llguidance.grammar_from("regex", pattern))


def choice_grammar(choices: Sequence[str]) -> Grammar:
    """Output that is exactly one of `choices`."""
    if not choices:
        raise GrammarError("a choice needs at least one string to choose from")
    return Grammar(llguidance.grammar_from("choice", json.dumps(list(choices))))


def lark_grammar(text: str) -> Grammar:
    """Output in the language of a Lark grammar (llguidance's dialect; GBNF is converted)."""
    try:
        return Grammar(llguidance.grammar_from("grammar", text))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


@dataclass(frozen=True)
class GrammarState:
    """Where a sequence's matcher stands after a token: the output so far is complete (`accepting`), nothing may
    follow (`stopped`); `captures` (a Lark grammar's named captures, name and bytes) only on a request's last
    token."""

    accepting: bool
    stopped: bool
    captures: tuple[tuple[str, bytes], ...] = ()


class Matcher:
    """One sequence's place in its grammar. Used by one thread at a time (the engine's), never shared."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.ll = matcher  # masks.py computes masks from it
        self.vocab_size = vocab_size  # tokens its masks cover

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from the current state, the grammar allows; the state is unchanged."""
        return self.ll.validate_tokens(list(tokens)) if tokens else 0

    def commit(self, token: int) -> None:
        """Advance past a token the mask allowed; a refused one is an engine fault, raised."""
        if not self.ll.consume_token(token):
            raise RuntimeError(
                f"the grammar refused token {token}, which its mask allowed: {self.ll.get_error()}"
            )

    @property
    def stopped(self) -> bool:
        return self.ll.is_stopped()

    def state(self, *, final: bool = False) -> GrammarState:
        captures = tuple(self.ll.get_captures()) if final else ()
        return GrammarState(self.ll.is_accepting(), self.ll.is_stopped(), captures)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled against the served tokenizer: a matcher at its start, copied for each sequence."""

    grammar: Grammar
    _start: llguidance.LLMatcher
    vocab_size: int

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles grammars against one tokenizer and keeps the `capacity` most recently used."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        """`vocab_size`: the width of the model's logits, which the masks must cover."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_token_ids)
        self.capacity = capacity
        self._lock = threading.Lock()  # guards _compiled and _ll_tokenizer
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        key = grammar.key
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
        # Outside the lock: llguidance drops the GIL while it builds, and other grammars need not wait.
        tokenizer = self._ll()
        start = llguidance.LLMatcher(tokenizer, grammar.spec, log_level=0)
        if start.is_error():
            raise GrammarError(start.get_error())
        compiled = CompiledGrammar(grammar, start, tokenizer.vocab_size)
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        with self._lock:
            return len(self._compiled)

    def _ll(self) -> llguidance.LLTokenizer:
        """The tokenizer in llguidance's form, built on first use (it reads the whole vocabulary once)."""
        with self._lock:
            if self._ll_tokenizer is None and self._tokenizer_error is None:
                self._ll_tokenizer, self._tokenizer_error = _ll_tokenizer(
                    self._tokenizer, self.vocab_size, self._eos
                )
            if self._ll_tokenizer is None:
                raise GrammarError(f"this model's tokenizer cannot be constrained: {self._tokenizer_error}")
            return self._ll_tokenizer


def _ll_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos: list[int]
) -> tuple[llguidance.LLTokenizer | None, str | None]:
    # llguidance reads the `tokenizers` library's own JSON, the same object the backend encodes and decodes with,
    # for an HF folder and for a GGUF file's vocabulary alike. A logits row wider than the vocabulary has tokens no
    # text spells: llguidance never allows them.
    try:
        ll = llguidance.LLTokenizer(
            tokenizer.serialized(), n_vocab=max(vocab_size, tokenizer.vocab_size), eos_token=eos or None
        )
    except ValueError as exc:
        return None, f"llguidance cannot read it ({exc})"
    return ll, None
