"""The row top-k kernel (decoding/top_k_cpu.py) against torch's plain operations, and a beam step
from each row's top 2K against the step over the whole vocabulary."""

import pytest
import torch
import torch.nn.functional as F

from decoding import top_k_cpu
from decoding.beam_search import BeamState, step_beams
from decoding.top_k_cpu import greedy_ids, row_top_k
from tests.model.kernel_paths import kernel_or_torch


@pytest.fixture(params=["kernel", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs on the kernel (where it builds) and on torch's path."""
    return kernel_or_torch(request, monkeypatch, "kernel")


def logits_with_edges(rows: int, vocab: int) -> torch.Tensor:
    """Random logits with suppressed ids (-inf), a row of -inf only and a row of tied maxima."""
    logits = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[:, 2] = float("-inf")
    logits[0] = float("-inf")
    logits[1, [vocab // 3, vocab // 2, vocab - 1]] = 50.0  # ties: the lowest id first
    return logits


@pytest.mark.parametrize(("vocab", "k"), [(8000, 8), (8001, 1), (100, 5), (13, 13), (200, 64)])
def test_top_k_and_log_sum_exp_equal_torch(path: str, vocab: int, k: int) -> None:
    logits = logits_with_edges(6, vocab)
    values, ids, lse = row_top_k(logits, k)
    assert lse is not None
    torch.testing.assert_close(values, logits.topk(k, dim=-1).values, rtol=0, atol=0)
    assert torch.equal(logits.gather(1, ids), values)
    tied = [vocab // 3, vocab // 2, vocab - 1][:k]
    assert ids[1, : len(tied)].tolist() == tied or path == "torch"  # torch orders ties as it likes
    assert lse[0] == float("-inf")
    torch.testing.assert_close(lse[1:], torch.logsumexp(logits[1:], dim=-1), rtol=1e-6, atol=1e-6)
    assert row_top_k(logits, k, with_lse=False)[2] is None


def test_rows_are_read_in_place_in_the_order_given(path: str) -> None:
    logits = logits_with_edges(7, 300)
    rows = torch.tensor([5, 1, 1, 6, 3])
    got = row_top_k(logits, 4, rows=rows)
    expected = row_top_k(logits.index_select(0, rows), 4)
    for a, b in zip(got, expected, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


def test_greedy_ids_are_argmax_with_its_ties(path: str) -> None:
    logits = logits_with_edges(5, 8000)
    logits[0, 7] = 0.0  # not a row of -inf only: argmax picks among finite values
    assert torch.equal(greedy_ids(logits), logits.argmax(-1))


def test_greedy_ids_read_nan_as_minus_infinity_and_infinity_as_the_largest_float(path: str) -> None:
    """A poisoned row (NaN, +inf; found in the kernel's one pass, else by a max of torch's) gets the
    argmax of its cleaned copy; the rows beside it theirs."""
    logits = logits_with_edges(6, 8000)
    logits[3, [5, 6000]] = float("nan")
    logits[4, [100, 7000]] = float("inf")  # the first of the two
    logits[5, :] = float("nan")
    cleaned = logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    assert torch.equal(greedy_ids(logits), cleaned.argmax(-1))
    assert greedy_ids(logits)[4] == 100
    assert torch.equal(greedy_ids(logits[:2]), logits[:2].argmax(-1))  # no poisoned row: no copy needed


def step_over_the_vocabulary(states: list[BeamState], logits: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """The plain beam step: every beam x token candidate scored, one top-2K per sentence, walked
    best first: an eos among the K best ends a hypothesis, the first K others live on."""
    log_probs = F.log_softmax(logits, dim=-1)
    moves, first = [], 0
    for state in states:
        K, V = state.beam_size, logits.shape[-1]
        candidates = (torch.tensor(state.scores)[:, None] + log_probs[first : first + K]).view(-1)  # (K x V,)
        scores, index = candidates.topk(2 * K)
        parents, tokens, live_scores, endings = [], [], [], []
        for rank, (score, flat) in enumerate(zip(scores.tolist(), index.tolist(), strict=True)):
            parent, token = divmod(flat, V)
            if token == state.eos_id:
                if rank < K:
                    endings.append((parent, score))
            elif len(parents) < K:
                parents.append(parent)
                tokens.append(token)
                live_scores.append(score)
        state.advance(parents, tokens, live_scores, endings)
        moves.append((parents, tokens))
        first += K
    return moves


def test_a_beam_step_from_each_rows_top_2k_equals_the_step_over_the_vocabulary(path: str) -> None:
    generator = torch.Generator().manual_seed(0)
    beam_sizes = [4, 2, 4, 1]
    fast, plain = ([BeamState(k, 20, eos_id=3) for k in beam_sizes] for _ in range(2))
    for _ in range(6):  # steps: the first expands beam 0 only, later ones every live beam, some ending at eos
        logits = 2 * torch.randn(sum(beam_sizes), 500, generator=generator)
        logits[:, 3] += 1.0  # eos often among the best
        logits[:, 5] = float("-inf")  # a suppressed id
        shuffled = torch.randperm(len(logits), generator=generator)  # the beams' rows among a step's, read in place
        in_step = torch.empty_like(logits).index_copy_(0, shuffled, logits)
        assert step_beams(fast, in_step, shuffled) == step_over_the_vocabulary(plain, logits)
        for a, b in zip(fast, plain, strict=True):
            assert a.sequences == b.sequences and len(a.finished) == len(b.finished)
            torch.testing.assert_close(torch.tensor(a.scores), torch.tensor(b.scores), rtol=0, atol=1e-5)


def test_the_draw_kernel_computes_torchs_weights_totals_and_tokens() -> None:
    """row_draw against the same draw in torch's operations (softmax weights relative to the row's
    largest, a cumulative sum, the first to pass uniform x total): weights within 1e-6 and totals
    within 1e-5 (relative), the same token wherever the target is not within rounding of a boundary
    between two, never a -inf logit; rows with a NaN or +inf logit, or of -inf only, get a NaN total."""
    if top_k_cpu.draw_kernel() is None:
        pytest.skip("the CPU kernels are off")
    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 37, 1024, 3 * 1024 + 100, 49_152):
        logits = 4 * torch.randn(64, vocab, generator=generator)
        logits[:, : vocab // 10] = float("-inf")  # suppressed ids
        logits[1, vocab // 2 :] = float("-inf")  # a chunk of -inf only
        logits[3, vocab - 1] = float("nan")
        logits[4, 0] = float("inf")
        logits[5] = float("-inf")
        temperature = torch.tensor([0.3, 0.7, 1.0, 1.5] * 16)
        uniform = torch.rand(64, generator=generator)
        uniform[6], uniform[7] = 0.0, 1.0  # the ends of the range
        drawn = top_k_cpu.row_draw(logits, temperature, uniform)
        assert drawn is not None
        tokens, weights, totals = drawn
        poisoned = [3, 4, 5]
        assert torch.isnan(totals[poisoned]).all()
        weights_torch = ((logits - logits.amax(-1, keepdim=True)) / temperature[:, None]).exp()  # (S, V)
        cumulative = weights_torch.cumsum(-1)
        for row in sorted(set(range(64)) - set(poisoned)):
            if not bool(torch.isfinite(logits[row]).any()):  # every logit suppressed (a vocabulary of 1)
                assert torch.isnan(totals[row])
                continue
            total = float(cumulative[row, -1])
            assert abs(float(totals[row]) - total) <= 1e-5 * total, (vocab, row)
            token = int(tokens[row])
            assert torch.isfinite(logits[row, token]), (vocab, row)
            torch.testing.assert_close(weights[row], weights_torch[row, token], rtol=1e-6, atol=0)
            target = float(uniform[row]) * total
            expected = min(int(torch.searchsorted(cumulative[row], torch.tensor([target]), right=True)), vocab - 1)
            if token != expected:  # only a rounding tie at the boundary between them
                boundary = float(cumulative[row, min(token, expected)])
                assert abs(boundary - target) <= 1e-5 * total, (vocab, row, token, expected)
