"""Sampling controls in the engine, on the shipped generator: logit bias forces or forbids a
token, and a token id outside the vocabulary is refused before anything runs; min-p 1.0 is greedy."""

import pytest

from decoding.sampling_params import SamplingParams
from loading.checkpoint import DEFAULT_GENERATOR
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.errors import InvalidRequestError
from service.engine.request import GenerationParams, Request
from tests.engine.helpers import run


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=4))


def tokens(engine: Engine, prompt: str, sampling: SamplingParams) -> list[int]:
    request = Request("r", engine.runner.encode_prompt(prompt), GenerationParams(max_tokens=6, sampling=sampling))
    return run(engine, {0: [request]})["r"]


def test_logit_bias_forces_and_forbids_tokens(engine: Engine) -> None:
    plain = tokens(engine, "ROMEO:", SamplingParams(temperature=0.0))
    forced = 100 if plain[0] != 100 else 101
    assert tokens(engine, "ROMEO:", SamplingParams(temperature=0.0, logit_bias=((forced, 100.0),))) == [forced] * 6
    forbidden = tokens(engine, "ROMEO:", SamplingParams(temperature=0.0, logit_bias=((plain[0], -100.0),)))
    assert forbidden[0] != plain[0]
    sampled = tokens(engine, "ROMEO:", SamplingParams(temperature=1.0, seed=3, logit_bias=((forced, 100.0),)))
    assert sampled == [forced] * 6  # sampling too: the bias comes before temperature


def test_logit_bias_outside_the_vocabulary_is_refused(engine: Engine) -> None:
    outside = engine.runner.tokenizer.vocab_size
    params = GenerationParams(max_tokens=2, sampling=SamplingParams(logit_bias=((outside, 1.0),)))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request(Request("r", engine.runner.encode_prompt("ROMEO:"), params))
    assert not engine.has_work


def test_min_p_one_keeps_only_the_most_likely_token(engine: Engine) -> None:
    """min_p 1.0 drops every token less likely than the most likely one: sampling becomes greedy."""
    greedy = tokens(engine, "ROMEO:", SamplingParams(temperature=0.0))
    assert all(tokens(engine, "ROMEO:", SamplingParams(temperature=1.5, seed=seed, min_p=1.0)) == greedy for seed in range(3))
    assert any(tokens(engine, "ROMEO:", SamplingParams(temperature=1.5, seed=seed)) != greedy for seed in range(3))
