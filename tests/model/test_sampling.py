import torch
from transformers import RepetitionPenaltyLogitsProcessor

from model.sampling import SamplingParams, adjust_logits, filter_logits, sample_next


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7)] + [SamplingParams(temperature=1.0)] * 3
    alone = [int(sample_next(logits[:1], params[:1], [torch.Generator().manual_seed(7)])[0]) for _ in range(3)]
    batched = [int(sample_next(logits, params, [torch.Generator().manual_seed(7), None, None, None])[0]) for _ in range(3)]
    assert alone == batched


def test_greedy_and_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert int(sample_next(logits, [SamplingParams(temperature=0.0)], [None])[0]) == 1
    top2 = filter_logits(logits[0], top_k=2, top_p=1.0)
    assert torch.isinf(top2[[0, 2]]).all() and torch.isfinite(top2[[1, 3]]).all()
    nucleus = filter_logits(torch.tensor([10.0, 0.0, 0.0, 0.0]), top_k=0, top_p=0.5)
    assert torch.isfinite(nucleus).tolist() == [True, False, False, False]
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, [SamplingParams(temperature=1.0, top_k=2)], [g])[0]) for _ in range(50)}
    assert draws <= {1, 3} and len(draws) == 2


def test_nan_logits_fall_back_to_argmax() -> None:
    logits = torch.tensor([[float("nan"), 1.0, 5.0, float("nan")]])
    assert int(sample_next(logits, [SamplingParams(temperature=1.0)], [None])[0]) == 2


def test_repetition_penalty_is_transformers_on_the_prompt_and_output_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(50) * 3  # positive and negative logits
    prompt, output = [3, 7, 7, 11], [20, 3, 42]
    ours = adjust_logits(logits, SamplingParams(repetition_penalty=1.3), prompt, output)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.unsqueeze(0).clone())[0]
    assert torch.allclose(ours, theirs)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_are_openais_on_the_output_tokens() -> None:
    logits = torch.zeros(8)
    ours = adjust_logits(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 1, 2], [4, 4, 4, 5])
    expected = torch.zeros(8)
    expected[4] = -(0.25 * 3 + 0.5)  # three times: frequency x 3, presence once
    expected[5] = -(0.25 * 1 + 0.5)
    assert torch.equal(ours, expected)  # the prompt's tokens (1, 2) are not penalised
    assert torch.equal(adjust_logits(logits, SamplingParams(presence_penalty=1.0), [1], []), logits)  # nothing generated yet


def test_logit_bias_is_added_after_the_penalties() -> None:
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((1, -100.0), (3, 5.0)))
    assert torch.equal(adjust_logits(logits, params, [1], []), torch.tensor([1.0, 1.0 - 100.0, -1.0, 5.5]))
