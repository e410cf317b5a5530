import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from decoding.sampling import SEARCH_CHUNK, adjust_logits, filter_logits, sample_next
from decoding.sampling_params import SamplingParams
from tests.model.kernel_paths import kernel_or_torch


@pytest.fixture(params=["kernel", "torch"])
def draw_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test of the draw runs on the C kernel's (decoding/top_k_cpu.py row_draw, where it builds) and on torch's."""
    return kernel_or_torch(request, monkeypatch, "draw_kernel")


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7)] + [SamplingParams(temperature=1.0)] * 3
    alone = [int(sample_next(logits[:1], params[:1], [torch.Generator().manual_seed(7)])[0]) for _ in range(3)]
    batched = [int(sample_next(logits, params, [torch.Generator().manual_seed(7), None, None, None])[0]) for _ in range(3)]
    assert alone == batched


def test_greedy_and_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert int(sample_next(logits, [SamplingParams(temperature=0.0)], [None])[0]) == 1
    top2 = filter_logits(logits[:1], torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))[0]
    assert torch.isinf(top2[[0, 2]]).all() and torch.isfinite(top2[[1, 3]]).all()
    nucleus = filter_logits(torch.tensor([[10.0, 0.0, 0.0, 0.0]]), torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]))[0]
    assert torch.isfinite(nucleus).tolist() == [True, False, False, False]
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, [SamplingParams(temperature=1.0, top_k=2)], [g])[0]) for _ in range(50)}
    assert draws <= {1, 3} and len(draws) == 2


def test_nan_logits_are_never_drawn(draw_path: str) -> None:
    logits = torch.tensor([[float("nan"), 1.0, 5.0, float("nan")]])
    assert int(sample_next(logits, [SamplingParams(temperature=0.1)], [None])[0]) == 2  # token 1: probability e^-40


def plain_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The plain path, one row (V,) at a time: NaN at -inf and +inf at the largest float first, then
    the filters, then the inverse of the cumulative probabilities at one uniform of the generator."""
    u = torch.rand(1, generator=generator)
    if params.greedy:
        return int(logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max).argmax())
    clean = logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    filtered = filter_logits(
        clean[None] / params.temperature, torch.tensor([params.top_k]), torch.tensor([params.top_p]), torch.tensor([params.min_p])
    )
    probs = filtered[0].softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        return int(clean.argmax())
    cumulative = probs.cumsum(-1)
    token = min(int(torch.searchsorted(cumulative, u * cumulative[-1], right=True)), len(probs) - 1)
    return token if probs[token] > 0 else int(probs.argmax())


def test_batched_sampling_draws_what_the_plain_path_draws(draw_path: str) -> None:
    """Rows of every kind in one batch (greedy, temperature, top-k, top-p, min-p; some with NaN or
    +inf logits) draw, seed for seed, the token the plain one-row path draws."""
    torch.manual_seed(0)
    for trial in range(200):
        logits = torch.randn(6, 300) * 3
        if trial % 3 == 0:
            logits[1, 5] = float("nan")
        if trial % 5 == 0:
            logits[2, 7] = float("inf")
        if trial % 4 == 0:
            logits[4, :] = float("-inf")
            logits[4, 3] = 0.0
        params = [
            SamplingParams(
                temperature=(0.0, 0.7, 1.0, 1.3)[(trial + i) % 4],
                top_k=(0, 5)[(trial + i) % 2],
                top_p=(1.0, 0.8)[(trial // 2 + i) % 2],
                min_p=(0.0, 0.1)[(trial // 3 + i) % 2],
            )
            for i in range(6)
        ]
        seeds = [trial * 10 + i for i in range(6)]
        batched = sample_next(
            logits, params, [None if p.greedy else torch.Generator().manual_seed(s) for p, s in zip(params, seeds, strict=True)]
        )
        plain = [plain_sample(row, p, torch.Generator().manual_seed(s)) for row, p, s in zip(logits, params, seeds, strict=True)]
        assert batched.tolist() == plain, trial


def test_greedy_rows_skip_the_cleanup_only_when_no_row_is_poisoned() -> None:
    greedy = SamplingParams(temperature=0.0)
    wide = torch.randn(3, 8000)  # the CPU kernel's width (decoding/top_k_cpu.py)
    wide[1, 17] = float("nan")
    wide[2, 4000] = float("inf")
    wide[0, :] = float("-inf")
    expected = [0, int(wide[1].nan_to_num(nan=float("-inf")).argmax()), 4000]
    assert sample_next(wide, [greedy] * 3, [None] * 3).tolist() == expected
    clean = torch.randn(4, 8000)
    assert torch.equal(sample_next(clean, [greedy] * 4, [None] * 4), clean.argmax(-1))
    assert sample_next(clean[:0], [], []).shape == (0,)


def test_repetition_penalty_is_transformers_on_the_prompt_and_output_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(50) * 3  # positive and negative logits
    prompt, output = [3, 7, 7, 11], [20, 3, 42]
    ours = adjust_logits(logits[None], [SamplingParams(repetition_penalty=1.3)], [prompt], [output])[0]
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.unsqueeze(0).clone())[0]
    assert torch.allclose(ours, theirs)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_are_openais_on_the_output_tokens() -> None:
    logits = torch.zeros(8)
    ours = adjust_logits(logits[None], [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[1, 1, 2]], [[4, 4, 4, 5]])[0]
    expected = torch.zeros(8)
    expected[4] = -(0.25 * 3 + 0.5)  # three times: frequency x 3, presence once
    expected[5] = -(0.25 * 1 + 0.5)
    assert torch.equal(ours, expected)  # the prompt's tokens (1, 2) are not penalised
    assert torch.equal(adjust_logits(logits[None], [SamplingParams(presence_penalty=1.0)], [[1]], [[]])[0], logits)  # nothing generated yet


def test_logit_bias_is_added_after_the_penalties() -> None:
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((1, -100.0), (3, 5.0)))
    assert torch.equal(adjust_logits(logits[None], [params], [[1]], [[]])[0], torch.tensor([1.0, 1.0 - 100.0, -1.0, 5.5]))


def one_row_adjusted(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The plain path, one row at a time (what the batched adjustment replaced)."""
    if params.repetition_penalty != 1.0:
        for token in set(prompt + output):
            value = logits[token]
            logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    for token, bias in params.logit_bias:
        logits[token] += bias
    return logits


def test_the_batched_adjustment_equals_the_plain_one_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, logit_bias=((3, 2.0), (39, -100.0))),
        SamplingParams(repetition_penalty=0.8, presence_penalty=1.0, logit_bias=((0, 1.5),)),
        SamplingParams(frequency_penalty=2.0),
    ]
    prompts = [[1, 2, 2], [5], [7, 8], [3, 3, 9], []]
    outputs = [[2, 4], [6, 6], [8, 8, 8, 10], [], [11, 11]]
    batched = adjust_logits(logits, params, prompts, outputs)
    for row in range(5):
        expected = one_row_adjusted(logits[row].clone(), params[row], prompts[row], outputs[row])
        assert torch.allclose(batched[row], expected, atol=1e-6), f"row {row}"


def one_row_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The plain path, one row at a time (what the batched filter replaced): min-p, top-k, then the nucleus."""
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def test_the_batched_filter_equals_the_plain_one_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    top_k, top_p, min_p = [0, 5, 0, 40, 300, 1], [1.0, 1.0, 0.9, 0.5, 0.99, 0.3], [0.0, 0.05, 0.2, 0.0, 0.01, 0.5]
    batched = filter_logits(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    for row, (k, p, m) in enumerate(zip(top_k, top_p, min_p, strict=True)):
        assert torch.equal(batched[row], one_row_filter(logits[row], k, p, m)), f"row {row}"


def test_draws_follow_the_filtered_distribution(draw_path: str) -> None:
    """4,000 seeded draws of a top-k 3 row at temperature 2: each token's share within 0.03 of its probability."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    params = SamplingParams(temperature=2.0, top_k=3)
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.cat([sample_next(logits, [params], [generator]) for _ in range(4000)]), minlength=5)
    expected = torch.tensor([2.0, 1.0, float("-inf"), float("-inf"), 3.0]).div(2.0).softmax(-1)
    assert counts[2] == counts[3] == 0
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_the_chunked_inverse_cdf_draws_what_one_cumulative_sum_over_the_row_draws(draw_path: str) -> None:
    """The optimised draws (chunk sums, then one chunk's cumulative sum: torch's, and the C
    kernel's in two passes over a row) against the plain inverse CDF (softmax, a cumulative sum
    over the whole row, searchsorted), same uniforms: the same token wherever the target is not
    within float rounding of a boundary between two tokens. Vocabularies below, at and past a
    multiple of the chunk, suppressed ids at -inf, temperatures and filters."""
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.5, min_p=0.05),
    ]
    temperature = torch.tensor([p.temperature for p in params])
    top_k, top_p = torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    compared = 0
    for vocab in (37, SEARCH_CHUNK, 3 * SEARCH_CHUNK + 100):
        for trial in range(40):
            logits = torch.randn(len(params), vocab) * 4
            logits[:, : vocab // 10] = float("-inf")  # suppressed
            seeds = [1000 * vocab + 10 * trial + i for i in range(len(params))]
            drawn = sample_next(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
            uniform = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(s)) for s in seeds])
            probs = filter_logits(logits / temperature[:, None], top_k, top_p, min_p).softmax(-1)
            cumulative = probs.cumsum(-1)
            target = uniform * cumulative[:, -1]
            plain = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
            for row in range(len(params)):
                if int(drawn[row]) != int(plain[row]):  # only a rounding tie at the boundary between them
                    boundary = cumulative[row, min(int(drawn[row]), int(plain[row]))]
                    assert abs(float(boundary - target[row])) < 1e-5, (vocab, trial, row)
                assert probs[row, drawn[row]] > 0
                compared += 1
    assert compared == 3 * 40 * len(params)
