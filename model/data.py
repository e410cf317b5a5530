"""Training data: Multi30k sentence pairs in token-budget batches, Tiny Shakespeare windows."""

import bisect
import gzip
import hashlib
import itertools
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

# The project's data, read where it is (never copied into the repository); SERVING_DATA names
# another folder of the same layout, e.g. a copy carried to a GPU machine (benchmarks/gpu.py).
SHARED_DATA = Path(os.environ.get("SERVING_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
# The generator's validation: VALIDATION_STRETCHES runs of whole speeches, together about
# VALIDATION_FRACTION of train.txt, centred at evenly spaced points; training text stays
# VALIDATION_MARGIN characters (rounded out to whole speeches) away from each stretch.
VALIDATION_FRACTION = 0.1
VALIDATION_STRETCHES = 10
VALIDATION_MARGIN = 512


def read_lines(path: Path) -> list[str]:
    """One sentence a line, from a plain or .gz file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


Span = tuple[int, int]  # character offsets [begin, end)


@dataclass(frozen=True)
class ShakespeareSplit:
    """Disjoint character spans of one text: validation stretches in text order (even-numbered in
    half A, odd-numbered in half B) and the training segments between them."""

    validation: list[Span]
    training: list[Span]

    def half(self, name: str) -> list[Span]:
        """The stretches of half "A" or "B"."""
        return self.validation[{"A": 0, "B": 1}[name] :: 2]

    def describe(self) -> dict[str, object]:
        """The split as training.json records it."""
        return {
            "rule": f"{len(self.validation)} stretches of whole speeches (blank-line separated), {VALIDATION_FRACTION:.0%} "
            f"of the text in all, centred at evenly spaced points; training text kept {VALIDATION_MARGIN} characters "
            "(rounded out to whole speeches) away; half A the even-numbered stretches, half B the odd-numbered",
            "validation_spans": [list(s) for s in self.validation],
            "training_spans": [list(s) for s in self.training],
            "validation_characters": sum(e - b for b, e in self.validation),
            "training_characters": sum(e - b for b, e in self.training),
        }


def speech_starts(text: str) -> list[int]:
    """Offsets where a speech begins (0, and after each run of blank lines), then len(text)."""
    return [0] + [m.end() for m in re.finditer(r"\n\n+", text) if m.end() < len(text)] + [len(text)]


def shakespeare_split(
    text: str, stretches: int = VALIDATION_STRETCHES, fraction: float = VALIDATION_FRACTION, margin: int = VALIDATION_MARGIN
) -> ShakespeareSplit:
    """The validation stretches and training segments of text; a function of the text alone.

    Stretch i starts at the first speech start at or after the point (i + 1/2) * len / stretches
    less half a stretch, and ends at the first speech start fraction * len / stretches later.
    ValueError if the stretches and margins do not fit apart (too short a text).
    """
    starts = speech_starts(text)

    def at_or_after(offset: float) -> int:
        return starts[min(bisect.bisect_left(starts, offset), len(starts) - 1)]

    def at_or_before(offset: float) -> int:
        return starts[max(bisect.bisect_right(starts, offset) - 1, 0)]

    size = fraction * len(text) / stretches
    validation: list[Span] = []
    for i in range(stretches):
        begin = at_or_after((i + 0.5) * len(text) / stretches - size / 2)
        validation.append((begin, at_or_after(begin + size)))
    training: list[Span] = []
    previous_end = 0
    for begin, end in [*validation, (len(text) + margin, len(text) + margin)]:
        segment = (at_or_after(previous_end + margin) if previous_end else 0, at_or_before(begin - margin))
        if segment[0] < segment[1]:
            training.append(segment)
        previous_end = end
    spans = sorted(validation + training)
    overlapping = any(e > b for (_, e), (b, _) in itertools.pairwise(spans))
    if not training or any(b >= e for b, e in validation) or overlapping:
        raise ValueError(f"a text of {len(text)} characters is too short for {stretches} separate stretches")
    return ShakespeareSplit(validation, training)


def split_shakespeare(text: str) -> tuple[str, str]:
    """(training, validation) text of shakespeare_split, each part's spans joined."""
    split = shakespeare_split(text)
    return "".join(text[b:e] for b, e in split.training), "".join(text[b:e] for b, e in split.validation)


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


def lm_windows(segments: list[Tensor], block: int, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows of token streams, each inside one segment, every such window equally likely:
    inputs (B, block) and next-token targets (B, block)."""
    counts = torch.tensor([max(0, len(s) - block) for s in segments])  # window starts per segment
    if int(counts.sum()) == 0:
        raise ValueError(f"no segment holds a window of {block + 1} tokens")
    bounds = counts.cumsum(0)
    picks = torch.randint(0, int(bounds[-1]), (batch_size,), generator=generator)
    which = torch.searchsorted(bounds, picks, right=True)
    offsets = picks - (bounds[which] - counts[which])
    windows = torch.stack([segments[w][o : o + block + 1] for w, o in zip(which.tolist(), offsets.tolist(), strict=True)])
    return windows[:, :-1], windows[:, 1:]
