"""Evaluation CLI. The last line printed is one JSON object.

python -m training.evaluate translate --src FILE --ref FILE [--checkpoint DIR] [--beam-size N] [--weights int8|q4_0|...] [--json FILE]
    (sacreBLEU as reported, cased and detokenized with 13a, and lowercased with 13a as Multi30k papers report it;
    translated by the serving engine, in-process: service/engine/offline.py)
python -m training.evaluate lm --text FILE [--checkpoint DIR] [--weights int8|q4_0|...]
python -m training.evaluate generator-validation [--data DIR] [--also FILE] [--json FILE] CHECKPOINT_OR_RUN...
python -m training.evaluate generator-snapshots [--json FILE] RUN

generator-validation scores checkpoint folders (a run folder stands for its step-NNNNNN snapshots)
in nats per character on halves A and B of training.data.shakespeare_split's held-out plays (one play
each), and on both (and with --also on a text of your own, e.g. the last 10% of train.txt); with several
checkpoints, the Spearman correlation of their A and B scores.
generator-snapshots reads the A and B scores a training run recorded at each validation (from its
newest snapshot's training.json) and gives their Spearman correlation, scoring nothing again.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, get_args

import torch
from sacrebleu.metrics.bleu import BLEU

from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_checkpoint, load_native_checkpoint
from model.config import Quantization
from model.generator import Generator
from model.translator import Translator
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from training.data import SHARED_DATA, read_lines, shakespeare_split
from training.lm_scoring import halves_nats_per_char, nats_per_char


def weight_type(args: argparse.Namespace) -> WeightType:
    return torch.float32 if args.weights == "float32" else args.weights


def evaluate_translation(args: argparse.Namespace) -> dict[str, object]:
    model, tokenizer = load_checkpoint(Path(args.checkpoint or DEFAULT_TRANSLATOR), args.device, weight_type(args))
    assert isinstance(model, Translator), "the checkpoint is not a translator"
    sources, references = read_lines(Path(args.src)), read_lines(Path(args.ref))
    assert len(sources) == len(references), "--src and --ref differ in line count"
    started = time.perf_counter()
    engine = OfflineEngine(model, tokenizer, n_slots=args.batch_size * args.beam_size)  # a slot per beam
    params = GenerationParams(sampling=GREEDY, beam_size=args.beam_size, length_penalty=args.length_penalty)
    hypotheses = [c.text for c in engine.generate(sources, params)]
    seconds = time.perf_counter() - started
    if args.output:
        Path(args.output).write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    bleu, lowercase = BLEU(), BLEU(lowercase=True, tokenize="13a")
    score, lowercase_score = bleu.corpus_score(hypotheses, [references]), lowercase.corpus_score(hypotheses, [references])
    return {
        "bleu": round(score.score, 2),
        "signature": str(bleu.get_signature()),
        "bleu_lowercase": round(lowercase_score.score, 2),
        "signature_lowercase": str(lowercase.get_signature()),
        "sentences": len(sources),
        "seconds": round(seconds, 2),
        "beam_size": args.beam_size,
        "length_penalty": args.length_penalty,
        "checkpoint": str(args.checkpoint or DEFAULT_TRANSLATOR),
        "weights": args.weights,
    }


def evaluate_lm(args: argparse.Namespace) -> dict[str, object]:
    model, tokenizer = load_native_checkpoint(Path(args.checkpoint or DEFAULT_GENERATOR), args.device, weight_type(args))
    assert isinstance(model, Generator), "the checkpoint is not a generator"
    text = Path(args.text).read_text(encoding="utf-8")
    started = time.perf_counter()
    scores = nats_per_char(model, tokenizer, text, torch.device(args.device))
    seconds = round(time.perf_counter() - started, 2)
    return {**scores, "seconds": seconds, "checkpoint": str(args.checkpoint or DEFAULT_GENERATOR), "weights": args.weights}


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            result[i] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks (nan if either is constant)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")
    rx, ry = ranks(xs), ranks(ys)
    mean = (len(xs) + 1) / 2
    covariance = sum((a - mean) * (b - mean) for a, b in zip(rx, ry, strict=True))
    spread = (sum((a - mean) ** 2 for a in rx) * sum((b - mean) ** 2 for b in ry)) ** 0.5
    return covariance / spread if spread else float("nan")


def checkpoint_folders(paths: list[Path]) -> list[Path]:
    """The paths, each run folder (no model.safetensors of its own) replaced by its snapshots in step order."""
    return [q for p in paths for q in ([p] if (p / "model.safetensors").exists() else sorted(p.glob("step-*")))]


def evaluate_generator_validation(args: argparse.Namespace) -> dict[str, object]:
    text = (Path(args.data) / "tinyshakespeare" / "train.txt").read_text(encoding="utf-8")
    split = shakespeare_split(text)
    halves = {name: [text[b:e] for b, e in split.half(name)] for name in ("A", "B")}
    also = Path(args.also).read_text(encoding="utf-8") if args.also else None
    rows: list[dict[str, Any]] = []
    for folder in checkpoint_folders([Path(p) for p in args.checkpoints]):
        model, tokenizer = load_native_checkpoint(folder, args.device)
        assert isinstance(model, Generator), f"{folder} is not a generator"
        scores = halves_nats_per_char(model, tokenizer, halves, torch.device(args.device))
        if also is not None:
            scores["also"] = nats_per_char(model, tokenizer, also, torch.device(args.device))["nats_per_char"]
        rows.append({"checkpoint": str(folder), **{name: round(value, 4) for name, value in scores.items()}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    rho = spearman([r["A"] for r in rows], [r["B"] for r in rows]) if len(rows) >= 2 else None
    result: dict[str, object] = {"checkpoints": rows, "spearman_A_B": rho, "validation": split.describe()["rule"]}
    return {**result, "also": args.also} if args.also else result


def evaluate_generator_snapshots(args: argparse.Namespace) -> dict[str, object]:
    snapshots = sorted(Path(args.run).glob("step-*"))
    if not snapshots:
        raise SystemExit(f"{args.run} holds no step-NNNNNN snapshots")
    history = json.loads((snapshots[-1] / "training.json").read_text())["validation_history"]
    kept = {int(s.name.removeprefix("step-")) for s in snapshots}
    rows = [{"step": h["step"], "A": h["val_A"], "B": h["val_B"], "all": h["val"]} for h in history if h["step"] in kept]
    rho = spearman([r["A"] for r in rows], [r["B"] for r in rows]) if len(rows) >= 2 else None
    return {"run": args.run, "snapshots": rows, "spearman_A_B": rho}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    translate = commands.add_parser("translate", help="sacreBLEU of the translator")
    translate.add_argument("--src", required=True, help="source sentences, one a line (plain or .gz)")
    translate.add_argument("--ref", required=True, help="reference translations, aligned with --src")
    translate.add_argument("--checkpoint", default=None)
    translate.add_argument("--beam-size", type=int, default=1)
    translate.add_argument("--length-penalty", type=float, default=1.0)
    translate.add_argument("--batch-size", type=int, default=64, help="sentences decoded together (x beam size slots)")
    translate.add_argument("--output", default=None, help="write the translations here")
    lm = commands.add_parser("lm", help="nats per character of the generator")
    lm.add_argument("--text", required=True)
    lm.add_argument("--checkpoint", default=None)
    for sub in (translate, lm):
        sub.add_argument(
            "--weights", choices=["float32", *get_args(Quantization)], default="float32", help="quantized linear layers (model/quantize.py)"
        )
    validation = commands.add_parser("generator-validation", help="generators on the two halves of the held-out plays")
    validation.add_argument("checkpoints", nargs="+", help="checkpoint folders, or run folders (their step-NNNNNN snapshots)")
    validation.add_argument("--data", default=str(SHARED_DATA), help="folder holding tinyshakespeare/train.txt")
    validation.add_argument("--also", default=None, help='a text file each checkpoint is also scored on (as `lm` scores it), as "also"')
    snapshots = commands.add_parser("generator-snapshots", help="Spearman of halves A and B over a run's recorded validations")
    snapshots.add_argument("run", help="a generator run folder with step-NNNNNN snapshots")
    for sub in (translate, lm, validation):
        sub.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for sub in (translate, validation, snapshots):
        sub.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    handlers = {
        "translate": evaluate_translation,
        "lm": evaluate_lm,
        "generator-validation": evaluate_generator_validation,
        "generator-snapshots": evaluate_generator_snapshots,
    }
    result = handlers[args.command](args)
    if getattr(args, "json", None):
        command = "python -m training.evaluate " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        Path(args.json).write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
