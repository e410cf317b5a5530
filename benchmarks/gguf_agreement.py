"""Top-1 agreement with llama.cpp on a trained model's GGUF files, over real text.

    python -m benchmarks.gguf_agreement [--folder DIR] [--types Q8_0,Q4_1,Q4_0] [--json [FILE]]

benchmarks.gguf measures agreement on random weights, whose near-tied logits let a change of
summation order alone change the top token (llama.cpp against itself: 96-99%). Here the model is
one trained in this repository (default: the copy editor, evals/copy_edit/model, a Llama), written
by exports.gguf in each type into runs/gguf/ (once), and the text is its 35 prompts with their
answers (evals/copy_edit/prompts.jsonl, at most 256 tokens each, tokenized by the file's
tokenizer as ours loads it). Per file, the share of positions whose most likely next token is
the same:
- top1_agreement: ours (8-bit activations, one row a step as decoding computes them:
  benchmarks.gguf's Ours.logits) against llama.cpp at its defaults, whose KV cache is float16;
- top1_agreement_f32_kv: the same against llama.cpp with a float32 KV cache, as ours keeps it;
- top1_agreement_llama_cpp_with_itself: llama.cpp's logits of each text at once against one
  token at a time (n_batch 1), both at its defaults.
One thread each. --json writes the figures (default benchmarks/results/gguf_agreement.json).
"""

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gguf import AGREEMENT_TOKENS, LLAMA_CPP, LlamaCpp, Ours, ensure_llama_cpp, gguf_file
from benchmarks.provenance import commit, machine

ROOT = Path(__file__).resolve().parent.parent
COPY_EDITOR = ROOT / "evals" / "copy_edit" / "model"
TEXTS = ROOT / "evals" / "copy_edit" / "prompts.jsonl"
RESULTS = ROOT / "benchmarks" / "results" / "gguf_agreement.json"
F16, F32 = 1, 0  # ggml's type ids


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The share of positions, over every text, whose argmax is the same in a's logits and b's."""
    same = [x.argmax(-1) == y.argmax(-1) for x, y in zip(a, b, strict=True)]
    return round(float(np.concatenate(same).mean()), 4)


def measure(path: Path, texts: list[str]) -> dict[str, Any]:
    ours = Ours(path, 8)
    prompts = [ours.tokenizer.encode(text)[:AGREEMENT_TOKENS] for text in texts]
    logits = {
        "ours": [ours.logits(p) for p in prompts],
        "llama_cpp": [LlamaCpp(path).logits(p) for p in prompts],
        "llama_cpp_f32_kv": [LlamaCpp(path, kv_type=F32).logits(p) for p in prompts],
        "llama_cpp_one_at_a_time": [LlamaCpp(path, n_batch=1).logits(p) for p in prompts],
    }
    return {
        "file": path.name,
        "positions": sum(len(p) for p in prompts),
        "top1_agreement": agreement(logits["ours"], logits["llama_cpp"]),
        "top1_agreement_f32_kv": agreement(logits["ours"], logits["llama_cpp_f32_kv"]),
        "top1_agreement_llama_cpp_with_itself": agreement(logits["llama_cpp"], logits["llama_cpp_one_at_a_time"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=COPY_EDITOR, help="a trained Llama-family folder")
    parser.add_argument("--types", default="Q8_0,Q4_1,Q4_0")
    parser.add_argument("--json", nargs="?", const=RESULTS, default=None, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ensure_llama_cpp()
    texts = [(row := json.loads(line))["prompt"] + " " + row["expected"] for line in TEXTS.read_text().splitlines() if line]
    stem = f"{args.folder.resolve().parent.name}-{args.folder.name}"  # copy_edit-model
    results = [measure(gguf_file(args.folder, kind, stem), texts) for kind in args.types.split(",")]
    print(f"{'file':28} {'positions':>10} {'ours / llama.cpp':>17} {'f32 KV':>8} {'llama.cpp / itself':>19}")
    for r in results:
        figures = f"{r['top1_agreement']:>17.2%} {r['top1_agreement_f32_kv']:>8.2%} {r['top1_agreement_llama_cpp_with_itself']:>19.2%}"
        print(f"{r['file']:28} {r['positions']:>10} {figures}")
    if args.json:
        document = {"commit": commit(), "machine": machine(), "llama_cpp": LLAMA_CPP, "threads": 1, "folder": str(args.folder)}
        document["files"] = results
        args.json.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
