"""Structured outputs in the engine (service/engine/grammar.py) on the shipped generator: outputs
follow their JSON schema, choices, regular expression or grammar whether greedy or sampled, many
at once, to a clean end that stop strings do not cut; a constrained greedy output is the argmax
over what the grammar allows at every step, computed the plain way; the step's masks are
llguidance's own; grammars that cannot be served are 400s naming the field, decided before any
token (in the checker's worker process, bounded in size and time); one that fails at a step ends
its request with reason "constraint", never "stop"; a finished JSON output is checked whole."""

import json
import os
import re

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
import torch

from decoding.sampling_params import SamplingParams
from service.engine.config import EngineConfig, StructuredOutput
from service.engine.engine import Engine, StepReport
from service.engine.errors import InvalidRequestError
from service.engine.grammar import GrammarMasks, json_problem
from service.engine.grammar_check import GrammarChecker, closed_schema
from service.engine.request import GenerationParams, Request
from tests.engine.helpers import context_sensitive_generator, deltas_of, run

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["merry", "sad"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "friends"],
    "additionalProperties": False,
}
BOUNDED = 200  # tokens: more than any output PERSON allows (each token at least one byte)


@pytest.fixture(scope="module")
def engine() -> Engine:
    from loading.checkpoint import DEFAULT_GENERATOR, load_checkpoint
    from service.engine.runner import runner_for

    _, tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    return Engine(runner_for(context_sensitive_generator(), tokenizer, EngineConfig()), EngineConfig())


def generate(engine: Engine, outputs: list[StructuredOutput], max_tokens: int = BOUNDED, seeds: bool = True) -> list[tuple[str, str]]:
    """Each request's (text, finish reason); request i samples with seed i (greedy when seeds is False or i is 0)."""
    prompt = engine.runner.encode_prompt("ROMEO:\n")
    requests = [
        Request(str(i), list(prompt), GenerationParams(max_tokens=max_tokens, sampling=sampling(i, seeds), structured=output))
        for i, output in enumerate(outputs)
    ]
    deltas = deltas_of(engine, {0: requests})
    return [("".join(d.text for d in deltas[str(i)]), str(deltas[str(i)][-1].finish_reason)) for i in range(len(outputs))]


def sampling(i: int, seeds: bool) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=i) if seeds and i else SamplingParams(temperature=0.0)


def test_every_output_follows_its_schema_greedy_or_sampled_many_at_once(engine: Engine) -> None:
    schema = StructuredOutput("json", json.dumps(PERSON))
    answers = generate(engine, [schema] * 8)
    for text, reason in answers:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in answers}) > 1  # sampled with their own seeds


def test_choices_regexes_and_grammars_are_followed(engine: Engine) -> None:
    outputs = [
        StructuredOutput("choice", json.dumps(["yes", "no", "by my troth"])),
        StructuredOutput("regex", r"[A-Z][a-z]{2,8} (of|to) [A-Z][a-z]{2,8}\."),
        StructuredOutput("grammar", 'root ::= "I " verb " " noun\nverb ::= "love" | "hate"\nnoun ::= "Rome" | "thee"'),  # GBNF
        StructuredOutput("grammar", 'start: "O " WORD "!"\nWORD: /[a-z]{3,7}/'),  # Lark
    ]
    for seeded in (False, True):
        (choice, _), (regex, _), (gbnf, _), (lark, _) = generate(engine, outputs, seeds=seeded)
        assert choice in ("yes", "no", "by my troth")
        assert re.fullmatch(r"[A-Z][a-z]{2,8} (of|to) [A-Z][a-z]{2,8}\.", regex), regex
        assert re.fullmatch(r"I (love|hate) (Rome|thee)", gbnf), gbnf
        assert re.fullmatch(r"O [a-z]{3,7}!", lark), lark


def test_a_length_cut_ends_the_output_cleanly_as_length(engine: Engine) -> None:
    ((text, reason),) = generate(engine, [StructuredOutput("json", json.dumps(PERSON))], max_tokens=3)
    assert reason == "length" and text.startswith("{")


def test_a_stop_string_does_not_cut_a_structured_output(engine: Engine) -> None:
    """The grammar decides where the output ends (docs/api.md): a stop string inside it would
    leave an output that breaks its constraint with finish_reason "stop"."""
    prompt = engine.runner.encode_prompt("ROMEO:\n")
    output = StructuredOutput("choice", json.dumps(["O Romeo, wherefore art thou"]))
    request = Request("stopped", prompt, GenerationParams(max_tokens=40, stop=(", wherefore",), structured=output))
    deltas = deltas_of(engine, {0: [request]})["stopped"]
    assert "".join(d.text for d in deltas) == "O Romeo, wherefore art thou" and deltas[-1].finish_reason == "stop"


def masked_argmax(model: torch.nn.Module, ids: list[int], matcher: llguidance.LLMatcher, vocab_size: int) -> int:
    """The plain path's next token: the whole sequence through the model, the argmax among the
    ids the grammar's own bitmask allows."""
    logits = model(torch.tensor([ids]))[0, -1].float()  # (V,)
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.unpackbits(mask, bitorder="little")[:vocab_size].astype(bool)
    logits[:vocab_size][~torch.from_numpy(allowed)] = float("-inf")
    logits[vocab_size:] = float("-inf")
    return int(logits.argmax())


def test_constrained_greedy_is_the_argmax_over_what_the_grammar_allows(engine: Engine) -> None:
    """The plain path: the whole sequence through the model at every step, the grammar's mask from
    llguidance's own bitmask, the argmax; the engine (paged KV, ragged steps, masks computed beside
    the forward) must choose the same tokens."""
    output = StructuredOutput("json", json.dumps(PERSON))
    ((text, _),) = generate(engine, [output], seeds=False)
    model, tokenizer = context_sensitive_generator(), engine.runner.tokenizer
    matcher = engine.grammars.matcher(output)
    ids = engine.runner.encode_prompt("ROMEO:\n")
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(BOUNDED):
            token = masked_argmax(model, ids + generated, matcher, tokenizer.vocab_size)
            assert matcher.consume_token(token)
            if token in engine.runner.eos_ids:
                break
            generated.append(token)
    assert text == tokenizer.decode(generated)


def test_fast_forward_appends_the_forced_tokens_and_computes_what_the_plain_path_does(engine: Engine) -> None:
    """The plain path with llguidance's forced tokens: the whole sequence through the model at
    every step, the argmax over the mask, then the tokens the grammar forces appended, until the
    grammar is complete. The engine appends the same ones without a step each and computes them
    with the next sampled token (a prompt chunk over the paged KV): the same ids, in fewer steps."""
    output = StructuredOutput("json", json.dumps(PERSON))
    prompt = engine.runner.encode_prompt("ROMEO:\n")
    request = Request("ff", list(prompt), GenerationParams(max_tokens=BOUNDED, sampling=SamplingParams(temperature=0.0), structured=output))
    deltas = deltas_of(engine, {0: [request]})["ff"]
    got = [t for d in deltas for t in d.token_ids]
    assert deltas[-1].finish_reason == "stop" and any(len(d.token_ids) > 1 for d in deltas)  # some tokens were forced
    model, tokenizer = context_sensitive_generator(), engine.runner.tokenizer
    matcher = engine.grammars.matcher(output)
    generated: list[int] = []
    with torch.inference_mode():
        while not matcher.is_stopped():
            token = masked_argmax(model, prompt + generated, matcher, tokenizer.vocab_size)
            assert matcher.consume_token(token) and token not in engine.runner.eos_ids
            forced = matcher.compute_ff_tokens()
            assert matcher.consume_tokens(forced)
            generated += [token, *forced]
    assert got == generated
    assert len(deltas) < len(got)  # a step per delta: fewer steps than tokens
    jsonschema.validate(json.loads(tokenizer.decode(got)), PERSON)


def test_without_fast_forward_every_token_is_a_step_and_the_output_holds(engine: Engine) -> None:
    stepping = Engine(engine.runner, EngineConfig(grammar_fast_forward=False, num_speculative_tokens=0))
    output = StructuredOutput("json", json.dumps(PERSON))
    request = Request("stepped", engine.runner.encode_prompt("ROMEO:\n"), GenerationParams(max_tokens=BOUNDED, structured=output))
    deltas = deltas_of(stepping, {0: [request]})["stepped"]
    assert deltas[-1].finish_reason == "stop" and all(len(d.token_ids) <= 1 for d in deltas)
    jsonschema.validate(json.loads("".join(d.text for d in deltas)), PERSON)


def test_the_steps_masks_are_llguidances_own(engine: Engine) -> None:
    """GrammarMasks.apply (a step's masks, computed on the worker thread, unpacked in torch) equals
    llguidance's numpy reference on matchers at different places in their grammars."""
    output = StructuredOutput("json", json.dumps(PERSON))
    requests = [Request(str(i), [5], GenerationParams(max_tokens=9, structured=output)) for i in range(3)]
    for r, prefix in zip(requests, ['{"name":"', '{"name":"Ro","age":1', ""], strict=True):
        r.grammar = engine.grammars.matcher(output)
        assert r.grammar.consume_tokens(engine.runner.tokenizer.encode(prefix)) if prefix else True
    masks = engine.grammars.masks(requests, {})
    assert isinstance(masks, GrammarMasks)
    vocab = engine.runner.tokenizer.vocab_size + 5  # logits wider than the tokenizer: the extra ids are never allowed
    logits = torch.randn(4, vocab)  # row 1 belongs to a request without a grammar
    expected = logits.clone().numpy()
    masks.apply(logits, ["0", "plain", "1", "2"])
    for row, r in [(0, requests[0]), (2, requests[1]), (3, requests[2])]:
        bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)
        assert r.grammar is not None
        llguidance.numpy.fill_next_token_bitmask(r.grammar, bitmask)
        reference = expected[row : row + 1].copy()
        reference[:, engine.runner.tokenizer.vocab_size :] = -np.inf
        llguidance.numpy.apply_token_bitmask_inplace(reference, bitmask)
        assert np.array_equal(logits[row].numpy(), reference[0])
    assert torch.equal(logits[1], torch.from_numpy(expected[1]))


@pytest.mark.parametrize(
    ("output", "param"),
    [
        (StructuredOutput("json", '{"type": "strin"}', "response_format"), "response_format"),
        (StructuredOutput("json", "{not json", "structured_outputs.json"), "structured_outputs.json"),
        (StructuredOutput("regex", "a(b", "structured_outputs.regex"), "structured_outputs.regex"),
        (StructuredOutput("choice", '["a", ""]', "structured_outputs.choice"), "structured_outputs.choice"),
        (StructuredOutput("grammar", "root ::= missing", "structured_outputs.grammar"), "structured_outputs.grammar"),
        (StructuredOutput("grammar", "start: x", "structured_outputs.grammar"), "structured_outputs.grammar"),
    ],
)
def test_what_cannot_compile_is_refused_naming_the_field(engine: Engine, output: StructuredOutput, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(Request("bad", [5, 6], GenerationParams(max_tokens=4, structured=output)))
    assert refused.value.param == param and not engine.has_work


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        ("regex", r"[^\s\S]", "empty"),
        ("json", json.dumps({"$ref": "#"}), "empty"),
        ("json", json.dumps(CYCLE), "empty"),
        ("json", json.dumps({"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable"),
        ("json", "false", "admits no value"),
        ("grammar", 'start: a\na: "x" a', "Too many items"),
        ("grammar", 'start: "a"{1000000000}', "Too many items"),
        ("grammar", 'root ::= "a"{1000000000}', "Too many items"),
        ("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}), "served"),
        ("choice", json.dumps([f"item {i}" for i in range(2001)]), "at most 2000 choices"),
    ],
)  # fmt: skip
def test_grammars_with_no_output_or_past_the_parsers_limits_are_refused_before_any_token(
    engine: Engine, kind: str, spec: str, words: str
) -> None:
    """Empty languages, references that never end and parser limits met in the first steps: a 400
    decided by the checker, not an empty or cut output answered with "stop"."""
    output = StructuredOutput(kind, spec, "structured_outputs.x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=words) as refused:
        engine.add_request(Request("bad", [5, 6], GenerationParams(max_tokens=4, structured=output)))
    assert refused.value.param == "structured_outputs.x" and not engine.has_work


def test_the_checker_bounds_a_grammars_size_and_time_in_a_process_of_its_own() -> None:
    """The GBNF front end is Python and quadratic in a grammar's lines: it runs in the worker,
    which is killed past the time limit, and the next grammar is checked by a new one."""
    checker = GrammarChecker(max_bytes=300_000, timeout_s=2.0)  # 200,000 lines take minutes, "ab?" a millisecond
    try:
        with pytest.raises(ValueError, match="at most 300,000 are compiled"):
            checker.grammar(StructuredOutput("regex", "a" * 300_001))
        assert checker.worker_pid is None  # refused by size: never sent
        assert checker.grammar(StructuredOutput("regex", "ab?"))
        first = checker.worker_pid
        assert first is not None and first != os.getpid()
        with pytest.raises(ValueError, match="took more than 2 s"):
            checker.grammar(StructuredOutput("grammar", 'root ::= "a"' + "\n" * 200_000))
        assert checker.worker_pid is None  # killed
        assert checker.grammar(StructuredOutput("regex", "ab?"))
        assert checker.worker_pid not in (None, first)
    finally:
        checker.close()


def test_a_grammar_that_fails_at_a_step_ends_its_request_as_constraint_not_stop(engine: Engine) -> None:
    """The probe walks the smallest bytes (a, a, ...); the logit bias walks into "z", past which the
    grammar meets its parser's limit: the request ends with reason "constraint" and says why."""
    tokenizer = engine.runner.tokenizer
    a, z = (tokenizer.encode(letter)[-1] for letter in ("a", "z"))
    assert tokenizer.decode([a]).strip() == "a" and tokenizer.decode([z]).strip() == "z"
    output = StructuredOutput("grammar", 'start: "b" | "a"+ "z" "c"{1000000000}', "structured_outputs.grammar")
    sampling = SamplingParams(temperature=0.0, logit_bias=((a, 50.0), (z, 100.0)))
    params = GenerationParams(max_tokens=20, sampling=sampling, structured=output)
    request = Request("fails", engine.runner.encode_prompt("ROMEO:\n"), params)
    deltas = deltas_of(engine, {0: [request]})["fails"]
    assert deltas[-1].finish_reason == "constraint"
    assert deltas[-1].error is not None and deltas[-1].error.startswith("structured_outputs.grammar: the output could not go on")
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)


def test_a_finished_json_output_is_checked_whole_duplicate_keys_included() -> None:
    """What a grammar cannot rule out where other properties are allowed (a key twice, counted
    twice by minProperties) is found when the output ends."""
    counted = StructuredOutput("json", json.dumps({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}))
    assert json_problem(counted, '{"data": 1, "items": 1, "more": 2}') is None
    assert "'data' appears twice" in str(json_problem(counted, '{"data": 1, "items": 1, "data": 1}'))
    assert "does not have enough properties" in str(json_problem(counted, '{"data": 1}'))
    strict = StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}), strict=True)
    assert json_problem(strict, '{"a": 1}') is None
    assert "'a' is a required property" in str(json_problem(strict, "{}"))


def test_schemas_are_closed_as_xgrammar_reads_them_and_strict_requires_every_property() -> None:
    listed = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}, "required": []}
    assert closed_schema(listed, strict=False) == {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False}},
        "required": [],
        "additionalProperties": False,
    }
    assert closed_schema(listed, strict=True)["required"] == ["a"]
    assert closed_schema(listed, strict=True)["properties"]["a"]["required"] == ["b"]
    assert closed_schema({"type": "object"}, strict=True) == {"type": "object"}  # any object stays any object
    assert closed_schema({"properties": {"a": {}}, "additionalProperties": True}, strict=False)["additionalProperties"] is True
    assert "additionalProperties" not in listed  # the argument is not changed


def test_strict_json_ends_after_the_listed_properties_in_their_order(engine: Engine) -> None:
    """The output a small model would run on with (properties it invents) is closed: it gives the
    listed keys, in order, and then its end, whatever the model prefers."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 99}}}
    outputs = [StructuredOutput("json", json.dumps(schema), strict=True) for _ in range(4)]
    for text, reason in generate(engine, outputs):
        assert reason == "stop"
        value = json.loads(text)
        assert list(value) == ["name", "age"]


def test_json_whitespace_is_bounded_and_can_be_taken_away(engine: Engine) -> None:
    schema = json.dumps(PERSON)
    for whitespace, allowed in ((None, re.compile(r"(?: ?)")), ("", re.compile(""))):
        outputs = [StructuredOutput("json", schema, whitespace=whitespace) for _ in range(6)]
        for text, reason in generate(engine, outputs):
            assert reason == "stop"
            jsonschema.validate(json.loads(text), PERSON)
            outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
            assert all(allowed.fullmatch(gap) for gap in re.findall(r"\s+", outside_strings)), text


def test_beam_search_min_tokens_and_ignore_eos_are_refused_with_a_grammar(engine: Engine) -> None:
    output = StructuredOutput("choice", '["a"]')
    with pytest.raises(InvalidRequestError, match="beam"):
        engine.resolve([5], GenerationParams(max_tokens=4, beam_size=2, structured=output))
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        engine.resolve([5], GenerationParams(max_tokens=4, min_tokens=2, structured=output))
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        engine.resolve([5], GenerationParams(max_tokens=4, ignore_eos=True, structured=output))


def test_speculation_within_a_grammar_makes_what_one_token_a_step_makes(engine: Engine) -> None:
    """Structured outputs whose prompts hold JSON of the schema's shape: the drafts a grammar allows
    are verified with each row masked by the grammar after the drafts before it, and the outputs,
    greedy and sampled, are those made without speculation (and follow the schema)."""
    output = StructuredOutput("json", json.dumps(PERSON))
    example = '{"name": "Romeo", "age": 17, "mood": "sad", "friends": ["Tybalt"]}'
    prompts = [f"{example}\n", f"ROMEO:\n{example}\n", f"{example}\n{example}\n"]  # at most 102 tokens: 150 more fit
    samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.7, seed=9)]

    def outputs(speculative_tokens: int) -> tuple[dict[str, list[int]], int]:
        config = EngineConfig(num_speculative_tokens=speculative_tokens)
        speculating = Engine(engine.runner, config)
        reports: list[StepReport] = []
        speculating.on_step = reports.append
        requests = [
            Request(f"{i}-{j}", engine.runner.encode_prompt(p), GenerationParams(max_tokens=150, sampling=s, structured=output))
            for i, p in enumerate(prompts)
            for j, s in enumerate(samplings)
        ]
        return run(speculating, {0: requests}), sum(r.draft_tokens for r in reports)

    (plain, _), (speculated, drafted) = outputs(0), outputs(4)
    assert speculated == plain and drafted > 0
    for tokens in speculated.values():
        jsonschema.validate(json.loads(engine.runner.tokenizer.decode(tokens)), PERSON)
