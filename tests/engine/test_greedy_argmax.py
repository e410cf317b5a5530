"""A step whose sampling requests are all greedy and ask nothing else of the logits takes each row's
argmax from the panel kernel without computing the logits (GeneratorRunner._take_argmax,
Generator.greedy_ids, model/csrc/panel_linear.c panel_argmax): the same tokens as the plain path
(the logits a block of rows at a time, then the top-k kernel), with drafts verified and without, on
the shipped generator (a trained model)."""

import pytest
import torch

from decoding.sampling_params import GREEDY, SamplingParams
from loading.checkpoint import DEFAULT_GENERATOR
from model.generator import Generator
from model.packed_linear import PackedLinear
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from tests.engine.helpers import deltas_of

PROMPTS = [
    "ROMEO:\nWhat light is this? ROMEO:\nWhat light is this?\nROMEO:\nWhat",
    "First Citizen:\nWe are accounted poor citizens.\nFirst Citizen:\nWe are",
    "To be, or not to be, that is the question.",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
    "JULIET:\n",
]


def generate(params: list[GenerationParams], speculative_tokens: int) -> dict[str, list[int]]:
    engine = Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=8, num_speculative_tokens=speculative_tokens, block_size=4))
    assert isinstance(engine.runner.model, Generator)
    head = engine.runner.model.output_projection or engine.runner.model.lm_head
    assert isinstance(head, PackedLinear)  # what the kernel projects: the test runs it
    requests = [Request(str(i), engine.runner.encode_prompt(PROMPTS[i % len(PROMPTS)]), p) for i, p in enumerate(params)]
    deltas = deltas_of(engine, {0: requests[:3], 2: requests[3:]})
    return {request_id: [t for d in ds for t in d.token_ids] for request_id, ds in deltas.items()}


@pytest.fixture
def argmax_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each step that took the argmax path (Generator.greedy_ids answering)."""
    calls: list[int] = []
    greedy_ids = Generator.greedy_ids

    def counted(self: Generator, hidden: torch.Tensor) -> torch.Tensor | None:
        ids = greedy_ids(self, hidden)
        if ids is not None:
            calls.append(ids.shape[0])
        return ids

    monkeypatch.setattr(Generator, "greedy_ids", counted)
    return calls


@pytest.mark.parametrize("speculative_tokens", [0, 4])
def test_greedy_steps_take_the_argmax_without_logits_and_make_the_plain_paths_tokens(
    speculative_tokens: int, argmax_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    params = [GenerationParams(max_tokens=40, sampling=GREEDY)] * 4 + [GenerationParams(max_tokens=25, sampling=GREEDY, ignore_eos=True)]
    fast = generate(params, speculative_tokens)
    assert len(argmax_calls) > 10
    if speculative_tokens:
        assert max(argmax_calls) > len(params)  # rows of drafts verified by the argmax
    with monkeypatch.context() as plain:
        plain.setattr(Generator, "greedy_ids", lambda self, hidden: None)
        assert generate(params, speculative_tokens) == fast
    assert all(len(tokens) > 0 for tokens in fast.values())


def test_a_batch_that_samples_logprobs_or_holds_eos_back_takes_the_plain_path(argmax_calls: list[int]) -> None:
    for one in (
        GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=1)),
        GenerationParams(max_tokens=12, sampling=GREEDY, logprobs=1),
        GenerationParams(max_tokens=12, sampling=GREEDY, min_tokens=12),
        GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3)),
    ):
        argmax_calls.clear()
        generate([one], 0)
        assert argmax_calls == [], one
