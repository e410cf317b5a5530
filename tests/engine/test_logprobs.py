"""Logprobs in the engine, on the shipped generator: the prompt's from the prefill (max_tokens 0
scores it alone) and each generated token's from the logits it was sampled from, for requests
batched together, equal the model's log-softmax computed here."""

import pytest
import torch
import torch.nn.functional as F

from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, load_native_checkpoint
from service.engine.config import EngineConfig, TokenLogprob
from service.engine.engine import Engine
from service.engine.errors import InvalidRequestError
from service.engine.request import Delta, GenerationParams, Request
from tests.engine.helpers import deltas_of

PROMPTS = ["ROMEO:\nWhat light through yonder window breaks?", "First Citizen:\nBefore we proceed", "O", "\n"]  # one-token prompts too
TOLERANCE = 1e-4  # the engine's packed linear layers round differently from the plain ones


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=8))


def run(engine: Engine, prompts: list[list[int]], params: GenerationParams) -> list[list[Delta]]:
    """Every prompt submitted at once; each request's deltas."""
    return list(deltas_of(engine, {0: [Request(str(i), ids, params) for i, ids in enumerate(prompts)]}).values())


@torch.no_grad()
def log_softmax_of(ids: list[int]) -> torch.Tensor:
    """(len(ids), V): position t's log-distribution of the next token, by the plain model."""
    model, _ = load_native_checkpoint(DEFAULT_GENERATOR)
    return F.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def test_max_tokens_0_scores_the_prompt_alone_as_the_model_does(engine: Engine) -> None:
    prompts = [engine.runner.encode_prompt(p) for p in PROMPTS]
    deltas = run(engine, prompts, GenerationParams(max_tokens=0, prompt_logprobs=2))
    for ids, (delta,) in zip(prompts, deltas, strict=True):
        assert delta.finish_reason == "length" and delta.token_ids == [] and delta.completion_tokens == 0
        scored = delta.prompt_logprobs
        assert scored is not None and len(scored) == len(ids)
        assert scored[0] == TokenLogprob(ids[0], None)  # nothing predicts the first token
        expected = log_softmax_of(ids)
        for t, entry in enumerate(scored[1:], start=1):
            assert entry.token == ids[t] and abs(entry.logprob - float(expected[t - 1, ids[t]])) <= TOLERANCE  # type: ignore[operator]
            assert [token for token, _ in entry.top] == expected[t - 1].topk(2).indices.tolist()


def test_generated_tokens_logprobs_are_those_they_were_sampled_from(engine: Engine) -> None:
    prompts = [engine.runner.encode_prompt(p) for p in PROMPTS]
    deltas = run(engine, prompts, GenerationParams(max_tokens=10, sampling=GREEDY, logprobs=1))
    for ids, stream in zip(prompts, deltas, strict=True):
        generated = [t for d in stream for t in d.token_ids]
        scored = [s for d in stream for s in d.logprobs or []]
        assert [s.token for s in scored] == generated and len(generated) == 10
        expected = log_softmax_of(ids + generated)[len(ids) - 1 : -1]  # (10, V): each generated token's position
        for row, s in zip(expected, scored, strict=True):
            assert s.logprob is not None and abs(s.logprob - float(row[s.token])) <= TOLERANCE
            assert s.top[0][0] == s.token == int(row.argmax())  # greedy: the most likely token


def test_without_logprobs_none_are_computed_and_max_tokens_0_needs_the_prompt_scored(engine: Engine) -> None:
    (stream,) = run(engine, [engine.runner.encode_prompt("ROMEO:")], GenerationParams(max_tokens=3, sampling=GREEDY))
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in stream)
    with pytest.raises(InvalidRequestError, match="max_tokens must be between 1"):
        engine.add_request(Request("zero", engine.runner.encode_prompt("ROMEO:"), GenerationParams(max_tokens=0)))
