"""Language-model scoring: total negative log-likelihood of a text, per character and per token."""

import torch
import torch.nn.functional as F

from loading.tokenizer import Tokenizer
from model.generator import Generator
from training.data import pad


@torch.no_grad()
def nats_per_char(model: Generator, tokenizer: Tokenizer, text: str, device: torch.device, batch_size: int = 32) -> dict[str, float]:
    """Scores every token of text but the first, each with at least max_len/2 tokens of context
    (windows of max_len tokens sliding by half a window).

    Per character divides by the characters those tokens cover, so tokenizers compare.
    """
    return stretches_nats_per_char(model, tokenizer, [text], device, batch_size)


@torch.no_grad()
def stretches_nats_per_char(
    model: Generator, tokenizer: Tokenizer, texts: list[str], device: torch.device, batch_size: int = 32
) -> dict[str, float]:
    """nats_per_char over several separate texts: each is scored on its own (no context carried
    over from one to the next), and the totals are summed before dividing."""
    total_nll, total_tokens, scored_chars = 0.0, 0, 0
    for text in texts:
        nll, tokens, chars = _text_nll(model, tokenizer, text, device, batch_size)
        total_nll, total_tokens, scored_chars = total_nll + nll, total_tokens + tokens, scored_chars + chars
    return {
        "nats_per_char": total_nll / scored_chars,
        "nats_per_token": total_nll / total_tokens,
        "nll": total_nll,
        "tokens": float(total_tokens),
        "characters": float(sum(len(t) for t in texts)),
        "scored_characters": float(scored_chars),
    }


def halves_nats_per_char(model: Generator, tokenizer: Tokenizer, halves: dict[str, list[str]], device: torch.device) -> dict[str, float]:
    """stretches_nats_per_char of each half of a validation (its name: its texts, e.g. held-out
    plays), and of all the texts together under "all"."""
    scores = {name: stretches_nats_per_char(model, tokenizer, texts, device) for name, texts in halves.items()}
    nll = sum(s["nll"] for s in scores.values())
    return {**{name: s["nats_per_char"] for name, s in scores.items()}, "all": nll / sum(s["scored_characters"] for s in scores.values())}


def _text_nll(model: Generator, tokenizer: Tokenizer, text: str, device: torch.device, batch_size: int) -> tuple[float, int, int]:
    """(total nll, tokens scored, characters they cover) of one text, as nats_per_char scores it."""
    ids = tokenizer.encode(text)
    window = model.config.max_len
    stride = window // 2
    spans: list[tuple[int, int, int]] = []  # (begin, end, first scored target index)
    scored_upto = 1
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window + 1, len(ids))
        spans.append((begin, end, scored_upto))
        scored_upto = end
        if end == len(ids):
            break
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(spans), batch_size):
        chunk = spans[start : start + batch_size]
        inputs = pad([ids[b : e - 1] for b, e, _ in chunk]).to(device)  # (B, T)
        log_probs = F.log_softmax(model(inputs).float(), dim=-1)  # (B, T, V)
        for row, (begin, end, first) in enumerate(chunk):
            targets = torch.tensor(ids[first:end], device=device)
            positions = torch.arange(first - 1 - begin, end - 1 - begin, device=device)
            total_nll -= float(log_probs[row, positions, targets].sum())
            total_tokens += len(targets)
    first_token_chars = len(tokenizer.piece_bytes(ids[0]).decode("utf-8", errors="replace"))
    return total_nll, total_tokens, len(text) - first_token_chars
