"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p (nucleus), after
the penalties on tokens already seen (presence, frequency and repetition, as vLLM applies them)
and OpenAI's logit bias.

Each request carries its own torch.Generator, so a seeded request draws the same tokens
whatever else shares its batch.
"""

import torch
from torch import Tensor

from model.sampling_params import SamplingParams


def filter_logits(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Rows of logits (S, V), already divided by their temperature, with the tokens outside each
    row's top-k (0: all) and top-p nucleus at -inf; the most likely token always stays. Batched:
    one sort for every row, and none when no row filters."""
    V = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)  # (S,)
    if bool((k == V).all()) and bool((top_p >= 1.0).all()):
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)  # (S, V)
    outside = torch.arange(V, device=logits.device)[None] >= k[:, None]  # (S, V): past the row's top-k
    ordered = ordered.masked_fill(outside, float("-inf"))
    probs = ordered.softmax(-1)
    nucleus = top_p[:, None] < 1.0  # rows that filter by mass (at 1.0 rounding must not drop the tail)
    outside |= nucleus & (probs.cumsum(-1) - probs >= top_p[:, None])  # until the mass before a token reaches top_p
    return logits.masked_fill(outside.scatter(1, order, outside), float("-inf"))


def adjust_logits(logits: Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> Tensor:
    """One sequence's next-token logits (V,) with `params`' penalties, then its logit bias, as a new tensor."""
    vocab = logits.shape[-1]
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=logits.device)] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=vocab)[:vocab].float()  # (V,)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        logits = logits.index_add(0, torch.tensor(ids, device=logits.device), torch.tensor(biases, device=logits.device))
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

    Greedy rows by one argmax; the sampled rows together: temperature, top-k and top-p as batched
    tensor operations, then one uniform draw per row from its own generator (a seeded row draws
    the same whatever shares its batch), inverted through the row's cumulative probabilities.
    NaN or infinite logits (a poisoned row) fall back to the row's argmax of the finite values.
    """
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    tokens = logits.argmax(-1)  # (B,)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    index = torch.tensor(rows, device=device)
    temperature = torch.tensor([params[i].temperature for i in rows], device=device)
    top_k = torch.tensor([params[i].top_k for i in rows], device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], device=device)
    probs = filter_logits(logits.index_select(0, index) / temperature[:, None], top_k, top_p).softmax(-1)  # (S, V)
    # Draws on the CPU generators, so the same seed gives the same token on every device.
    uniform = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(device)  # (S,)
    cumulative = probs.cumsum(-1)  # (S, V)
    drawn = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    drawn = torch.where(probs.gather(1, drawn[:, None])[:, 0] > 0, drawn, probs.argmax(-1))  # never a token of probability 0
    finite = torch.isfinite(probs).all(-1)  # (S,)
    return tokens.index_put((index,), torch.where(finite, drawn, tokens.index_select(0, index)))
