"""Decoding by full recomputation: the plain path that cached decoding is checked against."""

import torch
from torch import Tensor

from model.masks import padding_mask
from model.tokenizer import BOS_ID, EOS_ID
from model.translator import Translator


@torch.no_grad()
def greedy_translate_uncached(model: Translator, src: Tensor, max_new_tokens: int) -> list[list[int]]:
    """Greedy translation of a batch src (B, S), recomputing the whole target prefix every step.

    Returns each sentence's target ids, without bos/eos.
    """
    memory_kv = model.cross_key_values(model.encode(src))
    src_mask = padding_mask(src, model.config.pad_id)
    B = src.shape[0]
    tgt = torch.full((B, 1), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(min(max_new_tokens, model.config.max_len - 1)):
        next_token = model.decode(tgt, memory_kv, src_mask)[:, -1].argmax(-1)  # (B,)
        next_token = next_token.masked_fill(done, EOS_ID)
        tgt = torch.cat([tgt, next_token[:, None]], dim=1)
        done |= next_token == EOS_ID
        if bool(done.all()):
            break
    out = []
    for row in tgt[:, 1:].tolist():
        out.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
    return out


@torch.no_grad()
def generate_greedy_uncached(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt, recomputing the whole sequence every step."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out: list[int] = []
    for _ in range(max_new_tokens):
        next_token = int(model(ids)[0, -1].argmax())
        out.append(next_token)
        ids = torch.cat([ids, torch.tensor([[next_token]])], dim=1)
    return out
