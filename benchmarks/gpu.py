"""The GPU check: the CUDA tests, exactness on the device and the GPU benchmarks, in one command.

    python -m benchmarks.gpu [--device cuda|cpu] [--quick] [--json] [--out benchmarks/results/gpu.json]

Runs in at most 8 minutes on one H200 (--quick: a minute or two; --device cpu --quick: under a
minute on 2 cores, to check the script). Writes the JSON to --out and a markdown table beside it
(gpu.md); with --json the last stdout line is the JSON object. --device defaults to cuda when
there is one.

Keys:
- tests, tests_passed, tests_failed, tests_skipped, tests_not_collected: (a) pytest on
  tests/model and tests/engine (not the slow tier) with --device, so the device-parametrised
  exactness tests run on the device; test files that need what the machine lacks (ctranslate2,
  Ray, FastAPI, pydantic) are listed as not collected. On the CPU with --quick: "skipped (--quick)".
- engine_equals_recomputation (bool): (b) float32, the engine (on CUDA its CUDA graphs) equals
  full recomputation (decoding/reference_decoding.py) on the shipped generator and translator, greedy.
- bf16_agreement, bf16_bleu, fp32_bleu, bf16_bleu_delta: (b) greedy translations of test_2016
  (1,000 sentences; --quick 100, on the CPU 8) by the engine in bfloat16 and in float32: the
  share of identical outputs, and sacreBLEU (bf16 - fp32). Targets: agreement >= 0.97, |delta| <= 0.3.
- cuda_graph_equal (bool): (b) both models' engine outputs (greedy; the translator's beams too)
  with fixed-shape decode equal those of the dynamic (eager) step: on CUDA the CUDA graphs by
  bucket; on the CPU the same bucketed steps, run eagerly.
- gen_tok_s_<n>, gen_transformers_tok_s_<n>, gen_vs_transformers_<n>: (c) the generator, n = 1,
  16, 64, 256 sequences at once, a fixed number of new tokens each (GEN_NEW_TOKENS): our engine's
  generated tokens/s, transformers' generate (static batch of n, same exported weights, dtype and
  device), and ours / theirs. Target: gen_vs_transformers_256 >= 5.
- translate_{greedy,beam4}_sent_s[_64], translate_{greedy,beam4}_transformers_sent_s[_64],
  translate_{greedy,beam4}_vs_transformers[_64]: (c) the translator over test_2016 with 256
  (suffix _64: 64) sentences in flight: our engine takes them all at once with 256 x beam slots;
  transformers gets them sorted by length in batches of 256 (or 64). Sentences/s.
- decode_step_seconds, weights_bytes, copy_bytes_per_s, bandwidth_floor_seconds,
  decode_step_vs_bandwidth_floor: (d) the generator's batch-1 decode step (the engine's: on CUDA
  a graph replay) against the bandwidth floor, the weights' bytes over the bandwidth of a large
  device-to-device copy (bytes read and written per second) measured in the same run. For models
  this small the step is bound by kernel launches and their latency, not by bandwidth (the ratio
  is far above 1): what the CUDA graphs cut.
- peak_memory_bytes, peak_memory_kind: (e) torch.cuda.max_memory_allocated on CUDA, else the
  process's peak resident set (resource.getrusage).
- device, dtype (of the throughput runs: bfloat16 on CUDA, float32 on the CPU), quick, seconds.

Needs only what the GPU machine has: torch, numpy, sentencepiece, safetensors, transformers,
tokenizers, sacrebleu and pytest (exports/export.py imports ctranslate2 only for its own exports;
tests/test_gpu_check.py imports this module with Ray, FastAPI, pydantic, starlette and
ctranslate2 blocked). Data: Multi30k's test_2016_flickr en/de (training/data.py's SHARED_DATA).
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerBase

from decoding.reference_decoding import generate_greedy_uncached, greedy_translate_uncached
from decoding.sampling_params import GREEDY
from decoding.translate import max_new_tokens_for, pad_batch
from exports.export import export_hf
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_checkpoint
from model.generator import Generator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner, TranslatorRunner
from training.data import SHARED_DATA, read_lines

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = SHARED_DATA / "multi30k"
PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nNow", "To be", "JULIET:\nO", "MENENIUS:\n", "The king", "HAMLET:\n"]
GEN_SIZES = [1, 16, 64, 256]
IN_FLIGHT = [64, 256]
TESTS_TIMEOUT_S = 300


@dataclass(frozen=True)
class Tier:
    """How much work each part does."""

    sentences: int  # of test_2016, for the bf16 agreement and the translation throughput
    new_tokens: int  # per sequence in the generation throughput runs
    check_tokens: int  # per sequence in the exactness checks (the CUDA graph check: twice, past a key bucket)
    repeats: int  # timed runs, the best kept
    decode_steps: int  # batch-1 decode steps timed together
    copy_mib: int  # the tensor copied to measure bandwidth


TIERS = {
    "full": Tier(sentences=1000, new_tokens=128, check_tokens=40, repeats=3, decode_steps=200, copy_mib=1024),
    "quick": Tier(sentences=100, new_tokens=32, check_tokens=40, repeats=1, decode_steps=50, copy_mib=256),
    "cpu-quick": Tier(sentences=8, new_tokens=4, check_tokens=10, repeats=1, decode_steps=10, copy_mib=64),
}

Outputs = list[str]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_seconds(run: Callable[[], object], device: str, repeats: int) -> float:
    """The best wall time of repeats runs, on CUDA after one untimed warm-up (graph capture, allocator)."""
    if device == "cuda":
        run()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def offline_engine(checkpoint: Path, n_slots: int, device: str, dtype: WeightType, fixed_shape: bool | None = None) -> Engine:
    """The service's engine for an offline batch (no deadlines). fixed_shape: the runner's decode
    path, given (then without Engine.from_checkpoint's CPU packing), or None: its default (CUDA
    graphs on CUDA)."""
    config = EngineConfig(n_slots=n_slots, max_waiting=100_000, queue_timeout_s=None, request_timeout_s=None)
    if fixed_shape is None:
        return Engine.from_checkpoint(checkpoint, config, device, dtype)
    model, tokenizer = load_checkpoint(checkpoint, device, dtype)
    if isinstance(model, Generator):
        return Engine(GeneratorRunner(model, tokenizer, config, fixed_shape_decode=fixed_shape), config)
    return Engine(TranslatorRunner(model, tokenizer, n_slots, fixed_shape_decode=fixed_shape), config)


def engine_run(engine: Engine, prompts: list[list[int]], params: GenerationParams) -> tuple[list[list[int]], Outputs]:
    """Every prompt at once, stepped until done: each one's tokens and text (a beam search's best)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    tokens: list[list[int]] = [[] for _ in prompts]
    texts = [""] * len(prompts)
    while engine.has_work:
        for delta in engine.step().deltas:
            i = int(delta.request_id[1:])
            tokens[i] += delta.token_ids
            texts[i] += delta.text
    return tokens, texts


def run_tests(device: str) -> dict[str, Any]:
    """(a) pytest on tests/model and tests/engine with --device, in a subprocess: the counts."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/model", "tests/engine", "--device", device]
        command += ["-m", "not slow", "--continue-on-collection-errors", f"--junitxml={report}", "-W", "ignore::pytest.PytestConfigWarning"]
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"tests": f"timed out after {TESTS_TIMEOUT_S} s", "tests_passed": 0, "tests_failed": -1}
        print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
        if not report.exists():
            return {"tests": f"pytest exited {done.returncode} without a report", "tests_passed": 0, "tests_failed": -1}
        cases = list(ET.parse(report).getroot().iter("testcase"))
    not_collected = [c.get("name", "") for c in cases if any(e.get("message") == "collection failure" for e in c.iter("error"))]
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {
        "tests": f"pytest tests/model tests/engine --device {device} -m 'not slow'",
        "tests_passed": len(cases) - len(failed) - len(skipped),
        "tests_failed": len(failed) - len(not_collected),
        "tests_skipped": len(skipped),
        "tests_not_collected": not_collected,
    }


def exactness(device: str, sentences: list[str], n: int) -> dict[str, Any]:
    """(b) float32 engine against recomputation, and fixed-shape (CUDA graph) decode against dynamic."""
    generator = offline_engine(DEFAULT_GENERATOR, 4, device, torch.float32)
    prompts = [generator.runner.encode_prompt(p) for p in PROMPTS[:4]]
    tokens, _ = engine_run(generator, prompts, GenerationParams(sampling=GREEDY, max_tokens=n))
    model = generator.runner.model  # type: ignore[attr-defined]
    same = all(t == cut(generate_greedy_uncached(model, p, n), model.config.eos_id) for t, p in zip(tokens, prompts, strict=True))
    translator = offline_engine(DEFAULT_TRANSLATOR, 8, device, torch.float32)
    sources = [translator.runner.encode_prompt(s) for s in sentences[:4]]
    tokens, _ = engine_run(translator, sources, GenerationParams(sampling=GREEDY, max_tokens=n))
    model = translator.runner.model  # type: ignore[attr-defined]
    same &= tokens == greedy_translate_uncached(model, pad_batch(sources, model.config.pad_id).to(device), n)

    def outputs(fixed_shape: bool) -> list[Any]:
        gen = offline_engine(DEFAULT_GENERATOR, 8, device, torch.float32, fixed_shape)
        tra = offline_engine(DEFAULT_TRANSLATOR, 32, device, torch.float32, fixed_shape)
        srcs = [tra.runner.encode_prompt(s) for s in sentences[:8]]
        return [
            engine_run(gen, [gen.runner.encode_prompt(p) for p in PROMPTS], GenerationParams(sampling=GREEDY, max_tokens=2 * n))[0],
            engine_run(tra, srcs, GenerationParams(sampling=GREEDY, max_tokens=n))[0],
            engine_run(tra, srcs, GenerationParams(sampling=GREEDY, max_tokens=n, beam_size=4))[1],
        ]

    return {"engine_equals_recomputation": bool(same), "cuda_graph_equal": outputs(True) == outputs(False)}


def cut(tokens: list[int], eos_id: int) -> list[int]:
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def bf16_agreement(device: str, sentences: list[str], references: list[str]) -> dict[str, float]:
    """(b) greedy translations in bfloat16 against float32, by the engine."""
    texts = {}
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        engine = offline_engine(DEFAULT_TRANSLATOR, min(len(sentences), 256), device, dtype)
        texts[name] = engine_run(engine, [engine.runner.encode_prompt(s) for s in sentences], GenerationParams(sampling=GREEDY))[1]
    bleu = {name: sacrebleu.corpus_bleu(t, [references]).score for name, t in texts.items()}
    agreement = sum(a == b for a, b in zip(texts["fp32"], texts["bf16"], strict=True)) / len(sentences)
    return {
        "bf16_agreement": agreement,
        "fp32_bleu": bleu["fp32"],
        "bf16_bleu": bleu["bf16"],
        "bf16_bleu_delta": bleu["bf16"] - bleu["fp32"],
    }


def hf_model(folder: Path, device: str, dtype: torch.dtype, seq2seq: bool) -> tuple[Any, PreTrainedTokenizerBase]:
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model: Any = auto.from_pretrained(folder, dtype=dtype)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="right" if seq2seq else "left")
    if tokenizer.pad_token is None:  # GPT-NeoX tokenizers have none; the attention mask hides it
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def generation(device: str, dtype: torch.dtype, hf_folder: Path, new_tokens: int, repeats: int) -> dict[str, float]:
    """(c) generated tokens/s, ours and transformers', for each size of GEN_SIZES."""
    model, tokenizer = hf_model(hf_folder, device, dtype, seq2seq=False)
    results: dict[str, float] = {}
    for n in GEN_SIZES:
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        engine = offline_engine(DEFAULT_GENERATOR, n, device, dtype)
        prompts = [engine.runner.encode_prompt(t) for t in texts]
        counts: list[int] = []

        def ours(engine: Engine = engine, prompts: list[list[int]] = prompts, counts: list[int] = counts) -> None:
            counts[:] = [len(t) for t in engine_run(engine, prompts, GenerationParams(sampling=GREEDY, max_tokens=new_tokens))[0]]

        batch = tokenizer(texts, padding=True, return_tensors="pt").to(device)  # left-padded
        width = batch["input_ids"].shape[1]

        def theirs(batch: Any = batch, width: int = width) -> None:
            with torch.inference_mode():
                length = width + new_tokens
                model.generate(**batch, max_length=length, min_length=length, do_sample=False, pad_token_id=tokenizer.pad_token_id)

        seconds = best_seconds(ours, device, repeats)
        results[f"gen_tok_s_{n}"] = sum(counts) / seconds  # the last run's tokens (eos may end a sequence early)
        results[f"gen_transformers_tok_s_{n}"] = n * new_tokens / best_seconds(theirs, device, repeats)
        results[f"gen_vs_transformers_{n}"] = results[f"gen_tok_s_{n}"] / results[f"gen_transformers_tok_s_{n}"]
        print(
            f"  generate n={n:3d}: ours {results[f'gen_tok_s_{n}']:9.0f} tok/s, transformers {results[f'gen_transformers_tok_s_{n}']:9.0f}"
        )
    return results


def translation(device: str, dtype: torch.dtype, hf_folder: Path, sentences: list[str], repeats: int) -> dict[str, float]:
    """(c) sentences/s, ours and transformers', greedy and beam 4, at each size of IN_FLIGHT."""
    model, tokenizer = hf_model(hf_folder, device, dtype, seq2seq=True)
    max_len = model.config.max_position_embeddings
    ids: list[list[int]] = tokenizer(sentences)["input_ids"]  # MarianTokenizer appends </s>
    results: dict[str, float] = {}
    for in_flight in IN_FLIGHT:
        suffix = "" if in_flight == IN_FLIGHT[-1] else f"_{in_flight}"
        for work, beam in [("translate_greedy", 1), ("translate_beam4", 4)]:
            engine = offline_engine(DEFAULT_TRANSLATOR, min(in_flight, len(sentences)) * beam, device, dtype)
            sources = [engine.runner.encode_prompt(s) for s in sentences]
            params = GenerationParams(sampling=GREEDY) if beam == 1 else GenerationParams(beam_size=beam, length_penalty=1.0)
            order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
            batches = [[ids[i] for i in order[b : b + in_flight]] for b in range(0, len(order), in_flight)]
            options: dict[str, Any] = {"num_beams": beam, "length_penalty": 1.0, "early_stopping": True} if beam > 1 else {}

            def theirs(batches: list[list[list[int]]] = batches, options: dict[str, Any] = options) -> None:
                for batch in batches:
                    padded = tokenizer.pad({"input_ids": batch}, return_tensors="pt").to(device)
                    limit = max_new_tokens_for(max(len(s) for s in batch), max_len)
                    with torch.inference_mode():
                        model.generate(**padded, max_new_tokens=limit, do_sample=False, **options)

            ours_s = len(sentences) / best_seconds(partial(engine_run, engine, sources, params), device, repeats)
            theirs_s = len(sentences) / best_seconds(theirs, device, repeats)
            results |= {f"{work}_sent_s{suffix}": ours_s, f"{work}_transformers_sent_s{suffix}": theirs_s}
            results[f"{work}_vs_transformers{suffix}"] = ours_s / theirs_s
            print(f"  {work} {in_flight} in flight: ours {ours_s:8.1f} sent/s, transformers {theirs_s:8.1f}")
    return results


def bandwidth_floor(device: str, dtype: torch.dtype, tier: Tier) -> dict[str, float]:
    """(d) the batch-1 decode step against the weights' bytes over the measured copy bandwidth."""
    engine = offline_engine(DEFAULT_GENERATOR, 1, device, dtype)
    runner = engine.runner
    assert isinstance(runner, GeneratorRunner)
    steps = tier.decode_steps

    def decode() -> None:
        with torch.inference_mode():
            for position in range(steps):
                runner.decode_rows({0: (5, position % 64, [1, 2, 3, 4])})  # blocks 1-4: positions 0-63 at block size 16

    step = best_seconds(decode, device, tier.repeats) / steps
    size = tier.copy_mib * 2**20
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy = best_seconds(lambda: target.copy_(source), device, 3)
    plain, _ = load_checkpoint(DEFAULT_GENERATOR, "cpu", dtype)  # the engine's may be packed (CPU): count the weights as loaded
    weights = sum(p.numel() * p.element_size() for p in plain.parameters())
    bandwidth = 2 * size / copy  # bytes read and written per second
    floor = weights / bandwidth
    return {
        "decode_step_seconds": step,
        "weights_bytes": float(weights),
        "copy_bytes_per_s": bandwidth,
        "bandwidth_floor_seconds": floor,
        "decode_step_vs_bandwidth_floor": step / floor,
    }


def peak_memory(device: str) -> dict[str, Any]:
    """(e) the peak memory of the run."""
    if device == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(), "peak_memory_kind": "torch.cuda.max_memory_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"peak_memory_bytes": rss, "peak_memory_kind": "peak resident set of the process (resource.getrusage)"}


def markdown(report: dict[str, Any]) -> str:
    rows = [f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |" for key, value in report.items()]
    return "\n".join([f"# The GPU check on {report['device']}", "", "| key | value |", "|---|---|", *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer sentences, tokens and repeats (on the CPU: no tests)")
    parser.add_argument("--json", action="store_true", help="print the JSON object as the last line")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    args = parser.parse_args()
    device, quick = args.device, args.quick
    started = time.perf_counter()
    torch.manual_seed(0)
    cpu = device == "cpu"
    if cpu:
        torch.set_num_threads(1)  # as a Serve replica runs; on a busy machine two threads that wait for each other run far slower
    tier = TIERS["cpu-quick" if cpu and quick else "quick" if quick else "full"]
    dtype = torch.float32 if cpu else torch.bfloat16
    sentences, references = (read_lines(MULTI30K / f"test_2016_flickr.{lang}.gz")[: tier.sentences] for lang in ("en", "de"))
    report: dict[str, Any] = {"device": device, "dtype": str(dtype).removeprefix("torch."), "quick": quick}
    report |= {"tests": "skipped (--quick)"} if cpu and quick else run_tests(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    report |= exactness(device, sentences, tier.check_tokens)
    report |= bf16_agreement(device, sentences, references)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(DEFAULT_GENERATOR, Path(tmp) / "generator")
        export_hf(DEFAULT_TRANSLATOR, Path(tmp) / "translator")
        report |= generation(device, dtype, Path(tmp) / "generator", tier.new_tokens, tier.repeats)
        report |= translation(device, dtype, Path(tmp) / "translator", sentences, tier.repeats)
    report |= bandwidth_floor(device, dtype, tier)
    report |= peak_memory(device)
    report["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
