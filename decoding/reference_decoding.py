"""Decoding by full recomputation: the plain path that cached decoding is checked against.

They follow the model's config: the translator's decoder starts from start_id and stops at eos_id,
and suppressed_ids are never generated.
"""

import torch
from torch import Tensor

from decoding.beam_search import BeamState, Hypothesis, step_beams
from decoding.sampling import suppress, suppressed_index
from model.generator import Generator
from model.masks import padding_mask
from model.translator import Translator


@torch.no_grad()
def greedy_translate_uncached(model: Translator, src: Tensor, max_new_tokens: int) -> list[list[int]]:
    """Greedy translation of a batch src (B, S), right-padded with the model's pad_id, recomputing
    the whole target prefix every step.

    Returns each sentence's target ids, without the start token and eos.
    """
    c = model.config
    memory_kv = model.cross_key_values(model.encode(src))
    src_mask = padding_mask(src, c.pad_id)
    suppressed = suppressed_index(c.suppressed_ids, src.device)
    B = src.shape[0]
    tgt = torch.full((B, 1), c.start_id, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(min(max_new_tokens, c.max_len - 1)):
        next_token = suppress(model.decode(tgt, memory_kv, src_mask)[:, -1], suppressed).argmax(-1)  # (B,)
        next_token = next_token.masked_fill(done, c.eos_id)
        tgt = torch.cat([tgt, next_token[:, None]], dim=1)
        done |= next_token == c.eos_id
        if bool(done.all()):
            break
    out = []
    for row in tgt[:, 1:].tolist():
        out.append(row[: row.index(c.eos_id)] if c.eos_id in row else row)
    return out


@torch.no_grad()
def beam_search_uncached(
    model: Translator, src: Tensor, beam_size: int, max_new_tokens: int, length_penalty: float = 1.0, n_best: int = 1
) -> list[list[Hypothesis]]:
    """Beam search of each sentence of src (B, S), right-padded with the model's pad_id, recomputing
    every beam's whole prefix every step; the bookkeeping (BeamState, step_beams) is the engine's.
    Returns each sentence's n_best hypotheses, best first."""
    c = model.config
    K = beam_size
    memory_kv = [(k.repeat_interleave(K, 0), v.repeat_interleave(K, 0)) for k, v in model.cross_key_values(model.encode(src))]
    src_mask = padding_mask(src, c.pad_id).repeat_interleave(K, 0)  # (B K, 1, 1, S): a row per beam
    suppressed = suppressed_index(c.suppressed_ids, src.device)
    states = [BeamState(K, min(max_new_tokens, c.max_len - 1), c.eos_id, length_penalty) for _ in range(src.shape[0])]
    while active := [i for i, state in enumerate(states) if not state.done]:
        rows = torch.tensor([i * K + k for i in active for k in range(K)], device=src.device)
        prefixes = [[c.start_id, *sequence] for i in active for sequence in states[i].sequences]  # one length: a step each
        tgt = torch.tensor(prefixes, device=src.device)  # (A K, t + 1)
        logits = model.decode(tgt, [(k[rows], v[rows]) for k, v in memory_kv], src_mask[rows])[:, -1]  # (A K, V)
        step_beams([states[i] for i in active], suppress(logits.float(), suppressed))
    return [state.best(n_best) for state in states]


@torch.no_grad()
def generate_greedy_uncached(model: Generator, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt, recomputing the whole sequence every step. Runs the full
    max_new_tokens (eos included, and past it: callers cut at the model's eos_id)."""
    device = next(model.parameters()).device
    suppressed = suppressed_index(model.config.suppressed_ids, device)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    out: list[int] = []
    for _ in range(max_new_tokens):
        next_token = int(suppress(model(ids)[0, -1], suppressed).argmax())
        out.append(next_token)
        ids = torch.cat([ids, torch.tensor([[next_token]], device=device)], dim=1)
    return out
