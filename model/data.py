"""Training data: Multi30k sentence pairs in token-budget batches, Tiny Shakespeare windows."""

import gzip
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
VALIDATION_FRACTION = 0.1  # the generator's own validation split: the last 10% of train.txt


def read_lines(path: Path) -> list[str]:
    """One sentence a line, from a plain or .gz file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def split_shakespeare(text: str) -> tuple[str, str]:
    """(train, validation): validation is the last VALIDATION_FRACTION of the text."""
    cut = int(len(text) * (1 - VALIDATION_FRACTION))
    return text[:cut], text[cut:]


@dataclass
class PairBatch:
    src: Tensor  # (B, S) source ids ending with eos, right-padded
    tgt_in: Tensor  # (B, T) bos + target ids
    tgt_out: Tensor  # (B, T) target ids + eos
    n_tokens: int  # real target tokens


def encode_pairs(tokenizer: Tokenizer, sources: list[str], targets: list[str], max_len: int) -> list[tuple[list[int], list[int]]]:
    """Token id pairs, dropping pairs longer than max_len (with bos/eos)."""
    src_ids = tokenizer.encode_batch(sources)
    tgt_ids = tokenizer.encode_batch(targets)
    return [(s, t) for s, t in zip(src_ids, tgt_ids, strict=True) if 0 < len(s) < max_len and 0 < len(t) < max_len]


def pad(sequences: list[list[int]]) -> Tensor:
    """Right-pads with PAD_ID into (B, max_len)."""
    out = torch.full((len(sequences), max(len(s) for s in sequences)), PAD_ID, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def token_budget_batches(pairs: list[tuple[list[int], list[int]]], max_tokens: int, seed: int) -> list[list[int]]:
    """Indices of pairs grouped by similar length, each group padded to at most max_tokens source
    tokens; the order of groups is shuffled by seed (one seed per epoch)."""
    rng = random.Random(seed)
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1]), rng.random()))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = max(len(pairs[i][0]), len(pairs[i][1])) + 1
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate_pairs(pairs: list[tuple[list[int], list[int]]]) -> PairBatch:
    return PairBatch(
        src=pad([s + [EOS_ID] for s, _ in pairs]),
        tgt_in=pad([[BOS_ID] + t for _, t in pairs]),
        tgt_out=pad([t + [EOS_ID] for _, t in pairs]),
        n_tokens=sum(len(t) + 1 for _, t in pairs),
    )


def lm_windows(ids: Tensor, block: int, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows of a token stream: inputs (B, block) and next-token targets (B, block)."""
    starts = torch.randint(0, len(ids) - block - 1, (batch_size,), generator=generator)
    windows = torch.stack([ids[s : s + block + 1] for s in starts.tolist()])  # (B, block + 1)
    return windows[:, :-1], windows[:, 1:]
