"""Decoding by full recomputation: the plain path that cached decoding is checked against.

Both follow the model's config: the translator's decoder starts from start_id and stops at eos_id,
and suppressed_ids are never generated.
"""

import torch
from torch import Tensor

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
