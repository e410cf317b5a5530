"""Engine benchmarks on the shipped checkpoints: ratios measured side by side in one run.

    python -m benchmarks.engine [--json] [--quick] [--threads 1] [--out benchmarks/results]

Prints a table; with --json the last line is one JSON object. Writes engine.json and a PNG of
throughput and p99 latency against concurrency into --out. --quick (shorter outputs, fewer
requests and sentences) checks the script; its files go to a temporary folder unless --out says
where.
"""

import argparse
import json
import os
import random
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.provenance import commit
from decoding.reference_decoding import generate_greedy_uncached
from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint
from model.generator import Generator
from service.engine.config import BatchingPolicy, EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from training.data import SHARED_DATA, read_lines

RESULTS = Path("benchmarks/results")
QUICK_RESULTS = Path(tempfile.gettempdir()) / "benchmarks-quick"
PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nNow", "To be", "JULIET:\nO", "MENENIUS:\n", "The", "HAMLET:\n"]


def kv_cache_speedup(model: Generator, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """Batch 1: the engine (KV cache) against recomputing the whole prefix every step."""
    engine = generator_engine(1)
    request = Request("kv", prompt, GenerationParams(sampling=GREEDY, max_tokens=new_tokens))
    cached_tokens: list[int] = []
    started = time.perf_counter()
    engine.add_request(request)
    while engine.has_work:
        for delta in engine.step().deltas:
            cached_tokens += delta.token_ids
    cached_s = time.perf_counter() - started
    started = time.perf_counter()
    full = generate_greedy_uncached(model, prompt, new_tokens)
    full_s = time.perf_counter() - started
    assert cached_tokens == full, "cached and recomputed greedy decoding disagree"
    return {
        "cached_tokens_per_s": new_tokens / cached_s,
        "recompute_tokens_per_s": new_tokens / full_s,
        "kv_cache_speedup": full_s / cached_s,
    }


@dataclass
class Arrival:
    at: float  # seconds after the start
    request: Request


def replay(engine: Engine, arrivals: list[Arrival]) -> dict[str, float]:
    """Feeds requests at their arrival times and steps the engine until all finish. Returns
    throughput (generated tokens/s over the run) and latency percentiles (arrival to last token)."""
    pending = sorted(arrivals, key=lambda a: a.at)
    arrived: dict[str, float] = {}
    finished: dict[str, float] = {}
    tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            engine.add_request(a.request)
            arrived[a.request.request_id] = a.at
        if not engine.has_work:
            time.sleep(max(0.0, pending[0].at - now))
            continue
        for delta in engine.step().deltas:
            tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                finished[delta.request_id] = time.perf_counter() - start
    makespan = time.perf_counter() - start
    latencies = sorted(finished[k] - arrived[k] for k in finished)
    return {
        "tokens_per_s": tokens / makespan,
        "requests": len(latencies),
        "p50_latency_s": latencies[len(latencies) // 2],
        "p99_latency_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_batch_size": engine.counters.batch_size_sum / max(1, engine.counters.steps),
    }


def generator_requests(engine: Engine, n: int, lengths: list[int], prefix: str) -> list[Request]:
    prompts = [engine.runner.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    return [Request(f"{prefix}{i}", p, GenerationParams(sampling=GREEDY, max_tokens=lengths[i])) for i, p in enumerate(prompts)]


def generator_engine(n_slots: int, policy: BatchingPolicy = "continuous") -> Engine:
    return Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=n_slots, max_waiting=10_000, policy=policy))


def batching_speedup(concurrency: int, tokens: int) -> dict[str, float]:
    one_engine, many_engine = generator_engine(1), generator_engine(concurrency)
    one = replay(one_engine, [Arrival(0.0, r) for r in generator_requests(one_engine, 1, [tokens], "a")])
    many = replay(many_engine, [Arrival(0.0, r) for r in generator_requests(many_engine, concurrency, [tokens] * concurrency, "b")])
    return {
        "tokens_per_s_1": one["tokens_per_s"],
        f"tokens_per_s_{concurrency}": many["tokens_per_s"],
        "speedup": many["tokens_per_s"] / one["tokens_per_s"],
    }


def continuous_vs_static(n_requests: int, n_slots: int, capacity_tokens_per_s: float, load: float, seed: int) -> dict[str, float]:
    """The same Poisson trace of requests with mixed output lengths through both policies."""
    rng = random.Random(seed)
    lengths = [rng.choice([8, 16, 32, 64, 128, 200]) for _ in range(n_requests)]
    rate = load * capacity_tokens_per_s / (sum(lengths) / n_requests)  # requests per second
    times, t = [], 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate)
        times.append(t)
    results = {}
    policies: tuple[BatchingPolicy, ...] = ("continuous", "static")
    for policy in policies:
        engine = generator_engine(n_slots, policy)
        requests = generator_requests(engine, n_requests, lengths, policy)
        results[policy] = replay(engine, [Arrival(at, r) for at, r in zip(times, requests, strict=True)])
    return {
        "continuous_vs_static_throughput": results["continuous"]["tokens_per_s"] / results["static"]["tokens_per_s"],
        "continuous_vs_static_p99": results["static"]["p99_latency_s"] / results["continuous"]["p99_latency_s"],
        "arrival_rate_per_s": rate,
        **{f"{p}_{k}": v for p, r in results.items() for k, v in r.items()},
    }


def translator_throughput(sentences: list[str], sequential_sample: int) -> dict[str, float]:
    engine = Engine.from_checkpoint(DEFAULT_TRANSLATOR, EngineConfig(n_slots=64, max_waiting=10_000), "cpu")
    sources = [engine.runner.encode_prompt(s) for s in sentences]
    requests = [
        Request(f"t{i}", ids, GenerationParams(sampling=GREEDY, max_tokens=engine.runner.default_max_tokens(len(ids))))
        for i, ids in enumerate(sources)
    ]
    started = time.perf_counter()
    replay(engine, [Arrival(0.0, r) for r in requests])
    batched = len(sentences) / (time.perf_counter() - started)
    sample = sentences[:sequential_sample]
    one = Engine.from_checkpoint(DEFAULT_TRANSLATOR, EngineConfig(n_slots=1, max_waiting=10_000), "cpu")
    started = time.perf_counter()
    for i, s in enumerate(sample):
        ids = one.runner.encode_prompt(s)
        replay(
            one,
            [Arrival(0.0, Request(f"s{i}", ids, GenerationParams(sampling=GREEDY, max_tokens=one.runner.default_max_tokens(len(ids)))))],
        )
    sequential = len(sample) / (time.perf_counter() - started)
    started = time.perf_counter()
    replay(engine, [Arrival(0.0, Request(f"u{i}", r.prompt_ids, r.params)) for i, r in enumerate(requests[:sequential_sample])])
    batched_sample = len(sample) / (time.perf_counter() - started)
    return {
        "translator_sentences_per_s": batched,
        "translator_sequential_sentences_per_s": sequential,
        "translator_batching_speedup": batched_sample / sequential,
    }


def concurrency_curve(levels: list[int], tokens: int) -> list[dict[str, float]]:
    rows = []
    for c in levels:
        engine = generator_engine(c)
        r = replay(engine, [Arrival(0.0, q) for q in generator_requests(engine, c, [tokens] * c, f"c{c}-")])
        rows.append({"concurrency": c, "tokens_per_s": r["tokens_per_s"], "p99_latency_s": r["p99_latency_s"]})
    return rows


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    levels = [r["concurrency"] for r in rows]
    ax.plot(levels, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue", label="generated tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens/s", color="tab:blue")
    twin = ax.twinx()
    twin.plot(levels, [r["p99_latency_s"] for r in rows], "s--", color="tab:red", label="p99 latency")
    twin.set_ylabel("p99 request latency (s)", color="tab:red")
    ax.set_title("Generator engine on CPU: throughput and latency vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help=f"where engine.json and its PNG go (default: {RESULTS})")
    parser.add_argument("--quick", action="store_true", help=f"smaller runs, to check the script (files to {QUICK_RESULTS})")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, as a Serve replica runs: Ray sets OMP_NUM_THREADS to its num_cpus (1 in deploy/)",
    )
    args = parser.parse_args()
    out: Path = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    assert isinstance(model, Generator)
    new_tokens = 64 if args.quick else 256
    prompt = tokenizer.encode("\n")[:1]
    new_tokens = min(new_tokens, model.config.max_len - len(prompt))
    results: dict[str, object] = {
        "commit": commit(),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "kv_cache_new_tokens": new_tokens,
    }
    results.update(kv_cache_speedup(model, prompt, new_tokens))
    cores = os.cpu_count() or 1
    if cores != args.threads:  # the same ratio with every core on one request, where recomputation gains most
        torch.set_num_threads(cores)
        results[f"kv_cache_speedup_{cores}_threads"] = kv_cache_speedup(model, prompt, new_tokens)["kv_cache_speedup"]
        torch.set_num_threads(args.threads)
    tokens = 32 if args.quick else 128
    batching = batching_speedup(16, tokens)
    results["batching_speedup_16"] = batching["speedup"]
    results.update({k: v for k, v in batching.items() if k != "speedup"})
    results.update(continuous_vs_static(24 if args.quick else 64, 16, batching["tokens_per_s_16"], load=1.5, seed=0))
    sentences = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")
    results.update(translator_throughput(sentences[:100] if args.quick else sentences, 20 if args.quick else 100))
    rows = concurrency_curve([1, 2, 4, 8, 16, 32] if not args.quick else [1, 4], 32 if args.quick else 64)
    results["concurrency_curve"] = rows
    plot(rows, out / "engine_concurrency.png")
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'metric':40s} value")
    for key, value in results.items():
        if isinstance(value, float):
            print(f"{key:40s} {value:10.2f}")
    for r in rows:
        print(f"  concurrency {r['concurrency']:3.0f}: {r['tokens_per_s']:8.1f} tokens/s, p99 {r['p99_latency_s']:6.2f} s")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
