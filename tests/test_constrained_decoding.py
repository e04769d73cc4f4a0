"""Grammar-constrained decoding in the engine: every answer follows its grammar (it parses and validates against its
schema), ends as documented, reports the masked distribution's log-probabilities, and in `batch_invariant` mode is
the same bits alone, amid load that includes other constrained requests with other schemas, as a prefix-cache hit,
and with prompt-lookup speculation on (greedy and seeded).

A random Qwen3-shaped model with a byte-level tokenizer writes the answers: it means nothing, so the schemas bound
every string, number and list, and an answer ends within its max_tokens however the model draws. The engine's step
loop is driven from scripted arrivals, so every run is deterministic.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from pinned_backend.engine import Engine, StepStats, TokenOutput
from pinned_backend.grammar import GrammarCompiler, choice_grammar, json_schema_grammar, regex_grammar
from pinned_backend.kernels import KernelMode
from pinned_backend.sampling import SamplingParams
from pinned_backend.tokenizer import Tokenizer
from tests.support.backend_checkpoint import make_engine, write_random_checkpoint
from tests.support.scripted_arrivals import Arrival, run_schedule

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "owl"]},
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "tame": {"type": "boolean"},
        },
        "required": ["kind", "name", "age", "tame"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "owner": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["id"],
                        "additionalProperties": False,
                    },
                    {"type": "null"},
                ]
            },
            "note": {"type": "string", "maxLength": 3},
        },
        "required": ["tags", "owner"],
        "additionalProperties": False,
    },
]
EXAMPLES = ['{"kind": "cat", "name": "Tom", "age": 3, "tame": true}', '{"tags": ["a"], "owner": null}']
MAX_TOKENS = 80
SIZES: dict[str, Any] = {
    "num_blocks": 480,
    "block_size": 4,
    "kv_split_size": 8,
    "max_batch_size": 8,
    "max_step_tokens": 32,
    "max_queue": 32,
}
CASES = 4
DRAFTS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for the module's engines: their steps are tiny, and on a busy machine two threads spend
    more time meeting each other than computing. (The kernels hold the count they were made with.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer, GrammarCompiler]:
    folder = write_random_checkpoint(
        tmp_path_factory.mktemp("constrained") / "bytes", seed=3, with_tokenizer="bytes"
    )
    tokenizer = Tokenizer.from_pretrained(folder)
    return folder, tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def engine(
    model: tuple[Path, Tokenizer, GrammarCompiler], mode: KernelMode = "batch_invariant", **features: Any
) -> Engine:
    folder, tokenizer, _ = model
    built = make_engine(folder, mode, eos_token_ids=tokenizer.eos_token_ids, **SIZES, **features)
    built.detokenize = tokenizer.decode
    return built


def constrained(
    model: tuple[Path, Tokenizer, GrammarCompiler], rng: random.Random, schema: int, **overrides: Any
) -> SamplingParams:
    greedy = rng.random() < 0.5
    params = SamplingParams(
        temperature=0 if greedy else rng.choice([0.7, 1.0, 1.3]),
        top_k=0 if greedy else rng.choice([0, 20]),
        seed=None if greedy else rng.getrandbits(32),
        max_tokens=MAX_TOKENS,
        grammar=model[2].compile(json_schema_grammar(SCHEMAS[schema])),
    )
    return replace(params, **overrides)


def prompt(model: tuple[Path, Tokenizer, GrammarCompiler], rng: random.Random, schema: int) -> list[int]:
    """An example of the schema's JSON amid noise, so that prompt lookup has drafts to offer."""
    tokenizer = model[1]
    noise = "".join(rng.choice("abcdefgh ,.") for _ in range(rng.randint(1, 30)))
    return tokenizer.encode(f"{noise} example: {EXAMPLES[schema]} now:", add_special_tokens=False)


def target(model: tuple[Path, Tokenizer, GrammarCompiler], seed: int) -> Arrival:
    rng = random.Random(seed)
    schema = seed % len(SCHEMAS)
    return Arrival(0, "target", prompt(model, rng, schema), constrained(model, rng, schema))


def others(
    model: tuple[Path, Tokenizer, GrammarCompiler], rng: random.Random, prefixes: list[list[int]] = ()
) -> list[Arrival]:  # type: ignore[assignment]
    """1 to 7 requests arriving at random steps: constrained by either schema, by a regex or a choice, or free."""
    compiler = model[2]
    grammars = [
        None,
        compiler.compile(regex_grammar("[a-z]{2,6}( [a-z]{2,6}){0,3}")),
        compiler.compile(choice_grammar(["yes", "no", "not sure"])),
    ]
    arrivals = []
    for i in range(rng.randint(1, 7)):
        schema = rng.randrange(len(SCHEMAS))
        params = constrained(model, rng, schema, max_tokens=rng.randint(1, MAX_TOKENS))
        if rng.random() < 0.5:
            params = replace(params, grammar=rng.choice(grammars))
        text = prompt(model, rng, schema)
        if prefixes and rng.random() < 0.5:
            prefix = rng.choice(prefixes)
            text = prefix[: rng.randint(1, len(prefix))] + text
        arrivals.append(Arrival(rng.randint(0, 10), f"other-{i}", text, params))
    return arrivals


def answer(outputs: list[TokenOutput]) -> tuple[list[int], list[str]]:
    return [o.token_id for o in outputs], [float.hex(o.logprob) for o in outputs]


def parsed(model: tuple[Path, Tokenizer, GrammarCompiler], outputs: list[TokenOutput]) -> Any:
    tokenizer = model[1]
    ids = [o.token_id for o in outputs if o.token_id not in tokenizer.eos_token_ids]
    return json.loads(tokenizer.decode(ids))


@pytest.mark.parametrize("seed", range(CASES))
def test_a_constrained_answer_validates_and_ends_where_its_grammar_does(
    model: tuple[Path, Tokenizer, GrammarCompiler], seed: int
) -> None:
    arrival = target(model, seed)
    outputs = run_schedule(engine(model), [arrival])["target"]
    jsonschema.validate(parsed(model, outputs), SCHEMAS[seed % len(SCHEMAS)])
    last = outputs[-1]
    assert last.finish_reason == "stop"
    assert last.grammar is not None and last.grammar.stopped and last.grammar.accepting
    assert all(o.grammar is not None and not o.grammar.stopped for o in outputs[:-1])


def test_steps_report_the_time_spent_on_grammars(model: tuple[Path, Tokenizer, GrammarCompiler]) -> None:
    stats: list[StepStats] = []
    built = engine(model, on_step=stats.append)
    arrival = target(model, 0)
    run_schedule(built, [replace(arrival, params=replace(arrival.params, max_tokens=4))])
    constrained = len(stats)
    run_schedule(built, [replace(arrival, params=replace(arrival.params, max_tokens=4, grammar=None))])
    assert all(s.grammar_seconds > 0 for s in stats[:constrained] if s.decode_tokens)
    assert all(s.grammar_seconds == 0 for s in stats[constrained:])


def test_max_tokens_cuts_a_constrained_answer_with_length(
    model: tuple[Path, Tokenizer, GrammarCompiler],
) -> None:
    arrival = target(model, 0)
    outputs = run_schedule(engine(model), [replace(arrival, params=replace(arrival.params, max_tokens=3))])[
        "target"
    ]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[-1].grammar is not None and not outputs[-1].grammar.accepting


def test_an_end_of_sequence_drawn_where_the_grammar_accepts_ends_with_stop(
    model: tuple[Path, Tokenizer, GrammarCompiler],
) -> None:
    _, tokenizer, compiler = model
    grammar = compiler.compile(regex_grammar("[a-c]+"))
    ends = []
    for seed in range(8):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=12, grammar=grammar)
        outputs = run_schedule(engine(model), [Arrival(0, "t", tokenizer.encode("abc"), params)])["t"]
        ends.append((outputs[-1].token_id in tokenizer.eos_token_ids, outputs[-1].finish_reason))
        assert set(tokenizer.decode([o.token_id for o in outputs], skip_special_tokens=True)) <= set("abc")
    assert set(ends) <= {(True, "stop"), (False, "length")}
    assert (True, "stop") in ends, "no answer ended by an end-of-sequence token, so nothing was tested"


def test_logprobs_are_the_masked_distribution_s_and_name_only_allowed_tokens(
    model: tuple[Path, Tokenizer, GrammarCompiler],
) -> None:
    _, tokenizer, compiler = model
    choices = ["yes", "no", "nah"]
    params = SamplingParams(
        temperature=0, max_tokens=5, top_logprobs=20, grammar=compiler.compile(choice_grammar(choices))
    )
    first = run_schedule(engine(model), [Arrival(0, "t", tokenizer.encode("ok?"), params)])["t"][0]
    starts = {tokenizer.encode(c, add_special_tokens=False)[0] for c in choices}
    assert {t for t, _ in first.top_logprobs} == starts, "the top list names only what the grammar allows"
    assert sum(math.exp(lp) for _, lp in first.top_logprobs) == pytest.approx(1, rel=1e-5)
    assert first.logprob == max(lp for _, lp in first.top_logprobs)


@pytest.mark.parametrize("seed", range(CASES))
def test_a_constrained_answer_does_not_depend_on_the_batch(
    model: tuple[Path, Tokenizer, GrammarCompiler], seed: int
) -> None:
    rng = random.Random(1000 + seed)
    arrival = target(model, seed)
    alone = run_schedule(engine(model), [arrival])["target"]
    crowded = run_schedule(engine(model), [replace(arrival, step=rng.randint(0, 10)), *others(model, rng)])
    assert answer(crowded["target"]) == answer(alone), f"case {seed}: the answer changed amid others"
    assert crowded["target"][-1].batch.max > 1, "the target never shared a step, so nothing was tested"


@pytest.mark.parametrize("seed", range(CASES))
def test_a_prefix_hit_gives_the_cold_constrained_answer_alone_and_amid_load(
    model: tuple[Path, Tokenizer, GrammarCompiler], seed: int
) -> None:
    rng = random.Random(2000 + seed)
    arrival = target(model, seed)
    cold = run_schedule(engine(model), [arrival])["target"]
    cached = engine(model, prefix_cache=True)
    run_schedule(cached, [replace(arrival, request_id="warm")])
    hit = run_schedule(cached, [arrival])["target"]
    assert hit[-1].batch.cached_tokens > 0
    crowded = run_schedule(cached, [arrival, *others(model, rng, [arrival.prompt])])["target"]
    assert [answer(hit), answer(crowded)] == [answer(cold)] * 2, f"case {seed}: a hit changed the answer"


def test_speculation_gives_the_constrained_answer_without_it(
    model: tuple[Path, Tokenizer, GrammarCompiler],
) -> None:
    accepted = {"greedy": 0, "seeded": 0}
    for seed in range(CASES):
        rng = random.Random(3000 + seed)
        arrival = target(model, seed)
        off = run_schedule(engine(model), [arrival])["target"]
        alone = run_schedule(engine(model, speculative_tokens=DRAFTS), [arrival])["target"]
        loaded = run_schedule(engine(model, speculative_tokens=DRAFTS), [arrival, *others(model, rng)])[
            "target"
        ]
        both = engine(model, speculative_tokens=DRAFTS, prefix_cache=True)
        run_schedule(both, [replace(arrival, request_id="warm")])
        hit = run_schedule(both, [arrival, *others(model, rng, [arrival.prompt])])["target"]
        assert [answer(alone), answer(loaded), answer(hit)] == [answer(off)] * 3, (
            f"case {seed}: speculation changed the constrained answer (alone, amid load, with hits)"
        )
        kind = "greedy" if arrival.params.greedy else "seeded"
        accepted[kind] += sum(out[-1].batch.accepted_draft_tokens for out in (alone, loaded, hit))
    assert all(accepted.values()), f"no draft was ever kept, so nothing was verified: {accepted}"


def test_default_kernels_follow_the_grammar_too(model: tuple[Path, Tokenizer, GrammarCompiler]) -> None:
    rng = random.Random(4000)
    arrival = target(model, 1)
    run = run_schedule(engine(model, "default", speculative_tokens=DRAFTS), [arrival, *others(model, rng)])
    jsonschema.validate(parsed(model, run["target"]), SCHEMAS[1])
