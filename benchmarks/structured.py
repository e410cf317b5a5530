"""Structured outputs' cost: constrained against unconstrained decoding throughput on the same
requests, side by side in one run, at batch 1 and 16 (target: constrained >= 0.8x); and the
grammar's fast-forward (forced tokens appended without a model step each) on against off.

    python -m benchmarks.structured [--model FOLDER | --vocab 49152] [--json] [--quick] [--out benchmarks/results]

Each round generates a batch of JSON objects under a schema (sampled, a seed per request), then
the same prompts unconstrained with each request's max_tokens set to the length its constrained
twin produced and eos ignored: the same tokens through the same engine, the grammar's masks
(computed beside the forward, service/engine/grammar.py) the only difference; then the same
constrained requests with fast-forward off (EngineConfig.grammar_fast_forward), whose outputs may
be tokenized otherwise: compared by tokens/s. Rounds alternate and each side's median is kept. A
mask's cost grows with the vocabulary: --model takes a Hugging Face folder (a real model's
vocabulary); --vocab N builds (once, into runs/) a small Llama-shaped folder with random weights
and a byte-level BPE of N tokens trained on the shared data (N = 49,152 is SmolLM2's); default
the shipped generator (2,000 tokens). Writes structured.json into --out;
--quick (fewer rounds and requests) writes to a temporary folder unless --out says where.
"""

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.provenance import commit
from decoding.sampling_params import SamplingParams
from loading.checkpoint import DEFAULT_GENERATOR
from service.engine.config import EngineConfig, StructuredOutput
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request

RESULTS = Path("benchmarks/results")
QUICK_RESULTS = Path(tempfile.gettempdir()) / "benchmarks-quick"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "mood": {"enum": ["merry", "sad", "wrathful"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "mood", "friends"],
    "additionalProperties": False,
}
PROMPT = "A character of the play, as JSON:\n"


def run_batch(engine: Engine, prompt: list[int], params: list[GenerationParams]) -> tuple[list[int], float]:
    """Every request at once, stepped to the end: each one's generated token count, and the seconds taken."""
    started = time.perf_counter()
    for i, p in enumerate(params):
        engine.add_request(Request(str(i), list(prompt), p))
    counts = [0] * len(params)
    while engine.has_work:
        for delta in engine.step().deltas:
            counts[int(delta.request_id)] += len(delta.token_ids) + (delta.finish_reason == "stop")  # eos counts: it was computed
    return counts, time.perf_counter() - started


def compare(engine: Engine, batch: int, rounds: int) -> dict[str, float]:
    """Median tokens/s of constrained and unconstrained rounds on the same requests, and their ratio."""
    prompt = engine.runner.encode_prompt(PROMPT)
    schema = StructuredOutput("json", json.dumps(PERSON))
    constrained_rates, plain_rates, stepped_rates = [], [], []
    for round in range(rounds):
        sampling = [SamplingParams(temperature=1.0, seed=round * batch + i) for i in range(batch)]
        limit = engine.max_tokens_limit(len(prompt))
        constrained = [GenerationParams(max_tokens=limit, sampling=s, structured=schema) for s in sampling]
        counts, seconds = run_batch(engine, prompt, constrained)
        constrained_rates.append(sum(counts) / seconds)
        plain = [GenerationParams(max_tokens=n, sampling=s, ignore_eos=True) for n, s in zip(counts, sampling, strict=True)]
        plain_counts, plain_seconds = run_batch(engine, prompt, plain)
        assert plain_counts == counts, "the unconstrained twins generate as many tokens"
        plain_rates.append(sum(plain_counts) / plain_seconds)
        fast_forward = engine.config
        engine.config = replace(fast_forward, grammar_fast_forward=False)  # read at every step: the same engine, stepping each token
        stepped_counts, stepped_seconds = run_batch(engine, prompt, constrained)
        engine.config = fast_forward
        stepped_rates.append(sum(stepped_counts) / stepped_seconds)
    constrained_rate, plain_rate = statistics.median(constrained_rates), statistics.median(plain_rates)
    stepped_rate = statistics.median(stepped_rates)
    return {
        "constrained_tok_s": constrained_rate,
        "unconstrained_tok_s": plain_rate,
        "ratio": constrained_rate / plain_rate,
        "fast_forward_off_tok_s": stepped_rate,
        "fast_forward_gain": constrained_rate / stepped_rate,
    }


def large_vocabulary_folder(vocab_size: int) -> Path:
    """runs/structured-vocab-N: a random 4-layer Llama (d 256) whose tokenizer is a byte-level BPE
    of vocab_size tokens trained on Multi30k's four languages and Tiny Shakespeare (built once)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from training.data import SHARED_DATA, read_lines

    folder = Path("runs") / f"structured-vocab-{vocab_size}"
    if (folder / "model.safetensors").is_file():
        return folder
    texts = [line for lang in ("en", "de", "fr", "cs") for line in read_lines(SHARED_DATA / "multi30k" / f"train.{lang}.gz")]
    texts += (SHARED_DATA / "tinyshakespeare" / "train.txt").read_text().splitlines()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    size = tokenizer.get_vocab_size()
    config = LlamaConfig(vocab_size=size, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=specials[0]).save_pretrained(str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_GENERATOR, help="a checkpoint or Hugging Face folder (a generator)")
    parser.add_argument("--vocab", type=int, default=None, help="a random Llama-shaped folder with a BPE vocabulary of this size")
    parser.add_argument("--json", action="store_true", help="the last line printed is one JSON object")
    parser.add_argument("--quick", action="store_true", help=f"fewer rounds and requests, to check the script (files to {QUICK_RESULTS})")
    parser.add_argument("--out", type=Path, default=None, help=f"where structured.json goes (default: {RESULTS})")
    args = parser.parse_args()
    out: Path = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # as a Serve replica runs
    model = large_vocabulary_folder(args.vocab) if args.vocab else args.model
    engine = Engine.from_checkpoint(model, EngineConfig(prefix_caching=False))
    rounds = 1 if args.quick else 5
    results: dict[str, object] = {
        "commit": commit(),
        "model": str(model),
        "vocab_size": engine.runner.tokenizer.vocab_size,
        "rounds": rounds,
    }
    for batch in (1, 4) if args.quick else (1, 16):
        results[f"batch_{batch}"] = compare(engine, batch, rounds)
    (out / "structured.json").write_text(json.dumps(results, indent=2) + "\n")
    for name, figures in results.items():
        if isinstance(figures, dict):
            print(
                f"{name:9s} constrained {figures['constrained_tok_s']:7.1f} tok/s, unconstrained "
                f"{figures['unconstrained_tok_s']:7.1f} tok/s: {figures['ratio']:.2f}x; fast-forward off "
                f"{figures['fast_forward_off_tok_s']:7.1f} tok/s: on {figures['fast_forward_gain']:.2f}x"
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
