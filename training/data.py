"""Training data: Multi30k sentence pairs in token-budget batches, Tiny Shakespeare windows."""

import bisect
import gzip
import hashlib
import itertools
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from loading.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

# The project's data, read where it is (never copied into the repository); SERVING_DATA names
# another folder of the same layout, e.g. a copy carried to a GPU machine (benchmarks/gpu.py).
SHARED_DATA = Path(os.environ.get("SERVING_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
# The generator's validation: whole plays of train.txt (shakespeare_split). Plays are found from the
# cast (see shakespeare_plays): CAST_WINDOW characters of speech headings compared on either side of
# each named speech, a play at least MIN_PLAY characters long, a boundary where the two casts share
# at most CAST_CHANGE of their speeches. The held-out plays total at least VALIDATION_FRACTION.
VALIDATION_FRACTION = 0.1
CAST_WINDOW = 60_000
MIN_PLAY = 20_000
CAST_CHANGE = 0.05


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
    """Disjoint character spans of one text: its plays, the held-out plays in text order (half A
    the one from the first half of the plays, half B the one from the second half) and the training
    segments, the text of every other play (adjacent plays joined into one segment)."""

    plays: list[Span]
    validation: list[Span]
    training: list[Span]

    def half(self, name: str) -> list[Span]:
        """The held-out plays of half "A" or "B"."""
        return self.validation[{"A": 0, "B": 1}[name] :: 2]

    def describe(self) -> dict[str, object]:
        """The split as training.json records it."""
        return {
            "rule": f"whole plays held out: of the {len(self.plays)} plays found from the cast (training.data.shakespeare_plays), "
            f"one from the first half of the plays (half A) and one from the second half (half B), the pair with the fewest "
            f"characters that reaches {VALIDATION_FRACTION:.0%} of the text; training on every other play",
            "plays": [list(s) for s in self.plays],
            "validation_spans": [list(s) for s in self.validation],
            "training_spans": [list(s) for s in self.training],
            "validation_characters": sum(e - b for b, e in self.validation),
            "training_characters": sum(e - b for b, e in self.training),
        }


def speech_starts(text: str) -> list[int]:
    """Offsets where a speech begins (0, and after each run of blank lines), then len(text)."""
    return [0] + [m.end() for m in re.finditer(r"\n\n+", text) if m.end() < len(text)] + [len(text)]


def named_speeches(text: str) -> tuple[list[int], list[str]]:
    """(offsets, names) of the speeches whose heading is a name in capitals ("GLOUCESTER:",
    "KING RICHARD III:"); generic roles ("First Citizen:", "Messenger:") are written in title
    case and recur in play after play, so they are left out."""
    offsets, names = [], []
    for start in speech_starts(text)[:-1]:
        line_end = text.find("\n", start)
        heading = text[start : line_end if line_end >= 0 else len(text)]
        if heading.endswith(":") and heading[:-1].isupper():
            offsets.append(start)
            names.append(heading[:-1])
    return offsets, names


def cast_overlaps(text: str, window: int = CAST_WINDOW) -> list[tuple[int, float]]:
    """For each named speech but the first: (its offset, how much the casts of the window characters
    before it and after it (it included) share), the share being the sum over names of the smaller
    of the name's fractions of the named speeches on each side: 0 for two disjoint casts, 1 for the
    same speakers in the same proportions."""
    offsets, names = named_speeches(text)
    before: Counter[str] = Counter()
    after: Counter[str] = Counter()
    low = high = 0  # before holds names[low:j], after names[j:high]
    overlaps = []
    for j in range(1, len(offsets)):
        before[names[j - 1]] += 1
        after[names[j - 1]] -= 1
        while offsets[low] < offsets[j] - window:
            before[names[low]] -= 1
            low += 1
        while high < len(offsets) and offsets[high] < offsets[j] + window:
            after[names[high]] += 1
            high += 1
        n_before, n_after = j - low, high - j
        shared = sum(min(count / n_before, after[name] / n_after) for name, count in before.items() if count and after[name])
        overlaps.append((offsets[j], shared))
    return overlaps


def shakespeare_plays(text: str, window: int = CAST_WINDOW, min_play: int = MIN_PLAY, change: float = CAST_CHANGE) -> list[Span]:
    """The plays of text, found from who speaks, in text order; together they cover the text.

    A play begins at a named speech (see named_speeches) where the cast changes: the casts of the
    window characters before and after it share at most `change` (cast_overlaps) and less there
    than anywhere in the min_play characters before it, and no more than anywhere in the min_play
    characters after it; a play is at least min_play characters long (no boundary nearer than that
    to either end of the text). In Tiny Shakespeare's train.txt this finds the 8 plays, each at its
    first speech (Coriolanus, Richard III, Richard II, Romeo and Juliet, Henry VI part 3, The
    Winter's Tale, Measure for Measure, the start of The Taming of the Shrew): a 60,000-character
    window spans a scene with a cast of its own inside a play (Romeo and Juliet's opening brawl of
    servants, the sixteen years' gap of The Winter's Tale), and the 5% allows a name two adjacent
    plays share (MONTAGUE in Romeo and Juliet and in Henry VI). Such a name speaking next to the
    boundary can move it by a speech or two; a play that opens with generic roles only ("First
    Citizen:") begins at its first named speech.
    """
    overlaps = cast_overlaps(text, window)
    offsets = [offset for offset, _ in overlaps]
    boundaries = []
    for i, (offset, shared) in enumerate(overlaps):
        if shared > change or offset < min_play or len(text) - offset < min_play:
            continue
        earlier = overlaps[bisect.bisect_left(offsets, offset - min_play) : i]
        later = overlaps[i + 1 : bisect.bisect_right(offsets, offset + min_play)]
        if all(s > shared for _, s in earlier) and all(s >= shared for _, s in later):
            boundaries.append(offset)
    return list(itertools.pairwise([0, *boundaries, len(text)]))


def shakespeare_split(text: str, fraction: float = VALIDATION_FRACTION) -> ShakespeareSplit:
    """The held-out plays and training segments of text; a function of the text alone.

    Of the plays of shakespeare_plays, split in text order into a first half and a second half (the
    second the larger for an odd count), one play from each is held out: the pair with the fewest
    characters in all that reaches fraction of the text (the earlier pair on a tie), so that the
    validation is whole plays far apart and training keeps as much text as it can. Training is the
    rest: every other play, whole. ValueError for fewer than 3 plays, or none that reach fraction.
    """
    plays = shakespeare_plays(text)
    if len(plays) < 3:
        raise ValueError(f"found {len(plays)} play(s) in a text of {len(text)} characters; whole-play validation needs 3 or more")
    first, second = plays[: len(plays) // 2], plays[len(plays) // 2 :]
    pairs = [(p, q) for p in first for q in second if (p[1] - p[0]) + (q[1] - q[0]) >= fraction * len(text)]
    if not pairs:
        raise ValueError(f"no two plays of {len(plays)} reach {fraction:.0%} of the text, one from each half")
    validation = list(min(pairs, key=lambda pair: (sum(e - b for b, e in pair), pair)))
    edges = [0, *(offset for span in validation for offset in span), len(text)]
    training = [(b, e) for b, e in zip(edges[0::2], edges[1::2], strict=True) if b < e]
    return ShakespeareSplit(plays, validation, training)


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
