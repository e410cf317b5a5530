"""Continued training (--init-from), resuming a stopped run, and checkpoint averaging, on the shipped
checkpoints and a few lines of made-up data (a few training steps on the CPU)."""

import gzip
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint, save_checkpoint
from loading.tokenizer import PAD_ID, Tokenizer
from model.config import GeneratorConfig
from model.generator import Generator
from model.translator import Translator
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from tests.made_up_plays import plays_text
from training import train
from training.average import average_checkpoints
from training.data import collate_pairs, encode_pairs, file_sha256, token_budget_batches
from training.train import Job, generator_job, parse_args, translator_job, warmup_constant_linear_schedule

ENGLISH = ["A man is riding a bike.", "Two dogs play in the snow.", "A woman reads a book in the park.", "Children are running."]
GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest im Park ein Buch.", "Kinder rennen."]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    multi30k = tmp_path / "data" / "multi30k"
    multi30k.mkdir(parents=True)
    for split, copies in (("train", 8), ("val", 1)):
        for lang, lines in (("en", ENGLISH), ("de", GERMAN)):
            with gzip.open(multi30k / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines * copies) + "\n")
    (tmp_path / "data" / "tinyshakespeare").mkdir()
    plays, _ = plays_text([21_000, 22_000, 21_000])  # the whole-play split needs three plays or more
    (tmp_path / "data" / "tinyshakespeare" / "train.txt").write_text(plays, encoding="utf-8")
    return tmp_path / "data"


def continued_job(model: str, shipped: Path, data: Path, out: Path) -> Job:
    argv = [model, "--init-from", str(shipped), "--data", str(data), "--out", str(out), "--max-steps", "1", "--eval-every", "1"]
    argv += ["--schedule", "warmup-constant-linear", "--lr", "3e-4", "--warmup", "1", "--keep-snapshots", "1"]
    argv += ["--batch-tokens", "200"] if model == "translator" else ["--batch-size", "2"]
    args = parse_args(argv)
    return (translator_job if model == "translator" else generator_job)(args)


def loss_on(net: Translator | Generator, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The training loss of net on batch, computed here rather than by the trainer (train mode, as in a step)."""
    net.train()
    if isinstance(net, Translator):
        src, tgt_in, tgt_out = batch
        logits = net(src, tgt_in)
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID, label_smoothing=0.1)
    x, y = batch
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize(("model", "shipped"), [("translator", DEFAULT_TRANSLATOR), ("generator", DEFAULT_GENERATOR)])
def test_init_from_starts_from_exactly_the_shipped_weights(model: str, shipped: Path, data: Path, tmp_path: Path) -> None:
    job = continued_job(model, shipped, data, tmp_path / "run")
    reference, tokenizer = load_checkpoint(shipped)
    assert job.trainer.tokenizer.model_proto == tokenizer.model_proto  # the folder's tokenizer, not a new one
    for name, tensor in reference.state_dict().items():
        assert torch.equal(job.trainer.model.state_dict()[name], tensor), name

    batch = job.next_batch(0)
    torch.manual_seed(7)
    expected = loss_on(reference, batch)
    torch.manual_seed(7)  # the same dropout masks
    job.run()  # one step; the step's loss is in the validation history
    first = job.trainer.history[0]
    assert first["step"] == 1
    assert first["loss"] == round(expected.item(), 4)
    assert expected.item() < (3.0 if model == "translator" else 4.5)  # trained weights, not a fresh init (about 9 and 7.6)

    training = json.loads((tmp_path / "run" / "best" / "training.json").read_text())
    assert training["init_from"]["path"] == str(shipped)
    assert training["init_from"]["model_sha256"] == file_sha256(shipped / "model.safetensors")
    assert training["init_from"]["command"] == json.loads((shipped / "training.json").read_text())["command"]
    assert training["schedule"] == {"name": "warmup-constant-linear", "peak_lr": 3e-4, "warmup": 1, "max_steps": 1, "decay_start": 0.35}
    assert (tmp_path / "run" / "step-000001" / "model.safetensors").exists()


def test_resume_continues_the_run_and_refuses_other_init_from_weights(data: Path, tmp_path: Path) -> None:
    continued_job("generator", DEFAULT_GENERATOR, data, tmp_path / "run").run()
    assert continued_job("generator", DEFAULT_GENERATOR, data, tmp_path / "run").trainer.step == 1
    model, tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    save_checkpoint(tmp_path / "float32-copy", model, tokenizer, {})  # the same values, other bytes
    with pytest.raises(SystemExit, match="init-from"):
        continued_job("generator", tmp_path / "float32-copy", data, tmp_path / "run")


def resumable_job(model: str, data: Path, out: Path) -> Job:
    """12 steps from the shipped weights (dropout on), validated every 4 and saved every 3."""
    shipped = DEFAULT_TRANSLATOR if model == "translator" else DEFAULT_GENERATOR
    argv = [model, "--init-from", str(shipped), "--data", str(data), "--out", str(out), "--max-steps", "12", "--eval-every", "4"]
    argv += ["--save-every", "3", "--schedule", "cosine", "--lr", "3e-4", "--warmup", "4"]
    argv += ["--batch-tokens", "60"] if model == "translator" else ["--batch-size", "2"]
    return (translator_job if model == "translator" else generator_job)(parse_args(argv))


@pytest.mark.parametrize("model", ["translator", "generator"])
def test_a_run_stopped_by_sigterm_and_resumed_equals_the_run_straight_through(model: str, data: Path, tmp_path: Path) -> None:
    straight = resumable_job(model, data, tmp_path / "straight")
    straight.run()
    assert straight.trainer.step == 12
    straight_rng = torch.get_rng_state()

    stopped = resumable_job(model, data, tmp_path / "stopped")
    loss_of = stopped.loss_of

    def loss_with_a_sigterm_in_step_7(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
        if stopped.trainer.step == 6:  # in step 7: between two saves (every 3) and two validations (every 4)
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the trainer's handler
        return loss_of(batch)

    stopped.loss_of = loss_with_a_sigterm_in_step_7
    callers = signal.getsignal(signal.SIGTERM)
    stopped.run()
    assert stopped.trainer.step == 7  # the step under way finished, then the run stopped
    assert signal.getsignal(signal.SIGTERM) is callers  # the handler is the caller's again

    args = parse_args(["--resume", str(tmp_path / "stopped"), "--minutes", "30"])
    assert args.max_steps == 12 and args.save_every == 3 and args.minutes == 30
    resumed = (translator_job if model == "translator" else generator_job)(args)
    assert resumed.trainer.step == 7
    resumed.run()
    assert resumed.trainer.step == 12

    assert resumed.trainer.history == [
        {**h, "minutes": resumed.trainer.history[i]["minutes"]} for i, h in enumerate(straight.trainer.history)
    ]
    assert [h["step"] for h in straight.trainer.history] == [4, 8, 12]
    for name, tensor in straight.trainer.model.state_dict().items():
        assert torch.equal(resumed.trainer.model.state_dict()[name], tensor), name
    straight_moments, resumed_moments = straight.trainer.optimizer.state_dict()["state"], resumed.trainer.optimizer.state_dict()["state"]
    assert straight_moments.keys() == resumed_moments.keys()
    for key, moments in straight_moments.items():
        for name, value in moments.items():
            assert torch.equal(resumed_moments[key][name], value), (key, name)
    assert resumed.trainer.scheduler.get_last_lr() == straight.trainer.scheduler.get_last_lr()
    assert torch.equal(torch.get_rng_state(), straight_rng)  # the dropout masks drew the same numbers


def test_resume_takes_only_the_budget_flags_and_needs_a_saved_run(data: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no .*state\.pt"):
        parse_args(["--resume", str(tmp_path / "nothing")])
    job = resumable_job("generator", data, tmp_path / "run")
    job.trainer.save_state()
    with pytest.raises(SystemExit, match="only --minutes"):
        parse_args(["--resume", str(tmp_path / "run"), "--lr", "1e-2"])
    assert parse_args(["--resume", str(tmp_path / "run"), "--threads", "2"]).threads == 2


def test_a_fresh_run_resumes_with_the_tokenizer_it_saved_and_refuses_another(data: Path, tmp_path: Path) -> None:
    args = parse_args(["generator", "--data", str(data), "--out", str(tmp_path / "run")])
    shipped_model, shipped_tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    trainer = train.Trainer(args, shipped_model, shipped_tokenizer)
    trainer.save_state()
    assert (tmp_path / "run" / "tokenizer.model").read_bytes() == shipped_tokenizer.model_proto

    def no_training() -> Tokenizer:
        raise AssertionError("a resumed run trains no tokenizer")

    model, tokenizer = train.initial_model(args, GeneratorConfig, no_training)
    assert tokenizer.model_proto == shipped_tokenizer.model_proto
    _, translator_tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    with pytest.raises(SystemExit, match="another tokenizer"):
        train.Trainer(args, model, translator_tokenizer)


def test_init_from_refuses_the_other_architecture(data: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="GeneratorConfig"):
        continued_job("translator", DEFAULT_GENERATOR, data, tmp_path / "run")


def test_translator_batches_follow_each_epoch_layout_laid_out_once(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seeds: list[int] = []

    def recorded(pairs: list[tuple[list[int], list[int]]], max_tokens: int, seed: int) -> list[list[int]]:
        seeds.append(seed)
        return token_budget_batches(pairs, max_tokens, seed)

    monkeypatch.setattr(train, "token_budget_batches", recorded)
    job = continued_job("translator", DEFAULT_TRANSLATOR, data, tmp_path / "run")
    english, german = ENGLISH * 8, GERMAN * 8
    pairs = encode_pairs(job.trainer.tokenizer, english, german, 255)
    layouts = [token_budget_batches(pairs, 200, 1234 + epoch) for epoch in range(3)]
    expected = [collate_pairs([pairs[i] for i in batch]) for layout in layouts for batch in layout]
    for step, b in enumerate(expected):
        assert all(torch.equal(x, y) for x, y in zip(job.next_batch(step), (b.src, b.tgt_in, b.tgt_out), strict=True)), step
    assert seeds == [1234, 1235, 1236]


def test_warmup_constant_linear_schedule() -> None:
    factor = warmup_constant_linear_schedule(warmup=10, total=100, decay_start=0.5)
    assert [factor(s) for s in (0, 9, 10, 49, 50, 75, 99, 100)] == [0.1, 1.0, 1.0, 1.0, 1.0, 0.5, 0.02, 0.0]


@pytest.mark.parametrize("shipped", [DEFAULT_TRANSLATOR, DEFAULT_GENERATOR])
def test_averaging_two_copies_gives_the_checkpoint_back_bit_for_bit(shipped: Path, tmp_path: Path) -> None:
    average_checkpoints([shipped, shipped], tmp_path / "average", "test")
    original, averaged = load_file(str(shipped / "model.safetensors")), load_file(str(tmp_path / "average" / "model.safetensors"))
    assert original.keys() == averaged.keys()
    for name, tensor in original.items():
        assert averaged[name].dtype == tensor.dtype
        assert torch.equal(averaged[name], tensor), name
    assert (tmp_path / "average" / "config.json").read_text() == (shipped / "config.json").read_text()
    assert (tmp_path / "average" / "tokenizer.model").read_bytes() == (shipped / "tokenizer.model").read_bytes()
    training = json.loads((tmp_path / "average" / "training.json").read_text())
    assert [a["model_sha256"] for a in training["averaged"]] == [file_sha256(shipped / "model.safetensors")] * 2


def test_averaged_weights_of_two_snapshots_load_and_translate(tmp_path: Path) -> None:
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    shipped = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.01 * torch.randn_like(p))
    save_checkpoint(tmp_path / "other", model, tokenizer, {"command": "perturbed copy"})
    average_checkpoints([DEFAULT_TRANSLATOR, tmp_path / "other"], tmp_path / "average", "test")

    averaged, averaged_tokenizer = load_checkpoint(tmp_path / "average")
    assert isinstance(averaged, Translator)
    other = model.state_dict()
    for name, tensor in averaged.state_dict().items():
        torch.testing.assert_close(tensor, (shipped[name] + other[name]) / 2)
    [translation] = OfflineEngine(averaged, averaged_tokenizer).generate(
        ["A man is riding a bike."], GenerationParams(sampling=GREEDY, beam_size=4)
    )
    german = translation.text
    assert "Mann" in german


def test_averaging_refuses_different_models(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="differs"):
        average_checkpoints([DEFAULT_TRANSLATOR, DEFAULT_GENERATOR], tmp_path / "average", "test")
