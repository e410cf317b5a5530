"""Offline translation of many sentences: sorted by length, batched, greedy or beam search."""

import torch
from torch import Tensor

from decoding.beam_search import beam_search
from decoding.sampling import suppress, suppressed_index
from loading.tokenizer import TextTokenizer
from model.kv_cache import KVCache
from model.masks import padding_mask
from model.translator import Translator


def max_new_tokens_for(source_length: int, max_len: int) -> int:
    """Default target length cap for a source of source_length tokens (eos included); German runs
    longer than English. The service uses the same default."""
    return min(2 * source_length + 10, max_len - 1)


def pad_batch(sequences: list[list[int]], pad_id: int) -> Tensor:
    """Right-pads with pad_id (the model's) into (B, longest)."""
    out = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


@torch.no_grad()
def greedy_translate(model: Translator, src: Tensor, max_new_tokens: int | list[int]) -> list[list[int]]:
    """Greedy translation of src (B, S), right-padded with the model's pad_id, with the KV cache;
    the cross-attention keys/values are computed once. max_new_tokens: one limit for all, or one
    per sentence. Returns each sentence's ids without the start token and eos; the config's
    suppressed_ids are never generated."""
    B = src.shape[0]
    c = model.config
    limits = torch.tensor(max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * B, device=src.device)
    limits = limits.clamp(max=c.max_len - 1)  # (B,)
    max_new_tokens = int(limits.max())
    memory_kv = model.cross_key_values(model.encode(src))
    src_mask = padding_mask(src, c.pad_id)
    cache = KVCache(len(model.decoder_layers), B, c.n_heads, max_new_tokens + 1, c.head_dim, src.device, memory_kv[0][0].dtype)
    slots = torch.arange(B, device=src.device)
    suppressed = suppressed_index(c.suppressed_ids, src.device)
    tokens = torch.full((B,), c.start_id, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    out: list[list[int]] = [[] for _ in range(B)]
    for t in range(max_new_tokens):
        positions = torch.full((B, 1), t, device=src.device)
        logits = model.decode(tokens[:, None], memory_kv, src_mask, positions, list(cache.views(slots, positions, t + 1)), t + 1)
        tokens = suppress(logits[:, -1], suppressed).argmax(-1).masked_fill(done, c.eos_id)  # (B,)
        for i, token in enumerate(tokens.tolist()):
            if not done[i] and token != c.eos_id:
                out[i].append(token)
        done |= (tokens == c.eos_id) | (limits <= t + 1)
        if bool(done.all()):
            break
    return out


def translate_sentences(
    model: Translator,
    tokenizer: TextTokenizer,
    sentences: list[str],
    beam_size: int = 1,
    length_penalty: float = 1.0,
    batch_size: int = 64,
    n_best: int = 1,
) -> list[list[str]]:
    """n_best translations of each sentence (greedy when beam_size is 1), in input order."""
    device = next(model.parameters()).device
    c = model.config
    ids = [s[: c.max_len - 1] + [c.eos_id] for s in tokenizer.encode_batch(sentences)]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: list[list[str]] = [[] for _ in sentences]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        src = pad_batch([ids[i] for i in chunk], c.pad_id).to(device)
        limits = [max_new_tokens_for(len(ids[i]), c.max_len) for i in chunk]
        if beam_size == 1:
            outputs = [[tokens] for tokens in greedy_translate(model, src, limits)]
        else:
            outputs = [[h.tokens for h in hyps] for hyps in beam_search(model, src, beam_size, limits, length_penalty, n_best)]
        for i, hyps in zip(chunk, outputs, strict=True):
            results[i] = [tokenizer.decode(tokens) for tokens in hyps]
    return results
