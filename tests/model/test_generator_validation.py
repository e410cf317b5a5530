"""The generator's validation split (stretches of whole speeches spread through train.txt, kept out
of the training stream), window sampling inside training segments, and the Spearman helper."""

import argparse
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from model import train
from model.checkpoint import DEFAULT_GENERATOR
from model.data import SHARED_DATA, VALIDATION_MARGIN, lm_windows, shakespeare_split, speech_starts
from model.evaluate import evaluate_generator_snapshots, ranks, spearman
from model.train import cosine_minutes_schedule, generator_job, parse_args

TRAIN_TXT = SHARED_DATA / "tinyshakespeare" / "train.txt"
needs_data = pytest.mark.skipif(not TRAIN_TXT.exists(), reason="needs the shared Tiny Shakespeare data")


@pytest.fixture(scope="module")
def text() -> str:
    return TRAIN_TXT.read_text(encoding="utf-8")


@needs_data
def test_split_is_deterministic(text: str) -> None:
    first, second = shakespeare_split(text), shakespeare_split(text)
    assert first == second
    assert first.describe() == second.describe()


@needs_data
def test_stretches_are_whole_speeches_spread_through_the_text(text: str) -> None:
    split = shakespeare_split(text)
    n = len(split.validation)
    assert n >= 8
    starts = set(speech_starts(text))
    for i, (begin, end) in enumerate(split.validation):
        assert begin in starts and end in starts  # cut at speech boundaries
        assert text[begin:end].endswith("\n\n") and text[begin:end].split("\n", 1)[0].endswith(":")  # opens with a speaker
        assert i * len(text) / n <= begin < end <= (i + 1) * len(text) / n  # one stretch in each n-th of the text
        assert 0.005 * len(text) < end - begin < 0.02 * len(text)
    total = sum(e - b for b, e in split.validation)
    assert 0.09 * len(text) < total < 0.12 * len(text)
    assert split.half("A") == split.validation[0::2] and split.half("B") == split.validation[1::2]
    assert sorted(split.half("A") + split.half("B")) == split.validation


@needs_data
def test_training_keeps_a_margin_from_every_stretch_and_covers_the_rest(text: str) -> None:
    split = shakespeare_split(text)
    spans = sorted([(b, e, "validation") for b, e in split.validation] + [(b, e, "training") for b, e in split.training])
    for (_, end, kind), (begin, _, next_kind) in itertools.pairwise(spans):
        assert end <= begin
        if "validation" in (kind, next_kind):
            assert begin - end >= VALIDATION_MARGIN
    assert split.training[0][0] == 0 and split.training[-1][1] == len(text)
    assert sum(e - b for b, e in split.training) > 0.85 * len(text)


@needs_data
def test_no_validation_character_is_in_the_generator_training_stream(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The segments generator_job samples windows from decode to exactly the training spans, none of
    which shares a character offset with a validation stretch."""
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


def test_windows_stay_inside_one_segment() -> None:
    segments = [torch.arange(0, 10), torch.arange(100, 103), torch.arange(200, 230)]  # the middle one is too short
    x, y = lm_windows(segments, block=8, batch_size=500, generator=torch.Generator().manual_seed(0))
    windows = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.equal(windows[:, 1:] - windows[:, :-1], torch.ones(500, 8, dtype=torch.long))  # contiguous
    assert set((windows[:, 0] // 100).tolist()) == {0, 2}
    assert torch.equal(y[:, :-1], x[:, 1:])
    with pytest.raises(ValueError, match="no segment"):
        lm_windows(segments[1:2], block=8, batch_size=1, generator=torch.Generator())


def test_split_refuses_a_text_too_short_to_keep_stretches_apart() -> None:
    play = "ROMEO:\nBut soft, what light through yonder window breaks?\n\n"
    with pytest.raises(ValueError, match="too short"):
        shakespeare_split(play * 40)
    assert len(shakespeare_split(play * 1000).validation) == 10


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
    play = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
    (data / "tinyshakespeare" / "train.txt").write_text(play * 400, encoding="utf-8")
    argv = ["generator", "--init-from", str(DEFAULT_GENERATOR), "--data", str(data), "--out", str(tmp_path / "run")]
    argv += ["--lr", "0", "--max-steps", "10", "--eval-every", "1", "--patience", "1", "--batch-size", "2"]
    job = generator_job(parse_args(argv))
    job.run()  # lr 0: the first validation stays the best
    assert [h["step"] for h in job.trainer.history] == [1, 2]
    assert len({h["val"] for h in job.trainer.history}) == 1
    assert {"val_A", "val_B"} <= job.trainer.history[0].keys()
