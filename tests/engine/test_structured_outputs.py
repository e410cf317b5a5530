"""Structured outputs in the engine (service/engine/grammar.py) on the shipped generator: outputs
follow their JSON schema, choices, regular expression or grammar whether greedy or sampled, many
at once, to a clean end (or a stop string's); a constrained greedy output is the argmax over what the grammar allows at
every step, computed the plain way; the step's masks are llguidance's own; bad grammars are 400s."""

import json
import re

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
import torch

from decoding.sampling_params import SamplingParams
from service.engine.config import EngineConfig, StructuredOutput
from service.engine.engine import Engine
from service.engine.errors import InvalidRequestError
from service.engine.grammar import GrammarMasks
from service.engine.request import GenerationParams, Request
from tests.engine.helpers import context_sensitive_generator, deltas_of

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
    assert reason == "length" and text.startswith('{"')


def test_a_stop_string_ends_a_structured_output_where_it_appears(engine: Engine) -> None:
    prompt = engine.runner.encode_prompt("ROMEO:\n")
    output = StructuredOutput("choice", json.dumps(["O Romeo, wherefore art thou"]))
    request = Request("stopped", prompt, GenerationParams(max_tokens=40, stop=(", wherefore",), structured=output))
    deltas = deltas_of(engine, {0: [request]})["stopped"]
    assert "".join(d.text for d in deltas) == "O Romeo" and deltas[-1].finish_reason == "stop"


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
            logits = model(torch.tensor([ids + generated]))[0, -1].float()  # (V,)
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(mask, bitorder="little")[: tokenizer.vocab_size].astype(bool)
            logits[: tokenizer.vocab_size][~torch.from_numpy(allowed)] = float("-inf")
            logits[tokenizer.vocab_size :] = float("-inf")
            token = int(logits.argmax())
            assert matcher.consume_token(token)
            if token in engine.runner.eos_ids:
                break
            generated.append(token)
    assert text == tokenizer.decode(generated)


def test_the_steps_masks_are_llguidances_own(engine: Engine) -> None:
    """GrammarMasks.apply (a step's masks, computed on the worker thread, unpacked in torch) equals
    llguidance's numpy reference on matchers at different places in their grammars."""
    output = StructuredOutput("json", json.dumps(PERSON))
    requests = [Request(str(i), [5], GenerationParams(max_tokens=9, structured=output)) for i in range(3)]
    for r, prefix in zip(requests, ['{"name":"', '{"name":"Ro","age":1', ""], strict=True):
        r.grammar = engine.grammars.matcher(output)
        assert r.grammar.consume_tokens(engine.runner.tokenizer.encode(prefix)) if prefix else True
    masks = engine.grammars.masks(requests)
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
        engine.resolve([5, 6], GenerationParams(max_tokens=4, structured=output))
    assert refused.value.param == param


def test_beam_search_and_min_tokens_are_refused_with_a_grammar(engine: Engine) -> None:
    output = StructuredOutput("choice", '["a"]')
    with pytest.raises(InvalidRequestError, match="beam"):
        engine.resolve([5], GenerationParams(max_tokens=4, beam_size=2, structured=output))
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        engine.resolve([5], GenerationParams(max_tokens=4, min_tokens=2, structured=output))
