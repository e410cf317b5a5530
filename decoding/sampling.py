"""Choosing the next token: greedy, or sampling with temperature, min-p, top-k and top-p (nucleus), after
the penalties on tokens already seen (presence, frequency and repetition, as vLLM applies them)
and OpenAI's logit bias.

Each request carries its own torch.Generator, so a seeded request draws the same tokens
whatever else shares its batch.
"""

import torch
from torch import Tensor

from decoding.sampling_params import SamplingParams
from decoding.top_k_cpu import cleaned_logits, greedy_ids, row_draw


def filter_logits(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Rows of logits (S, V), already divided by their temperature, with at -inf the tokens below
    each row's min-p (their probability under min_p x the most likely one's, as vLLM's), outside
    its top-k (0: all), then outside its top-p nucleus of what is left; the most likely token
    always stays. Batched: one sort for every row, and none when no row filters."""
    V = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)  # (S,)
    if bool((k == V).all()) and bool((top_p >= 1.0).all()) and bool((min_p <= 0.0).all()):
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)  # (S, V)
    outside = torch.arange(V, device=logits.device)[None] >= k[:, None]  # (S, V): past the row's top-k
    if bool((min_p > 0.0).any()):  # a softmax more, only for a batch that asks for min-p
        full = ordered.softmax(-1)  # (S, V): the whole distribution, most likely first
        outside |= full < min_p[:, None] * full[:, :1]
    ordered = ordered.masked_fill(outside, float("-inf"))
    probs = ordered.softmax(-1)
    nucleus = top_p[:, None] < 1.0  # rows that filter by mass (at 1.0 rounding must not drop the tail)
    outside |= nucleus & (probs.cumsum(-1) - probs >= top_p[:, None])  # until the mass before a token reaches top_p
    return logits.masked_fill(outside.scatter(1, order, outside), float("-inf"))


def _row_index(sequences: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """(rows, ids): row i repeated for each id of sequences[i], as index_put_ takes them."""
    rows = torch.tensor([i for i, s in enumerate(sequences) for _ in s], dtype=torch.long, device=device)
    return rows, torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)


def adjust_logits(logits: Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]) -> Tensor:
    """Rows of next-token logits (S, V) with each row's penalties, then its logit bias, as a new
    float tensor; every row at once (one scatter per kind of adjustment): repetition on the
    prompt's and output's tokens, presence and frequency on the output's, the bias added last."""
    logits = logits.float()
    S, V = logits.shape
    device = logits.device
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]  # (S, 1)
    if bool((repetition != 1.0).any()):
        seen = torch.zeros(S, V, dtype=torch.bool, device=device)
        repeated = [
            prompt + output if p.repetition_penalty != 1.0 else [] for p, prompt, output in zip(params, prompts, outputs, strict=True)
        ]
        seen.index_put_(_row_index(repeated, device), torch.tensor(True, device=device))
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]  # (S, 1)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    if any(outputs) and bool(((presence != 0) | (frequency != 0)).any()):
        counts = torch.zeros(S, V, device=device)  # (S, V): each token's count in the row's output
        counts.index_put_(_row_index(outputs, device), torch.tensor(1.0, device=device), accumulate=True)
        logits = logits - frequency * counts - presence * (counts > 0).float()
    biased = [[token for token, _ in p.logit_bias] for p in params]
    if any(biased):
        biases = torch.tensor([bias for p in params for _, bias in p.logit_bias], device=device)
        logits = logits.index_put(_row_index(biased, device), biases, accumulate=True)
    return logits


def suppressed_index(ids: tuple[int, ...], device: torch.device) -> Tensor | None:
    """The never-generated ids (a config's suppressed_ids) as the index `suppress` takes; None when empty."""
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def suppress(logits: Tensor, index: Tensor | None) -> Tensor:
    """logits (..., V) with the ids of index set to -inf, in place (one index_fill_ on the vocab
    dim); unchanged when index is None. Returns logits."""
    return logits if index is None else logits.index_fill_(-1, index, float("-inf"))


def sample_next(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """One next token per row. logits: (B, V) -> (B,) token ids, on the logits' device.

    Greedy rows by one argmax; the sampled rows together: temperature, min-p, top-k and top-p as batched
    tensor operations, then one uniform draw per row from its own generator (a seeded row draws
    the same whatever shares its batch), inverted through the row's cumulative probabilities.
    NaN or infinite logits (a poisoned row) fall back to the row's argmax of the finite values.
    Each pass over a (B, V) tensor counts at this size: the finite rows (all, in practice) take
    no cleaning pass, and the sampled ones no argmax.
    """
    logits = logits.float()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    tokens = greedy_ids(logits) if len(rows) < len(params) else torch.zeros(len(params), dtype=torch.long, device=logits.device)
    if not rows:
        return tokens
    device = logits.device
    index = torch.tensor(rows, device=device)
    sampled = _draw(
        logits if len(rows) == len(params) else logits.index_select(0, index), [params[i] for i in rows], [generators[i] for i in rows]
    )
    return tokens.index_put((index,), sampled)


def _draw(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of logits (S, V), each sampled by its params from one uniform of its generator."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    # Draws on the CPU generators, so the same seed gives the same token on every device.
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)  # (S,)
    drawn, weight, total = _inverse_cdf(logits, temperature, top_k, top_p, min_p, uniform)
    fallback = None
    if not bool(torch.isfinite(total).all()):  # NaN or +inf logits: drawn from the cleaned rows instead
        logits = cleaned_logits(logits)
        drawn, weight, total = _inverse_cdf(logits, temperature, top_k, top_p, min_p, uniform)
        fallback = greedy_ids(logits)  # for a row that stays poisoned (every logit NaN, or overflowing its temperature)
    zero = weight <= 0  # rounding drew a token of probability 0: the row's most likely instead
    if bool(zero.any()):
        drawn = torch.where(zero, logits.nan_to_num(float("-inf")).argmax(-1), drawn)
    return drawn if fallback is None else torch.where(torch.isfinite(total), drawn, fallback)


# The inverse CDF's search: sums of chunks of this many tokens, then a cumulative sum inside the one
# chunk each row's draw falls in (a cumulative sum is a serial pass: over the whole vocabulary it
# cost more than the rest of sampling, `python -m benchmarks.step_cost`).
SEARCH_CHUNK = 1024


def _inverse_cdf(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, uniform: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's draw from softmax(logits / temperature) (S, V), filtered by top-k, top-p and
    min-p: the first token whose cumulative weight exceeds uniform x the row's total weight, with
    weights exp((logit - the row's largest) / temperature). Returns the tokens (S,), their weights
    (0: rounding drew past the last likely token) and the totals (S,) (not finite: a poisoned row)."""
    S, V = logits.shape
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()) or bool((min_p > 0.0).any()):
        logits, temperature = filter_logits(logits / temperature[:, None], top_k, top_p, min_p), torch.ones_like(temperature)
    by_kernel = row_draw(logits, temperature, uniform)  # the same draw in two passes over each row, where the CPU kernel runs
    if by_kernel is not None:
        return by_kernel
    weights = logits - logits.amax(-1, keepdim=True)  # (S, V)
    if bool((temperature != 1.0).any()):
        weights.div_(temperature[:, None])
    weights.exp_()
    whole = V - V % SEARCH_CHUNK
    sums = weights[:, :whole].view(S, whole // SEARCH_CHUNK, SEARCH_CHUNK).sum(-1)  # (S, V // SEARCH_CHUNK)
    if whole < V:
        sums = torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], 1)  # (S, chunks)
    ends = sums.cumsum(-1)  # (S, chunks): the cumulative weight at each chunk's end
    total = ends[:, -1]
    target = uniform * total  # (S,)
    chunk = torch.searchsorted(ends, target[:, None], right=True)[:, 0].clamp(max=ends.shape[1] - 1)  # (S,)
    before = ends.gather(1, (chunk - 1).clamp(min=0)[:, None])[:, 0].masked_fill(chunk == 0, 0.0)  # (S,)
    columns = chunk[:, None] * SEARCH_CHUNK + torch.arange(SEARCH_CHUNK, device=logits.device)  # (S, SEARCH_CHUNK)
    inside = weights.gather(1, columns.clamp(max=V - 1)).masked_fill(columns >= V, 0.0)  # (S, SEARCH_CHUNK)
    cumulative = inside.cumsum(-1) + before[:, None]
    at = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0].clamp(max=SEARCH_CHUNK - 1)  # (S,)
    drawn = (chunk * SEARCH_CHUNK + at).clamp(max=V - 1)
    return drawn, weights.gather(1, drawn[:, None])[:, 0], total
