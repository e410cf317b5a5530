"""The generator's validation split (whole plays of train.txt, found from the cast, held out of the
training stream), window sampling inside training segments, and the Spearman helper."""

import argparse
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from loading.checkpoint import DEFAULT_GENERATOR
from tests.made_up_plays import plays_text
from training import train
from training.data import SHARED_DATA, lm_windows, shakespeare_plays, shakespeare_split, speech_starts
from training.evaluate import evaluate_generator_snapshots, ranks, spearman
from training.train import cosine_minutes_schedule, generator_job, parse_args

TRAIN_TXT = SHARED_DATA / "tinyshakespeare" / "train.txt"
needs_data = pytest.mark.skipif(not TRAIN_TXT.exists(), reason="needs the shared Tiny Shakespeare data")

# Each play of train.txt by its first speech, in text order: Coriolanus, Richard III, Richard II,
# Romeo and Juliet, Henry VI part 3, The Winter's Tale, Measure for Measure, the Taming of the Shrew.
FIRST_SPEECHES = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "GLOUCESTER:\nNow is the winter of our discontent",
    "KING RICHARD II:\nOld John of Gaunt, time-honour'd Lancaster,",
    "SAMPSON:\nGregory, o' my word, we'll not carry coals.",
    "WARWICK:\nI wonder how the king escaped our hands.",
    "ARCHIDAMUS:\nIf you shall chance, Camillo, to visit Bohemia,",
    "DUKE VINCENTIO:\nEscalus.",
    "SLY:\nI'll pheeze you, in faith.",
]
# The last words of each play but the last.
LAST_WORDS = [
    "Yet he shall have a noble memory. Assist.\n\n",
    "That she may long live here, God say amen!\n\n",
    "In weeping after this untimely bier.\n\n\n",
    "Than this of Juliet and her Romeo.\n\n",
    "For here, I hope, begins our lasting joy.\n\n",
    "We were dissever'd: hastily lead away.\n\n",
    "What's yet behind, that's meet you all should know.\n\n",
]


@pytest.fixture(scope="module")
def text() -> str:
    return TRAIN_TXT.read_text(encoding="utf-8")


@needs_data
def test_split_is_deterministic(text: str) -> None:
    first, second = shakespeare_split(text), shakespeare_split(text)
    assert first == second
    assert first.describe() == second.describe()


@needs_data
def test_the_eight_plays_of_train_txt_are_found_at_their_first_speeches(text: str) -> None:
    plays = shakespeare_plays(text)
    assert [text[b:e].startswith(first) for (b, e), first in zip(plays, FIRST_SPEECHES, strict=True)] == [True] * 8
    assert [text[:b].endswith(last) for (b, _), last in zip(plays[1:], LAST_WORDS, strict=True)] == [True] * 7
    assert plays[0][0] == 0 and plays[-1][1] == len(text)
    assert all(end == begin for (_, end), (begin, _) in itertools.pairwise(plays))  # they tile the text
    assert set(b for b, _ in plays) <= set(speech_starts(text))


@needs_data
def test_validation_is_two_whole_plays_far_apart_at_least_a_tenth_of_the_text(text: str) -> None:
    split = shakespeare_split(text)
    assert split.plays == shakespeare_plays(text)
    first_half, second_half = split.plays[:4], split.plays[4:]
    assert len(split.validation) == 2
    assert split.half("A") == [split.validation[0]] and split.validation[0] in first_half
    assert split.half("B") == [split.validation[1]] and split.validation[1] in second_half
    total = sum(e - b for b, e in split.validation)
    assert total >= 0.1 * len(text)
    # No pair of plays, one from each half, reaches a tenth of the text with fewer characters.
    sizes = [(p, q, p[1] - p[0] + q[1] - q[0]) for p in first_half for q in second_half]
    assert min(size for _, _, size in sizes if size >= 0.1 * len(text)) == total
    assert split.plays.index(split.validation[1]) - split.plays.index(split.validation[0]) >= 2  # not neighbours
    # Richard II and the start of the Taming of the Shrew (the play the held-out tail continues).
    assert [text[b:e].split(":", 1)[0] for b, e in split.validation] == ["KING RICHARD II", "SLY"]


@needs_data
def test_training_is_every_other_play_whole(text: str) -> None:
    split = shakespeare_split(text)
    held_out = set(split.validation)
    trained = [p for p in split.plays if p not in held_out]
    covered = sorted(split.training + split.validation)
    assert covered[0][0] == 0 and covered[-1][1] == len(text)
    assert all(end == begin for (_, end), (begin, _) in itertools.pairwise(covered))  # no gap, no overlap
    # each training segment is a run of whole plays
    assert [p for b, e in split.training for p in split.plays if b <= p[0] and p[1] <= e] == trained
    assert sum(e - b for b, e in split.training) == sum(e - b for b, e in trained) > 0.8 * len(text)


@needs_data
def test_no_held_out_character_is_in_the_generator_training_stream(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The segments generator_job samples windows from (lm_windows keeps every window inside one)
    decode to exactly the training spans, none of which shares a character offset with a held-out
    play."""
    seen: list[list[torch.Tensor]] = []

    def recorded(
        segments: list[torch.Tensor], block: int, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(segments)
        return lm_windows(segments, block, batch_size, generator)

    monkeypatch.setattr(train, "lm_windows", recorded)
    args = parse_args(["generator", "--init-from", str(DEFAULT_GENERATOR), "--data", str(SHARED_DATA), "--out", str(tmp_path / "run")])
    job = generator_job(args)
    job.next_batch(0)
    split = shakespeare_split(text)
    [segments] = seen
    assert [job.trainer.tokenizer.decode(s.tolist()) for s in segments] == [text[b:e] for b, e in split.training]
    validation = set().union(*(range(b, e) for b, e in split.validation))
    training = set().union(*(range(b, e) for b, e in split.training))
    assert len(validation) == sum(e - b for b, e in split.validation)
    assert not validation & training


def test_plays_are_found_where_the_cast_changes_even_with_a_name_two_plays_share() -> None:
    lengths = [30_000, 45_000, 25_000, 36_000, 41_000]
    for shared_name in (None, "MONTAGUE"):
        text, starts = plays_text(lengths, shared_name)
        plays = shakespeare_plays(text)
        if shared_name is None:
            assert [b for b, _ in plays] == starts
        else:  # a shared name's speech next to the boundary can move it by a speech or two, no more
            assert len(plays) == len(starts)
            assert all(abs(b - start) <= 400 for (b, _), start in zip(plays, starts, strict=True))
        split = shakespeare_split(text)
        # halves: plays 0-1 and 2-4; the lightest pair reaching a tenth: plays 0 and 2
        assert split.validation == [plays[0], plays[2]]
        assert split.training == [plays[1], (plays[3][0], len(text))]


def test_split_refuses_a_text_of_too_few_plays() -> None:
    one_play, _ = plays_text([100_000])
    assert shakespeare_plays(one_play) == [(0, len(one_play))]
    with pytest.raises(ValueError, match="3 or more"):
        shakespeare_split(one_play)
    two_plays, _ = plays_text([50_000, 50_000])
    with pytest.raises(ValueError, match="3 or more"):
        shakespeare_split(two_plays)
    three, _ = plays_text([21_000, 70_000, 21_000])
    first, middle, last = shakespeare_plays(three)
    assert shakespeare_split(three).validation == [first, last]  # 37% of the text, the lighter pair
    assert shakespeare_split(three, fraction=0.5).validation == [first, middle]
    with pytest.raises(ValueError, match="reach 90%"):  # the heaviest pair holds 81% of the text
        shakespeare_split(three, fraction=0.9)


def test_windows_stay_inside_one_segment() -> None:
    segments = [torch.arange(0, 10), torch.arange(100, 103), torch.arange(200, 230)]  # the middle one is too short
    x, y = lm_windows(segments, block=8, batch_size=500, generator=torch.Generator().manual_seed(0))
    windows = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.equal(windows[:, 1:] - windows[:, :-1], torch.ones(500, 8, dtype=torch.long))  # contiguous
    assert set((windows[:, 0] // 100).tolist()) == {0, 2}
    assert torch.equal(y[:, :-1], x[:, 1:])
    with pytest.raises(ValueError, match="no segment"):
        lm_windows(segments[1:2], block=8, batch_size=1, generator=torch.Generator())


def test_spearman_on_known_cases() -> None:
    assert ranks([3.0, 1.0, 2.0, 1.0]) == [4.0, 1.5, 3.0, 1.5]
    assert spearman([1, 2, 3, 4, 5], [2, 4, 6, 8, 10]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    # Without ties, 1 - 6 sum(d^2) / (n (n^2 - 1)): d = (0, 0, 1, -1, 0) gives 1 - 12/120.
    assert spearman([1.1, 1.2, 1.3, 1.4, 1.5], [0.5, 0.6, 0.8, 0.7, 0.9]) == pytest.approx(0.9)
    # With a tie: ranks (1, 2, 3.5, 5, 3.5) against (1..5) give 8 / sqrt(10 * 9.5).
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert math.isnan(spearman([1, 2, 3], [4, 4, 4]))


def test_snapshot_spearman_reads_the_recorded_halves_of_kept_snapshots(tmp_path: Path) -> None:
    history = [
        {"step": step, "val": a / 2 + b / 2, "val_A": a, "val_B": b}
        for step, a, b in [(100, 2.0, 2.1), (200, 1.8, 1.9), (300, 1.7, 1.75), (400, 1.6, 1.7), (500, 1.65, 1.65), (600, 1.5, 1.6)]
    ]
    for step in (200, 300, 400, 500, 600):  # step 100's snapshot was dropped
        (tmp_path / f"step-{step:06d}").mkdir()
    (tmp_path / "step-000600" / "training.json").write_text(json.dumps({"validation_history": history}))
    result = evaluate_generator_snapshots(argparse.Namespace(run=str(tmp_path)))
    rows = result["snapshots"]
    assert isinstance(rows, list)
    assert [r["step"] for r in rows] == [200, 300, 400, 500, 600]
    assert result["spearman_A_B"] == pytest.approx(0.9)  # ranks A (5, 4, 2, 3, 1) and B (5, 4, 3, 2, 1)


def test_cosine_minutes_schedule_follows_the_time_spent() -> None:
    spent = [0.0]
    factor = cosine_minutes_schedule(warmup=10, spent=lambda: spent[0])
    assert [factor(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert factor(10) == 1.0
    spent[0] = 0.5
    assert factor(500) == pytest.approx(0.55)  # halfway between 1 and the floor 0.1
    spent[0] = 1.2
    assert factor(10) == pytest.approx(0.1)


def test_patience_stops_a_run_that_no_longer_improves(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "tinyshakespeare").mkdir(parents=True)
    plays, _ = plays_text([21_000, 22_000, 21_000])
    (data / "tinyshakespeare" / "train.txt").write_text(plays, encoding="utf-8")
    argv = ["generator", "--init-from", str(DEFAULT_GENERATOR), "--data", str(data), "--out", str(tmp_path / "run")]
    argv += ["--lr", "0", "--max-steps", "10", "--eval-every", "1", "--patience", "1", "--batch-size", "2"]
    job = generator_job(parse_args(argv))
    job.run()  # lr 0: the first validation stays the best
    assert [h["step"] for h in job.trainer.history] == [1, 2]
    assert len({h["val"] for h in job.trainer.history}) == 1
    assert {"val_A", "val_B"} <= job.trainer.history[0].keys()
