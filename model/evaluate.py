"""Evaluation CLI. The last line printed is one JSON object.

python -m model.evaluate translate --src FILE --ref FILE [--checkpoint DIR] [--beam-size N] [--weights int8]
python -m model.evaluate lm --text FILE [--checkpoint DIR] [--weights int8]
"""

import argparse
import json
import time
from pathlib import Path

import torch
from sacrebleu.metrics.bleu import BLEU

from model.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_checkpoint
from model.data import read_lines
from model.generator import Generator
from model.lm_scoring import nats_per_char
from model.translate import translate_sentences
from model.translator import Translator


def weight_type(args: argparse.Namespace) -> WeightType:
    return "int8" if args.weights == "int8" else torch.float32


def evaluate_translation(args: argparse.Namespace) -> dict[str, object]:
    model, tokenizer = load_checkpoint(Path(args.checkpoint or DEFAULT_TRANSLATOR), args.device, weight_type(args))
    assert isinstance(model, Translator), "the checkpoint is not a translator"
    sources, references = read_lines(Path(args.src)), read_lines(Path(args.ref))
    assert len(sources) == len(references), "--src and --ref differ in line count"
    started = time.perf_counter()
    hypotheses = [h[0] for h in translate_sentences(model, tokenizer, sources, args.beam_size, args.length_penalty, args.batch_size)]
    seconds = time.perf_counter() - started
    if args.output:
        Path(args.output).write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    bleu = BLEU()
    score = bleu.corpus_score(hypotheses, [references])
    return {
        "bleu": round(score.score, 2),
        "signature": str(bleu.get_signature()),
        "sentences": len(sources),
        "seconds": round(seconds, 2),
        "beam_size": args.beam_size,
        "length_penalty": args.length_penalty,
        "checkpoint": str(args.checkpoint or DEFAULT_TRANSLATOR),
        "weights": args.weights,
    }


def evaluate_lm(args: argparse.Namespace) -> dict[str, object]:
    model, tokenizer = load_checkpoint(Path(args.checkpoint or DEFAULT_GENERATOR), args.device, weight_type(args))
    assert isinstance(model, Generator), "the checkpoint is not a generator"
    text = Path(args.text).read_text(encoding="utf-8")
    started = time.perf_counter()
    scores = nats_per_char(model, tokenizer, text, torch.device(args.device))
    seconds = round(time.perf_counter() - started, 2)
    return {**scores, "seconds": seconds, "checkpoint": str(args.checkpoint or DEFAULT_GENERATOR), "weights": args.weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    translate = commands.add_parser("translate", help="sacreBLEU of the translator")
    translate.add_argument("--src", required=True, help="source sentences, one a line (plain or .gz)")
    translate.add_argument("--ref", required=True, help="reference translations, aligned with --src")
    translate.add_argument("--checkpoint", default=None)
    translate.add_argument("--beam-size", type=int, default=1)
    translate.add_argument("--length-penalty", type=float, default=1.0)
    translate.add_argument("--batch-size", type=int, default=64)
    translate.add_argument("--output", default=None, help="write the translations here")
    lm = commands.add_parser("lm", help="nats per character of the generator")
    lm.add_argument("--text", required=True)
    lm.add_argument("--checkpoint", default=None)
    for sub in (translate, lm):
        sub.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        sub.add_argument("--weights", choices=["float32", "int8"], default="float32", help="int8: quantised linear layers (CPU)")
    args = parser.parse_args()
    result = evaluate_translation(args) if args.command == "translate" else evaluate_lm(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
