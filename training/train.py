"""Training for both models.

    python -m training.train translator --out runs/translator --minutes 90
    python -m training.train generator --out runs/generator --minutes 90
    python -m training.train translator --init-from model/checkpoints/translator-en-de --out runs/translator-2 \
        --lr 3e-4 --warmup 100 --schedule warmup-constant-linear --decay-start 0.35 --max-steps 3000

Saves the whole training state to <out>/state.pt every --save-every steps, at each validation and on
SIGTERM or SIGINT (the step under way finishes first): weights, optimizer, schedule, step, the random
number generators and the validation history. Batches are a function of --seed and the step, so
`python -m training.train --resume RUN_DIR` continues bit for bit with the run's own command line
(only --minutes, --threads and --progress-seconds may be given again, and replace the run's). The same
command run again on an <out> holding a state.pt also resumes. Keeps the best checkpoint by validation score in
<out>/best (BLEU for the translator, nats per character for the generator), and with
--keep-snapshots N the last N validated steps as <out>/step-NNNNNN (for training.average).
--init-from starts from a checkpoint folder's config, weights and tokenizer with a fresh optimizer;
training.json records that folder (path, SHA-256 of its weights, its command) and the schedule.
--patience N stops once N validations in a row have not improved on the best.

The generator trains on the plays of train.txt that training.data.shakespeare_split does not hold out
(windows never cross a segment's end, so no window holds text of a held-out play), and validates on
both halves of the held-out plays, one play each ("val" is both). --schedule cosine-minutes decays
over the --minutes budget (wall time, validation included, summed over resumes) rather than over
--max-steps:

    python -m training.train generator --out runs/gen36a --schedule cosine-minutes --minutes 30 --max-steps 100000 \
        --eval-every 100 --keep-snapshots 5 --threads 1
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import sacrebleu
import torch
import torch.nn.functional as F
from tqdm import tqdm

from decoding.sampling_params import GREEDY
from loading.checkpoint import Model, build_model, count_parameters, load_native_checkpoint, save_checkpoint
from loading.tokenizer import PAD_ID, Tokenizer
from model.config import GeneratorConfig, ModelConfig, TranslatorConfig
from model.generator import Generator
from model.translator import Translator
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from training.data import (
    SHARED_DATA,
    collate_pairs,
    encode_pairs,
    file_sha256,
    lm_windows,
    read_lines,
    shakespeare_split,
    token_budget_batches,
)
from training.lm_scoring import halves_nats_per_char

SCHEDULES = ["inverse-sqrt", "cosine", "cosine-minutes", "warmup-constant-linear"]
COSINE_FLOOR = 0.1  # the cosine schedules end at this fraction of the peak learning rate


def inverse_sqrt_schedule(warmup: int) -> Callable[[int], float]:
    """Linear warm-up, then decay as 1/sqrt(step) (Vaswani et al.)."""
    return lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


def cosine(progress: float, floor: float = COSINE_FLOOR) -> float:
    """Half a cosine from 1 at progress 0 down to floor at progress 1 (and after)."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def cosine_schedule(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay reaching the floor at step total."""
    return lambda step: (step + 1) / warmup if step < warmup else cosine((step - warmup) / max(1, total - warmup))


def cosine_minutes_schedule(warmup: int, spent: Callable[[], float]) -> Callable[[int], float]:
    """Linear warm-up over steps, then cosine decay over spent(), the fraction of the time budget used."""
    return lambda step: (step + 1) / warmup if step < warmup else cosine(spent())


def warmup_constant_linear_schedule(warmup: int, total: int, decay_start: float) -> Callable[[int], float]:
    """Linear warm-up, constant until decay_start * total steps, then linear decay reaching 0 at total."""
    decay_from = max(warmup, round(decay_start * total))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_from:
            return 1.0
        return max(0.0, (total - step) / max(1, total - decay_from))

    return factor


def make_schedule(args: argparse.Namespace, spent: Callable[[], float]) -> Callable[[int], float]:
    """The --schedule's learning-rate factor of the step; spent() is the fraction of --minutes used."""
    if args.schedule == "inverse-sqrt":
        return inverse_sqrt_schedule(args.warmup)
    if args.schedule == "cosine":
        return cosine_schedule(args.warmup, args.max_steps)
    if args.schedule == "cosine-minutes":
        return cosine_minutes_schedule(args.warmup, spent)
    return warmup_constant_linear_schedule(args.warmup, args.max_steps, args.decay_start)


def schedule_info(args: argparse.Namespace) -> dict[str, Any]:
    """The learning-rate schedule as training.json records it."""
    info: dict[str, Any] = {"name": args.schedule, "peak_lr": args.lr, "warmup": args.warmup, "max_steps": args.max_steps}
    if args.schedule in ("cosine", "cosine-minutes"):
        info["floor"] = COSINE_FLOOR
    if args.schedule == "cosine-minutes":
        info["minutes"] = args.minutes
    if args.schedule == "warmup-constant-linear":
        info["decay_start"] = args.decay_start
    return info


def init_from_info(directory: Path) -> dict[str, Any]:
    """The checkpoint a run started from: its path as given, the SHA-256 of its weights, its training
    command, and (for a chain of continued runs) where it started from in turn."""
    parent = json.loads((directory / "training.json").read_text())
    info: dict[str, Any] = {
        "path": str(directory),
        "model_sha256": file_sha256(directory / "model.safetensors"),
        "command": parent["command"],
    }
    if "init_from" in parent:
        info["init_from"] = parent["init_from"]
    return info


def initial_model(
    args: argparse.Namespace, config_type: type[ModelConfig], train_tokenizer: Callable[[], Tokenizer], **fields: Any
) -> tuple[Model, Tokenizer]:
    """The model and tokenizer to train: the --init-from folder's (its config.json, float32 weights,
    tokenizer), or a freshly initialised preset model with `fields` replaced and a new tokenizer
    (for a run being resumed, the one it saved in <out>/tokenizer.model). Seeds torch with --seed."""
    if args.init_from:
        model, tokenizer = load_native_checkpoint(Path(args.init_from))
        if not isinstance(model.config, config_type):
            raise SystemExit(f"--init-from {args.init_from} holds a {type(model.config).__name__}, not a {config_type.__name__}")
        for name, value in fields.items():
            if getattr(model.config, name) != value:
                raise SystemExit(f"--init-from {args.init_from} has {name} {getattr(model.config, name)!r}, not {value!r}")
        torch.manual_seed(args.seed)
        return model, tokenizer
    saved = Path(args.out) / "tokenizer.model"  # a resumed run keeps the tokenizer it started with
    tokenizer = Tokenizer.load(saved) if saved.exists() and (Path(args.out) / "state.pt").exists() else train_tokenizer()
    config = dataclasses.replace(config_type.preset(args.preset), **fields)
    if args.dropout is not None:
        config = dataclasses.replace(config, dropout=args.dropout)
    assert config.vocab_size == tokenizer.vocab_size
    torch.manual_seed(args.seed)
    return build_model(config), tokenizer


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def validate_translator(model: Translator, tokenizer: Tokenizer, sources: list[str], references: list[str]) -> float:
    """Greedy sacreBLEU on the validation set, translated by the serving engine (in-process, 128
    sentences at a time) as `python -m training.evaluate` translates."""
    model.eval()
    hypotheses = [c.text for c in OfflineEngine(model, tokenizer, n_slots=128).generate(sources, GenerationParams(sampling=GREEDY))]
    model.train()
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def load_state(path: Path, device: torch.device) -> dict[str, Any]:
    """A run's saved state (Trainer.save_state), tensors on device; never unpickles anything but tensors and plain values."""
    state: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    return state


class Trainer:
    """The shared loop: steps, schedule, clipping, periodic validation, best-keeping, snapshots, resume."""

    def __init__(self, args: argparse.Namespace, model: Model, tokenizer: Tokenizer) -> None:
        self.args = args
        self.device = pick_device()
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, make_schedule(args, lambda: self.wall / (60 * args.minutes)))
        self.out = Path(args.out)
        self.step = 0
        self.elapsed = 0.0  # training seconds over all runs (resumes included)
        self.wall = 0.0  # seconds of steps and validations over all runs
        self.best: float | None = None
        self.history: list[dict[str, float]] = []
        # The SHA-256 of the --init-from weights ("" for none): a resume must start from the same folder.
        self.init_from_sha256 = file_sha256(Path(args.init_from) / "model.safetensors") if args.init_from else ""
        self.tokenizer_sha256 = hashlib.sha256(tokenizer.model_proto).hexdigest()
        state_path = self.out / "state.pt"
        if state_path.exists():
            state = load_state(state_path, self.device)
            if state.get("init_from_sha256", "") != self.init_from_sha256:
                raise SystemExit(f"{state_path} was trained from other --init-from weights (or none); pass the run's own --init-from")
            if state.get("tokenizer_sha256", self.tokenizer_sha256) != self.tokenizer_sha256:
                raise SystemExit(f"{state_path} was trained with another tokenizer than {self.out / 'tokenizer.model'}")
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
            self.wall = float(state.get("wall", self.elapsed))
            self.best = state["best"]
            self.history = json.loads(state["history"])
            torch.set_rng_state(state["rng"])
            if "cuda_rng" in state:
                torch.cuda.set_rng_state_all(state["cuda_rng"])
            print(f"resumed from {state_path} at step {self.step}", flush=True)
        self.stop_signal: int | None = None  # set by SIGTERM / SIGINT while run() runs

    def save_state(self) -> None:
        """Everything a resume needs to continue bit for bit, written atomically to <out>/state.pt."""
        self.out.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "elapsed": self.elapsed,
            "wall": self.wall,
            "best": self.best,
            "history": json.dumps(self.history),
            "init_from_sha256": self.init_from_sha256,
            "argv": json.dumps(self.args.argv),
            "tokenizer_sha256": self.tokenizer_sha256,
            "rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if not (self.out / "tokenizer.model").exists():
            self.tokenizer.save(self.out / "tokenizer.model")
        torch.save(state, self.out / "state.tmp")
        (self.out / "state.tmp").replace(self.out / "state.pt")

    def save_snapshot(self, training: dict[str, Any]) -> None:
        """<out>/step-NNNNNN for this step; only the newest --keep-snapshots are kept."""
        save_checkpoint(self.out / f"step-{self.step:06d}", self.model, self.tokenizer, training)
        for old in sorted(self.out.glob("step-*"))[: -self.args.keep_snapshots]:
            shutil.rmtree(old)

    @contextlib.contextmanager
    def stopping_on_signals(self) -> Iterator[None]:
        """Within it, SIGTERM and SIGINT stop run() after the step under way, and the state is then
        saved; the caller's handlers come back at its end."""
        previous = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.stop_signal is not None:
            self.save_state()
            print(
                f"\nstopped by {signal.Signals(self.stop_signal).name} at step {self.step}; state saved to {self.out / 'state.pt'}",
                flush=True,
            )

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: stop after the step under way (stopping_on_signals then saves the state)."""
        self.stop_signal = signum

    def run(
        self,
        next_batch: Callable[[int], tuple[torch.Tensor, ...]],
        loss_of: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, int]],
        validate: Callable[[], dict[str, float]],
        higher_is_better: bool,
        training_info: Callable[[], dict[str, Any]],
    ) -> None:
        """Steps until --max-steps, the --minutes deadline (for cosine-minutes: of all runs together),
        --patience validations without improvement, or a stop signal (within stopping_on_signals).
        validate() returns the score as "val", and more figures for the history."""
        args = self.args
        deadline = time.monotonic() + args.minutes * 60 - (self.wall if args.schedule == "cosine-minutes" else 0)
        bf16 = self.device.type == "cuda" or args.bf16
        self.model.train()
        bar = tqdm(total=args.max_steps, initial=self.step, mininterval=args.progress_seconds, file=sys.stdout)
        while (
            self.stop_signal is None
            and self.step < args.max_steps
            and time.monotonic() < deadline
            and not self.out_of_patience(higher_is_better)
        ):
            started = time.monotonic()
            batch = tuple(t.to(self.device) for t in next_batch(self.step))
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, n_tokens = loss_of(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            seconds = time.monotonic() - started
            self.elapsed += seconds
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{n_tokens / seconds:.0f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}")
            if self.step % args.eval_every == 0 or self.step == args.max_steps or time.monotonic() >= deadline:
                scores = validate()
                score = scores["val"]
                figures = {name: round(value, 4) for name, value in scores.items()}
                self.history.append({"step": self.step, "minutes": round(self.elapsed / 60, 1), "loss": round(loss.item(), 4), **figures})
                improved = self.best is None or (score > self.best if higher_is_better else score < self.best)
                print(f"\nstep {self.step} val {score:.4f} {'(best)' if improved else ''}", flush=True)
                if improved:
                    self.best = score
                    save_checkpoint(self.out / "best", self.model, self.tokenizer, training_info())
                if args.keep_snapshots:
                    self.save_snapshot(training_info())
                self.wall += time.monotonic() - started
                self.save_state()
            else:
                self.wall += time.monotonic() - started
                if self.step % args.save_every == 0:
                    self.save_state()
        bar.close()

    def out_of_patience(self, higher_is_better: bool) -> bool:
        """Whether the last --patience validations all failed to improve on the best before them."""
        if not self.args.patience or len(self.history) <= self.args.patience:
            return False
        scores = [h["val"] if higher_is_better else -h["val"] for h in self.history]
        return max(scores[-self.args.patience :]) <= max(scores[: -self.args.patience])


@dataclass
class Job:
    """One model's training: its trainer and what the loop needs (built apart from running, for tests)."""

    trainer: Trainer
    next_batch: Callable[[int], tuple[torch.Tensor, ...]]
    loss_of: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, int]]
    validate: Callable[[], dict[str, float]]
    higher_is_better: bool
    info: Callable[[], dict[str, Any]]

    def run(self) -> None:
        with self.trainer.stopping_on_signals():
            self.trainer.run(self.next_batch, self.loss_of, self.validate, self.higher_is_better, self.info)


def common_info(args: argparse.Namespace, trainer: Trainer, data_files: list[Path]) -> dict[str, Any]:
    info: dict[str, Any] = {
        "command": "python -m training.train " + " ".join(shlex.quote(a) for a in args.argv),
        "data": {str(p.relative_to(p.parents[1])): file_sha256(p) for p in data_files},
        "steps": trainer.step,
        "training_minutes": round(trainer.elapsed / 60, 1),
        "device": str(trainer.device),
        "torch_threads": torch.get_num_threads(),
        "bf16_autocast": trainer.device.type == "cuda" or args.bf16,
        "parameters": count_parameters(trainer.model),
        "seed": args.seed,
        "schedule": schedule_info(args),
        "validation_history": trainer.history,
    }
    if args.init_from:
        info["init_from"] = init_from_info(Path(args.init_from))
    return info


def translator_job(args: argparse.Namespace) -> Job:
    data = Path(args.data) / "multi30k"
    files = [data / f"{split}.{lang}.gz" for split in ("train", "val") for lang in ("en", args.target_lang)]
    train_en, train_tgt, val_en, val_tgt = (read_lines(f) for f in files)
    model, tokenizer = initial_model(
        args,
        TranslatorConfig,
        lambda: Tokenizer.train(train_en + train_tgt, args.vocab_size),
        source_lang="en",
        target_lang=args.target_lang,
    )
    assert isinstance(model, Translator)
    trainer = Trainer(args, model, tokenizer)
    pairs = encode_pairs(tokenizer, train_en, train_tgt, model.config.max_len - 1)
    epoch_batches: dict[int, list[list[int]]] = {}  # the latest epoch's batches only
    epoch_sizes: dict[int, int] = {}  # batches per epoch, so a step need not lay out the epochs before it again

    def batches_of(epoch: int) -> list[list[int]]:
        if epoch not in epoch_batches:
            epoch_batches.clear()
            epoch_batches[epoch] = token_budget_batches(pairs, args.batch_tokens, args.seed + epoch)
            epoch_sizes[epoch] = len(epoch_batches[epoch])
        return epoch_batches[epoch]

    def next_batch(step: int) -> tuple[torch.Tensor, ...]:
        # Deterministic in the step: resuming replays the same batch order.
        epoch, index = 0, step
        while index >= (epoch_sizes[epoch] if epoch in epoch_sizes else len(batches_of(epoch))):
            index -= epoch_sizes[epoch]
            epoch += 1
        b = collate_pairs([pairs[i] for i in batches_of(epoch)[index]])
        return b.src, b.tgt_in, b.tgt_out

    def loss_of(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
        src, tgt_in, tgt_out = batch
        logits = model(src, tgt_in)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=PAD_ID, label_smoothing=args.label_smoothing)
        return loss, int((tgt_out != PAD_ID).sum())

    def validate() -> dict[str, float]:
        return {"val": validate_translator(model, tokenizer, val_en, val_tgt)}

    def info() -> dict[str, Any]:
        return {**common_info(args, trainer, files), "best_val_bleu_greedy": trainer.best}

    return Job(trainer, next_batch, loss_of, validate, True, info)


def generator_job(args: argparse.Namespace) -> Job:
    path = Path(args.data) / "tinyshakespeare" / "train.txt"
    text = path.read_text(encoding="utf-8")
    split = shakespeare_split(text)
    train_texts = [text[b:e] for b, e in split.training]
    halves = {name: [text[b:e] for b, e in split.half(name)] for name in ("A", "B")}

    def train_tokenizer() -> Tokenizer:
        paragraphs = [p + "\n\n" for segment in train_texts for p in segment.split("\n\n")]
        return Tokenizer.train(paragraphs, args.vocab_size, keep_layout=True)

    model, tokenizer = initial_model(args, GeneratorConfig, train_tokenizer)
    assert isinstance(model, Generator)
    trainer = Trainer(args, model, tokenizer)
    train_segments = [torch.tensor(ids, dtype=torch.long) for ids in tokenizer.encode_batch(train_texts)]

    def next_batch(step: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        return lm_windows(train_segments, model.config.max_len, args.batch_size, generator)

    def loss_of(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), y.numel()

    def validate() -> dict[str, float]:
        model.eval()
        scores = halves_nats_per_char(model, tokenizer, halves, trainer.device)
        model.train()
        return {"val": scores["all"], "val_A": scores["A"], "val_B": scores["B"]}

    def info() -> dict[str, Any]:
        return {**common_info(args, trainer, [path]), "validation": split.describe(), "best_val_nats_per_char": trainer.best}

    return Job(trainer, next_batch, loss_of, validate, False, info)


RESUME_OVERRIDES = ("--minutes", "--threads", "--progress-seconds")


def resumed_argv(rest: list[str]) -> list[str]:
    """The command line of the run in rest[0] (from its state.pt), with the RESUME_OVERRIDES in rest[1:] appended."""
    if not rest:
        raise SystemExit("--resume needs the run folder: python -m training.train --resume RUN_DIR")
    state_path = Path(rest[0]) / "state.pt"
    if not state_path.exists():
        raise SystemExit(f"--resume {rest[0]}: no {state_path}")
    overrides = rest[1:]
    for flag in overrides[0::2]:
        if flag.split("=")[0] not in RESUME_OVERRIDES:
            raise SystemExit(f"--resume continues the run's own command; only {', '.join(RESUME_OVERRIDES)} may be given again, not {flag}")
    return [*json.loads(load_state(state_path, torch.device("cpu"))["argv"]), *overrides]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (sys.argv[1:] by default) with each model's defaults filled in; args.argv keeps it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=["translator", "generator"])
    parser.add_argument("--save-every", type=int, default=50, help="save the training state every N steps")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (always on CUDA)")
    parser.add_argument("--data", default=str(SHARED_DATA), help="folder holding multi30k/ and tinyshakespeare/")
    parser.add_argument("--out", required=True, help="run folder: state.pt (resume) and best/ (checkpoint)")
    parser.add_argument("--init-from", default=None, help="checkpoint folder to continue from (config, weights, tokenizer)")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--target-lang", default="de", choices=["de", "fr", "cs"], help="translator: the target language (Multi30k's side)")
    parser.add_argument("--minutes", type=float, default=60.0, help="stop after this much wall time")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--keep-snapshots", type=int, default=0, help="keep the last N validated steps as <out>/step-NNNNNN")
    parser.add_argument("--patience", type=int, default=0, help="stop after N validations without improvement (0: never)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--schedule", choices=SCHEDULES, default=None, help="inverse-sqrt (translator) or cosine (generator) by default")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--decay-start", type=float, default=0.35, help="warmup-constant-linear: decay from this fraction of --max-steps")
    parser.add_argument("--weight-decay", type=float, default=None)
    parser.add_argument("--dropout", type=float, default=None, help="replace the preset's dropout (new models only)")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--batch-tokens", type=int, default=4000, help="translator: source tokens per batch")
    parser.add_argument("--batch-size", type=int, default=16, help="generator: windows per batch")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--progress-seconds", type=float, default=1.0, help="progress bar refresh interval")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--resume"]:
        argv = resumed_argv(argv[1:])
    args = parser.parse_args(argv)
    args.argv = argv
    if args.init_from and (args.preset or args.vocab_size or args.dropout is not None):
        parser.error("--init-from takes the model's config and tokenizer from its folder; drop --preset, --vocab-size and --dropout")
    translator = args.model == "translator"
    defaults = {
        "preset": "multi30k-small" if translator else "shakespeare-small",
        "max_steps": 100_000 if translator else 4000,
        "schedule": "inverse-sqrt" if translator else "cosine",
        "warmup": 400 if translator else 100,
        "weight_decay": 0.01 if translator else 0.1,
        "vocab_size": 8000 if translator else 2000,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    (translator_job if args.model == "translator" else generator_job)(args).run()


if __name__ == "__main__":
    main()
