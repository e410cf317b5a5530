"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p (nucleus), after
the penalties on tokens already seen (presence, frequency and repetition, as vLLM applies them)
and OpenAI's logit bias.

Each request carries its own torch.Generator, so a seeded request draws the same tokens
whatever else shares its batch.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means all tokens
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's: logit - frequency_penalty x count - presence_penalty x (count > 0), counts of the
    # generated tokens. transformers' (and vLLM's) repetition_penalty on every token of the prompt
    # and output: a positive logit divided by it, a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether adjust_logits changes anything."""
        penalized = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        return penalized or bool(self.logit_bias)


GREEDY = SamplingParams(temperature=0.0)


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Sets logits outside the top-k / top-p nucleus to -inf. logits: (V,) already divided by temperature."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # the most likely token always stays
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


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
    """One next token per row. logits: (B, V) -> (B,) token ids.

    NaN or infinite logits (a poisoned row) fall back to the row's argmax of the finite values.
    """
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    tokens = logits.argmax(-1)  # (B,)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = filtered.softmax(-1)
        if not bool(torch.isfinite(probs).all()):
            continue
        # Draw on the CPU generator so the same seed gives the same token on every device.
        tokens[row] = torch.multinomial(probs.cpu(), 1, generator=generator).to(tokens.device)[0]
    return tokens
