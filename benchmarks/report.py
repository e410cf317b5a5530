"""The figure tables of README.md and docs/*.md, generated from the results JSON.

    python -m benchmarks.report [--check]

A page holds regions

    <!-- report:NAME -->
    ...
    <!-- /report:NAME -->

whose contents are REPORTS[NAME] rendered from benchmarks/results/*.json, loadtests/sweep/sweep.json
and loadtests/scaling/timeline.json, so a figure on a page is always its run's. Without --check
every region is rewritten in place; with --check nothing is written, and the exit status is 1 when
a region differs from what the JSON gives (each such page and region is printed). A region that
names no report is an error either way.
"""

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests.sweep import markdown as sweep_markdown

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SWEEP = ROOT / "loadtests" / "sweep" / "sweep.json"
TIMELINE = ROOT / "loadtests" / "scaling" / "timeline.json"

REGION = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.DOTALL)

# The peers benchmark's works, as its JSON names them, and how a page names them.
WORKS = {
    "translate_greedy": "translation greedy, sentences/s (BLEU)",
    "translate_beam4": "translation beam 4, sentences/s (BLEU)",
    "generate_batch_1": "generation batch 1, tokens/s",
    "generate_batch_16": "generation batch 16, tokens/s",
}
# The targets set for the peers comparison: (ratio key suffix, the works it applies to, at least).
PEER_TARGETS = [
    ("_vs_transformers", list(WORKS), 2.0),
    ("_vs_ct2_float32", ["translate_greedy", "generate_batch_16"], 0.8),
    ("_vs_ct2_float32", ["translate_beam4", "generate_batch_1"], 0.5),
    ("_int8_vs_ct2_int8", ["translate_greedy"], 0.8),
]
RECORDED = (
    "Recorded figures of past runs, from `{file}`, which no run writes: the figures as first reported, with the commit that reported them."
)


def load(path: Path) -> Any:
    """The parsed JSON file at path."""
    return json.loads(path.read_text())


def result(name: str) -> Any:
    """benchmarks/results/<name>.json, parsed."""
    return load(RESULTS / f"{name}.json")


def num(x: float, digits: int = 0) -> str:
    """x with thousands separators and `digits` decimals."""
    return f"{x:,.{digits}f}"


def two(x: float) -> str:
    """x with two decimals."""
    return num(x, 2)


def bleu(x: float | None) -> str:
    """A BLEU score with two decimals, '-' when it was not measured."""
    return "-" if x is None else num(x, 2)


def signed(x: float) -> str:
    """x with its sign and the decimals it was recorded with (at least one)."""
    text = f"{x:+g}"
    return text if "." in text else text + ".0"


def span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """'lo-hi' of values (one value alone when they are equal)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def peer_ratios(peers: dict[str, Any], suffix: str) -> list[float]:
    """Every work's ratio <work><suffix> (e.g. '_vs_transformers') from peers.json."""
    return [peers[f"{work}{suffix}"] for work in WORKS]


def headline() -> str:
    """README: one row per subject, linking its docs page."""
    engine, peers, serving, front = result("engine"), result("peers"), result("serving"), result("front_door")
    overload, soak = result("overload_runs")["runs"], result("soak_runs")["runs"][-1]
    knee, scaling = load(SWEEP)["knee"], load(TIMELINE)["summary"]
    rows = [
        [
            "engine in-process, 1 thread: KV cache / batching 16 vs 1 / continuous vs static (throughput, p99)",
            f"{two(engine['kv_cache_speedup'])}x / {two(engine['batching_speedup_16'])}x / "
            f"{two(engine['continuous_vs_static_throughput'])}x, {two(engine['continuous_vs_static_p99'])}x",
            "[performance](docs/performance.md)",
        ],
        [
            "ours against transformers / CTranslate2 float32 (4 works, 1 thread)",
            f"{span(peer_ratios(peers, '_vs_transformers'), two)}x / {span(peer_ratios(peers, '_vs_ct2_float32'), two)}",
            "[performance](docs/performance.md)",
        ],
        [
            "ours int8 against CTranslate2 int8",
            span(peer_ratios(peers, "_int8_vs_ct2_int8"), two),
            "[performance](docs/performance.md)",
        ],
        [
            "HTTP streams against the engine in-process, 1 / 16 / 32 clients",
            " / ".join(two(serving[f"http_vs_inprocess_{n}_stream"]) for n in (1, 16, 32)),
            "[serving tax](docs/serving-tax.md)",
        ],
        [
            "a refused completion's p50 against `/healthz`'s (`ab`, 50 / 400 connections)",
            f"{two(front['refused_vs_healthz_p50_c50'])} / {two(front['refused_vs_healthz_p50_c400'])}",
            "[reliability](docs/reliability.md)",
        ],
        [
            f"burst of 3x capacity, {len(overload)} runs: accepted p99 against capacity; refused p50 against `/healthz`",
            f"{span([r['accepted_p99_ratio'] for r in overload], two)}x; {span([r['refused_vs_healthz_p50'] for r in overload], two)}x",
            "[reliability](docs/reliability.md)",
        ],
        [
            "5-minute soak, last run: ok / cancelled / failed; ingress memory",
            f"{num(soak['ok'])} / {num(soak['cancelled'])} / {soak['failures']}; {signed(soak['ingress_mb_per_min'])} MB/min",
            "[reliability](docs/reliability.md)",
        ],
        [
            "load sweep, one replica each: p99 TTFT past 3x its low-load value; mean batch below that",
            f"{knee['knee_users']} users ({num(knee['knee_ttft_p99_ms'])} ms); "
            f"{two(knee['below_knee_batch'])} at {knee['below_knee_users']} users",
            "[scaling](docs/scaling.md)",
        ],
        [
            "two-node autoscaling: second generator replica running; back to one",
            f"{scaling['generator_2_replicas_running_s']} s; {scaling['generator_back_to_1_s']} s "
            f"({num(scaling['requests'])} requests, {scaling['failures']} failed)",
            "[scaling](docs/scaling.md)",
        ],
    ]
    return table(["measure (2-core CPU)", "result", "details"], rows)


def speed() -> str:
    """README's Limitations: the speed figures, from the last peers and serving runs."""
    peers, serving = result("peers"), result("serving")
    return (
        f"- Speed (last runs, 1 thread): {span(peer_ratios(peers, '_vs_transformers'), two)}x transformers and "
        f"{span(peer_ratios(peers, '_vs_ct2_float32'), two)} of CTranslate2 in float32; int8 weights (`quantization: int8`) reach "
        f"{span(peer_ratios(peers, '_int8_vs_ct2_int8'), two)} of CTranslate2 int8 ([performance](docs/performance.md)). "
        f"Through HTTP, streams on 2 cores deliver {two(serving['http_vs_inprocess_16_stream'])} (16 clients) and "
        f"{two(serving['http_vs_inprocess_32_stream'])} (32) of the engine's in-process throughput "
        "([serving tax](docs/serving-tax.md))."
    )


def engine() -> str:
    """docs/performance.md: the in-process engine's ratios, 1 and 2 threads."""
    one, two_threads = result("engine"), result("engine_threads_2")
    rows = [
        (
            "kv_cache_speedup",
            f"generator, batch 1, {one['kv_cache_new_tokens']} new tokens: with KV cache {num(one['cached_tokens_per_s'])} tok/s, "
            f"recomputing the prefix {num(one['recompute_tokens_per_s'])} tok/s",
            ">= 5",
            2,
        ),
        (
            "batching_speedup_16",
            f"aggregate tok/s, 16 concurrent vs 1: {num(one['tokens_per_s_16'])} vs {num(one['tokens_per_s_1'])}",
            ">= 4",
            2,
        ),
        (
            "continuous_vs_static_throughput",
            f"{one['continuous_requests']} requests, Poisson arrivals at 1.5x the batch-16 rate, outputs of 8-200 tokens",
            ">= 1.3",
            2,
        ),
        (
            "continuous_vs_static_p99",
            f"p99 latency static {num(one['static_p99_latency_s'], 2)} s / continuous {num(one['continuous_p99_latency_s'], 2)} s; "
            f"mean batch {num(one['continuous_mean_batch_size'], 1)} vs {num(one['static_mean_batch_size'], 1)}",
            ">= 1.5",
            2,
        ),
        ("translator_sentences_per_s", "test_2016_flickr, 1,000 sentences, greedy, 64 slots", "", 0),
        (
            "translator_batching_speedup",
            f"first 100 sentences: batched vs one at a time ({num(one['translator_sequential_sentences_per_s'], 1)} sent/s)",
            ">= 4",
            2,
        ),
        ("peak_rss_mb", "peak resident memory, MB", "", 0),
    ]
    return table(
        ["measure", "what", "1 thread", "2 threads", "target"],
        [[f"`{key}`", what, f"**{num(one[key], digits)}**", num(two_threads[key], digits), target] for key, what, target, digits in rows],
    ) + measured_at(one)


def measured_at(data: dict[str, Any]) -> str:
    """The line under a table of one run's figures: the commit they were measured at, and the
    machine where the run says (runs before `benchmarks.provenance.machine` do not)."""
    on = f" on {data['machine']}" if "machine" in data else ""
    return f"\n\nMeasured at commit `{data['commit']}`{on}." if "commit" in data else ""


def engine_concurrency() -> str:
    """docs/performance.md: throughput and p99 latency against concurrency."""
    curve = result("engine")["concurrency_curve"]
    return table(
        ["concurrent requests (64 tokens each)", *(str(p["concurrency"]) for p in curve)],
        [
            ["generated tokens/s", *(num(p["tokens_per_s"]) for p in curve)],
            ["p99 request latency (s)", *(num(p["p99_latency_s"], 2) for p in curve)],
        ],
    )


def peers(name: str = "peers") -> str:
    """docs/performance.md: ours, ours int8, transformers and CTranslate2 on the four works
    (benchmarks/results/<name>.json)."""
    data = result(name)
    rows = []
    for work, label in WORKS.items():
        unit = "sentences_per_s" if work.startswith("translate") else "tokens_per_s"
        cells = []
        for system in ("ours", "ours_compiled", "ours_int8", "ours_int8_compiled", "transformers", "ct2_float32", "ct2_int8"):
            value, bleu = data.get(f"{work}_{unit}_{system}"), data.get(f"{work}_bleu_{system}")
            cell = "-" if value is None else num(value)  # a run without ours_compiled (in translation) or ours_int8_compiled
            cells.append(cell if bleu is None else f"{cell} ({num(bleu, 2)})")
        ratios = [data[f"{work}_vs_transformers"], data[f"{work}_vs_ct2_float32"], data.get(f"{work}_compiled_vs_ct2_float32")]
        ratios += [data[f"{work}_int8_vs_ct2_int8"], data.get(f"{work}_int8_compiled_vs_ct2_int8")]
        rows.append([label, *cells, *("-" if r is None else num(r, 2) for r in ratios)])
    header = ["work (1 thread)", "ours", "ours, compiled decode", "ours int8", "ours int8, compiled decode", "transformers"]
    header += ["CT2 float32", "CT2 int8", "ours / transformers", "ours / CT2 float32", "ours compiled / CT2 float32"]
    header += ["ours int8 / CT2 int8", "ours int8 compiled / CT2 int8"]
    return table(header, rows) + measured_at(data)


def peers_targets() -> str:
    """docs/performance.md: each target of the peers comparison against the last run."""
    data = result("peers")
    rows = []
    for suffix, works, least in PEER_TARGETS:
        for work in works:
            ratio = data[f"{work}{suffix}"]
            rows.append([f"`{work}{suffix}`", f">= {least:g}", two(ratio), "met" if ratio >= least else "**not met**"])
    return table(["ratio", "target", "last run", ""], rows)


def peers_history() -> str:
    """docs/performance.md: the recorded earlier peers runs, before each change."""
    runs = result("peers_history")["runs"]
    rows = [
        [
            r["before"],
            f"`{r['recorded_in']}`",
            " / ".join(two(x) for x in r["vs_transformers"]),
            " / ".join(two(x) for x in r["vs_ct2_float32"]),
            "-" if r["ours"] is None else " / ".join(num(x) for x in r["ours"]),
        ]
        for r in runs
    ]
    header = ["before", "commit", "ours / transformers", "ours / CT2 float32", "ours (sentences/s, tokens/s)"]
    return RECORDED.format(file="benchmarks/results/peers_history.json") + "\n\n" + table(header, rows)


def serving() -> str:
    """docs/serving-tax.md: HTTP against the engine in-process at 1, 16 and 32 clients."""
    data = result("serving")
    rows = []
    for n in (1, 16, 32):
        streamed = f"{num(data[f'http_{n}_stream_tok_s'])} (**{num(data[f'http_vs_inprocess_{n}_stream'], 2)}**)"
        plain = f"{num(data[f'http_{n}_nostream_tok_s'])} ({num(data[f'http_vs_inprocess_{n}_nostream'], 2)})"
        ttft = f"{num(data[f'inprocess_{n}_ttft_p50_ms'])} / {num(data[f'http_{n}_stream_ttft_p50_ms'])} ms"
        rows.append([str(n), num(data[f"inprocess_{n}_tok_s"]), streamed, plain, ttft])
    header = ["clients", "in-process tok/s", "streamed tok/s (ratio)", "not streamed tok/s (ratio)", "TTFT p50 in-process / streamed"]
    run = (
        f"commit `{data['commit']}`, {data['requests_per_client']} completions of at most {data['max_tokens']} tokens per client, "
        f"best of {data['repeats']}, Ray given {data['ray_cpus']} logical CPUs for the default service's replicas, {num(data['seconds'])} s"
    )
    return table(header, rows) + f"\n\nMeasured by `python -m benchmarks.serving --json` ({run})."


def front_door() -> str:
    """docs/reliability.md: `ab` against /healthz and a refused completion."""
    data = result("front_door")
    rows = []
    for c in (50, 400):
        healthz, refused = data[f"healthz_c{c}"], data[f"refused_completion_c{c}"]
        rows.append(
            [
                f"{c} connections",
                num(healthz["requests_per_s"]),
                f"{num(healthz['p50_ms'])} ms",
                num(refused["requests_per_s"]),
                f"{num(refused['p50_ms'])} ms",
                f"**{num(data[f'refused_vs_healthz_p50_c{c}'], 2)}**",
            ]
        )
    return table(["", "`/healthz` req/s", "p50", "refused completion req/s", "p50", "refused / healthz p50"], rows)


def overload() -> str:
    """docs/reliability.md: the recorded bursts of 3x capacity beside a /healthz burst."""
    data = result("overload_runs")
    rows = [
        [
            str(r["run"]),
            f"`{r['recorded_in']}`",
            str(r["accepted"]),
            f"{num(r['accepted_p99_s'], 2)} s ({num(r['accepted_p99_at_capacity_s'], 2)} s): **{num(r['accepted_p99_ratio'], 2)}x**",
            str(r["refused"]),
            f"{num(r['refused_p50_s'], 2)} s",
            f"{num(r['healthz_p50_s'], 2)} s: **{num(r['refused_vs_healthz_p50'], 2)}x**",
        ]
        for r in data["runs"]
    ]
    header = ["run", "commit", "accepted", "accepted p99 (at capacity)", "refused", "refused p50", "`/healthz` p50"]
    return RECORDED.format(file="benchmarks/results/overload_runs.json") + "\n\n" + table(header, rows)


def soak() -> str:
    """docs/reliability.md: the recorded soak runs."""
    data = result("soak_runs")
    rows = []
    for r in data["runs"]:
        tasks = r["asyncio_tasks_per_min"]
        rows.append(
            [
                str(r["run"]),
                f"`{r['recorded_in']}`",
                r["code"],
                num(r["ok"]),
                num(r["cancelled"]),
                str(r["failures"]),
                signed(r["ingress_mb_per_min"]),
                " to ".join(signed(x) for x in r["model_replicas_mb_per_min"]),
                "-" if tasks is None else " to ".join(signed(x) for x in tasks),
                r["note"],
            ]
        )
    header = ["run", "commit", "code", "ok", "cancelled", "failed", "ingress MB/min", "model replicas MB/min", "asyncio tasks /min", "note"]
    return RECORDED.format(file="benchmarks/results/soak_runs.json") + "\n\n" + table(header, rows)


def sweep() -> str:
    """docs/scaling.md: the load sweep, as loadtests.sweep writes it."""
    return sweep_markdown(load(SWEEP)).rstrip("\n")


def sweep_designs() -> str:
    """docs/scaling.md: the recorded sweeps of two earlier designs."""
    data = result("sweep_designs")
    rows = [
        [d["design"], f"{num(d['low_load_ttft_p99_ms'])} ms", f"{d['knee_users']} users", num(d["below_knee_batch"], 1)]
        for d in data["designs"]
    ]
    return (
        RECORDED.format(file="benchmarks/results/sweep_designs.json")
        + "\n\n"
        + table(["design", "low-load p99 TTFT", "knee", "mean batch below the knee"], rows)
    )


def scaling() -> str:
    """docs/scaling.md: the autoscaling run's timeline."""
    data = load(TIMELINE)
    summary, samples = data["summary"], data["timeline"]["samples"]
    seen = next(s["t"] for s in samples if sum(r["deployment"] == "Generator" for r in s["replicas"]) >= 2)
    kinds = summary["by_kind"]
    rows = [
        [f"{summary['load_start_s']}", "load starts"],
        [f"{seen:.1f}", "Serve starts a second generator replica (`max_replicas` is 2)"],
        [f"{summary['generator_2_replicas_running_s']}", "it runs, on the other node"],
        [f"{summary['load_end_s']}", "load ends"],
        [f"{summary['generator_back_to_1_s']}", "one generator replica again"],
    ]
    statuses = ", ".join(f"{n} x {status}" for status, n in summary["statuses"].items())
    return (
        table(["seconds", ""], rows)
        + f"\n\n{num(summary['requests'])} requests ({kinds['stream']} streams, {kinds['completion']} completions, "
        f"{kinds['translate']} translations): {statuses}; {summary['failures']} failed."
    )


def scores() -> str:
    """docs/training.md: the checkpoints' scores, measured side by side."""
    data = result("scores")
    translator = table(
        ["translator, sacreBLEU", "val beam 4", "val greedy", "test_2016 beam 4", "test_2016 greedy"],
        [
            [r["checkpoint"], bleu(r["val_beam4"]), bleu(r["val_greedy"]), bleu(r["test_2016_beam4"]), bleu(r["test_2016_greedy"])]
            for r in data["translator_bleu"]
        ],
    )
    generator = table(
        ["generator", "nats/char on the validation split"],
        [[r["checkpoint"], f"{r['nats_per_char']:.6f}"] for r in data["generator_nats_per_char"]],
    )
    return RECORDED.format(file="benchmarks/results/scores.json") + "\n\n" + translator + "\n\n" + generator


def generator_validation() -> str:
    """docs/training.md: the generator validation of 10 stretches, its halves, and stretch 9."""
    data = result("generator_validation")
    unseen = data["stretch_9_unseen_by_all_four"]["nats_per_char"]
    rows = [
        [r["name"], f"{r['A']:.4f}", f"{r['B']:.4f}", f"{r['all']:.4f}", f"{stretch_9:.4f}"]
        for r, stretch_9 in zip(data["checkpoints"], unseen.values(), strict=True)
    ]
    header = ["generator (nats/char)", "half A", "half B", "all 10 stretches", "stretch 9 (unseen by all four)"]
    spearman = ", ".join(f"{name.replace('_', ' ')} {value:.1f}" for name, value in data["spearman_A_B"].items())
    return table(header, rows) + f"\n\nSpearman of the halves' rankings: {spearman}."


def generator_validation_plays() -> str:
    """docs/training.md: the generators on the whole-play validation (issue 36), its halves, and what was shipped."""
    data = result("generator_validation_plays")
    halves = data["validation"]["halves"]
    rows = [[r["name"], f"{r['A']:.4f}", f"{r['B']:.4f}", f"{r['all']:.4f}", r["trained_on"]] for r in data["checkpoints"]]
    header = [
        "generator (nats/char)",
        f"half A: {halves['A']['play']}",
        f"half B: {halves['B']['play']}",
        "both plays",
        "trained on the held-out plays",
    ]
    spearman = ", ".join(f"{name.replace('_', ' ')} {value:.2f}" for name, value in data["spearman_A_B"].items())
    shipped = data["shipped"]
    return table(header, rows) + f"\n\nSpearman of the halves' rankings: {spearman}. Shipped: {shipped['what']}."


def training_speed() -> str:
    """docs/training.md: seconds per training step of the generator at 1 and 2 threads, float32 and bf16 autocast."""
    data = result("training_speed")
    rows = [
        [
            str(r["threads"]),
            "bf16 autocast" if r["bf16_autocast"] else "float32",
            f"{r['seconds_per_step']:.2f}",
            num(r["target_tokens_per_s"]),
            two(r["speedup_vs_1_thread_float32"]),
        ]
        for r in data["settings"]
    ]
    header = ["threads", "arithmetic", "s/step", "tokens/s", "x 1 thread float32"]
    run = f"`python -m benchmarks.training_speed --json benchmarks/results/training_speed.json`, commit `{data['commit']}`"
    return table(header, rows) + f"\n\nThe {data['model']}'s preset, {data['batch_size']} windows a step, on {data['machine']} ({run})."


def translator_bleu() -> str:
    """docs/training.md: the shipped translator's test_2016 BLEU as reported (cased, detokenized) and lowercased (13a)."""
    rows = []
    for name in ("greedy", "beam4"):
        data = result(f"translator_bleu_{name}")
        rows.append(
            [
                f"beam {data['beam_size']}" if data["beam_size"] > 1 else "greedy",
                two(data["bleu"]),
                two(data["bleu_lowercase"]),
                f"`{data['command']}`",
            ]
        )
    signatures = f"`{data['signature']}` and `{data['signature_lowercase']}`"
    return table(["test_2016_flickr", "sacreBLEU, cased", "sacreBLEU, lowercased", "command"], rows) + f"\n\nSignatures: {signatures}."


# The checkpoints of issue 57's comparison, as `training.evaluate generator-validation` names them:
# (how the page names them, what of the held-out text they trained on).
ON_THE_TAIL = "the tail's first 62,665 characters (the six training plays)"
GENERATORS_57 = {
    "runs/first-generator": ("first checkpoint (0ed1488)", "half A (the first 90% of train.txt)"),
    "runs/shipped-generator": ("shipped before (327c95a, continued training)", "half A (the first 90% of train.txt)"),
    "runs/gen57/best": ("(a) first recipe, 32 windows, dropout 0.2", ON_THE_TAIL),
    "runs/gen57b/best": ("(b) annealed from (a)'s best", ON_THE_TAIL),
    "runs/gen57c/best": ("(c) 16 windows, dropout 0.3", ON_THE_TAIL),
}
NEW_57 = ("runs/gen57/best", "runs/gen57b/best", "runs/gen57c/best")


def generator_training() -> str:
    """docs/training.md: issue 57's generators against the first and the shipped one on the
    whole-play validation and the last 10% of train.txt, what was shipped, and each run's curve."""
    data = result("generator_training")
    header = [
        "generator (nats/char)",
        "half A: Richard II",
        "half B: the Shrew's start",
        "both plays",
        "last 10% of train.txt",
        "trained on",
    ]
    rows = [
        [GENERATORS_57[r["checkpoint"]][0], *(f"{r[key]:.4f}" for key in ("A", "B", "all", "also")), GENERATORS_57[r["checkpoint"]][1]]
        for r in data["checkpoints"]
    ]
    by_name = {r["checkpoint"]: r for r in data["checkpoints"]}
    chosen = min(NEW_57, key=lambda name: by_name[name]["all"])  # chosen on both plays, as the runs selected
    new, shipped = by_name[chosen], by_name["runs/shipped-generator"]
    outcome = "shipped" if new["B"] < shipped["B"] else "not shipped: it is not better on half B"
    text = (
        table(header, rows)
        + f"\n\nThe best new generator on both plays is {GENERATORS_57[chosen][0]}: on half B {new['B']:.4f} against the"
        + f" shipped one's {shipped['B']:.4f}, so it is {outcome}. Measured by `{data['command']}`."
    )
    for run in result("generator_training_runs"):
        training = run["training"]
        curve = [
            [num(h["step"]), f"{h['minutes']:.1f}", f"{h['loss']:.3f}", f"{h['val_A']:.4f}", f"{h['val_B']:.4f}", f"{h['val']:.4f}"]
            for h in training["validation_history"]
        ]
        text += (
            f"\n\n{GENERATORS_57[run['checkpoint']][0]}: `{training['command']}` ({training['torch_threads']} threads, bf16 autocast"
            f" {'on' if training['bf16_autocast'] else 'off'}, {training['parameters']:,} parameters)\n\n"
            + table(["step", "training minutes", "training loss (per token)", "half A", "half B", "both plays"], curve)
        )
    return text


def figure(value: float | None, digits: int = 0) -> str:
    """A measured figure, '-' when there is none (nothing completed, or the system did not run)."""
    return "-" if value is None else num(value, digits)


def both(figures: dict[str, dict[str, Any]], key: str, digits: int = 0) -> str:
    """'vLLM's / ours' of one figure of a vs_vllm scenario."""
    return " / ".join(figure(figures.get(system, {}).get(key), digits) for system in ("vllm", "ours"))


def json_flag(name: str, default: str) -> str:
    """The --json flag that writes benchmarks/results/<name>.json, where the command's default file is <default>.json."""
    return "--json" if name == default else f"--json benchmarks/results/{name}.json"


def vs_vllm(name: str = "vs_vllm") -> str:
    """docs/performance.md: ours against vLLM's CPU build, scenario by scenario, with the ratios
    ours / vLLM (the stall check: the streams' longest gap, and the long prompt's first token),
    from benchmarks/results/<name>.json."""
    data = result(name)
    rows = []
    for scenario in data["scenarios"].values():
        figures, ratios = scenario["figures"], scenario["ratios"]
        stall = any("longest_gap_ms" in f for f in figures.values())
        measure, first = ("longest_gap", "long_prompt_ttft") if stall else ("output_tok_s", "ttft_p50")
        rows.append(
            [
                scenario["label"],
                f"longest gap {both(figures, 'longest_gap_ms')} ms" if stall else both(figures, "output_tok_s", 1),
                f"**{figure(ratios.get(measure), 2)}**",
                f"long prompt {both(figures, 'long_prompt_ttft_ms')}" if stall else both(figures, "ttft_p50_ms"),
                f"**{figure(ratios.get(first), 2)}**",
                "" if stall else both(figures, "ttft_p99_ms"),
                f"{both(figures, 'failed')} of {max(f['requests'] for f in figures.values())}",
            ]
        )
    header = ["work", "output tok/s, vLLM / ours", "ours / vLLM", "TTFT p50 ms, vLLM / ours", "ours / vLLM", "TTFT p99 ms", "failed"]
    return table(header, rows) + measured_by(data, "python -m benchmarks.vs_vllm " + json_flag(name, "vs_vllm"))


def vs_vllm_tiny(name: str = "vs_vllm_tiny") -> str:
    """docs/performance.md: ours against vLLM's CPU build on the tiny Llama, where the engine's own
    cost shows: throughput, TTFT and ITL, and our engine step's time per sequence
    (benchmarks/results/<name>.json)."""
    data = result(name)
    rows = []
    for scenario in data["scenarios"].values():
        figures, ratios = scenario["figures"], scenario["ratios"]
        rows.append(
            [
                scenario["label"],
                both(figures, "output_tok_s", 1),
                f"**{figure(ratios.get('output_tok_s'), 2)}**",
                both(figures, "ttft_p50_ms"),
                both(figures, "itl_p50_ms", 1),
                f"**{figure(ratios.get('itl_p50'), 2)}**",
                figure(figures.get("ours", {}).get("step_us_per_sequence")),
                f"{both(figures, 'failed')} of {max(f['requests'] for f in figures.values())}",
            ]
        )
    header = ["work", "output tok/s, vLLM / ours", "ours / vLLM", "TTFT p50 ms, vLLM / ours", "ITL p50 ms, vLLM / ours", "ours / vLLM"]
    header += ["ours: engine step µs per sequence", "failed"]
    return table(header, rows) + measured_by(data, "python -m benchmarks.vs_vllm --tiny " + json_flag(name, "vs_vllm_tiny"))


def vs_vllm_speculation(name: str = "vs_vllm_speculation", flags: str = "") -> str:
    """docs/performance.md: speculative decoding, ours against ours with it off (ours_nospec), and
    against vLLM's CPU build where it ran, with the acceptance ours' counters give: the run of
    benchmarks/results/<name>.json, made with vs_vllm's `flags`."""
    data = result(name)
    systems = ("vllm", "ours", "ours_nospec")
    rows = []
    for scenario in data["scenarios"].values():
        figures, ratios = scenario["figures"], scenario["ratios"]
        ours = figures.get("ours", {})
        rows.append(
            [
                scenario["label"],
                " / ".join(figure(figures.get(system, {}).get("output_tok_s"), 1) for system in systems),
                f"**{figure(ratios.get('speculation_output_tok_s'), 2)}**",
                f"**{figure(ratios.get('output_tok_s'), 2)}**",
                " / ".join(figure(figures.get(system, {}).get("ttft_p50_ms")) for system in systems),
                f"{figure(ours.get('acceptance_rate'), 2)} / {figure(ours.get('mean_accepted_length'), 2)}",
                " / ".join(figure(figures.get(system, {}).get("failed")) for system in systems)
                + f" of {max(f['requests'] for f in figures.values())}",
            ]
        )
    header = ["work", "output tok/s, vLLM / ours / ours without speculation", "ours / ours without", "ours / vLLM"]
    header += ["TTFT p50 ms, the same", "acceptance rate / mean accepted length", "failed"]
    scenarios = ",".join(data["scenarios"])
    command = f"python -m benchmarks.vs_vllm {flags}--systems vllm,ours,ours_nospec --scenarios {scenarios} --json FILE"
    return table(header, rows) + measured_by(data, command)


def translator_drafting() -> str:
    """docs/performance.md: decoder steps of greedy translation that n-gram drafting could save
    (benchmarks/results/translator_drafting.json)."""
    data = result("translator_drafting")
    rows = [
        [context, recent, f"**{data[f'{key}_tokens_per_step']:.3f}**"]
        for context, recent, key in (
            ("the output", "no", "output"),
            ("the output", "yes", "output_and_recent"),
            ("the source, then the output", "no", "source_and_output"),
            ("the source, then the output", "yes", "source_and_output_and_recent"),
        )
    ]
    run = f"commit `{data['commit']}`, {num(data['sentences'])} sentences, {num(data['tokens'])} tokens, up to {data['k']} proposed a step"
    header = ["the proposer reads", "and the answers before it", "tokens a step (greedy, verification free)"]
    return table(header, rows) + f"\n\nMeasured by `python -m benchmarks.translator_drafting --json` ({run})."


AGREEMENTS = ("top1_agreement", "top1_agreement_float_activations", "top1_agreement_llama_cpp_with_itself")


def gguf_llama_cpp(name: str = "gguf_llama_cpp") -> str:
    """docs/performance.md: GGUF files served by ours and by llama.cpp, one thread each
    (benchmarks/results/<name>.json)."""
    data = result(name)
    rows = []
    for f in data["files"]:
        rows.append(
            [
                f["file"].rsplit("-", 1)[-1].removesuffix(".gguf"),
                f"{num(f['decode_tok_s_llama_cpp'], 1)} / {num(f['decode_tok_s_ours'], 1)} / {num(f['decode_tok_s_ours_compiled'], 1)}",
                f"**{two(f['decode_tok_s_ratio'])}** / **{two(f['decode_tok_s_compiled_ratio'])}**",
                f"{num(f['prompt_tok_s_llama_cpp'])} / {num(f['prompt_tok_s_ours'])}",
                f"**{two(f['prompt_tok_s_ratio'])}**",
                " / ".join(f"{f[key]:.1%}" for key in AGREEMENTS),
                two(f["resident_over_file"]),
            ]
        )
    header = ["file", "decode tok/s at batch 1, llama.cpp / ours / ours compiled", "ours / llama.cpp: eager / compiled"]
    header += ["512-token prompt tok/s, llama.cpp / ours"]
    header += [
        "ours / llama.cpp",
        "top-1 agreement with llama.cpp: ours with 8-bit / float32 activations / llama.cpp one token at a time",
        "ours' resident weights / file",
    ]
    run = f"commit `{data['commit']}`, {data['llama_cpp']}, {data['threads']} thread each, {data['machine']}"
    return (
        table(header, rows) + f"\n\nMeasured by `python -m benchmarks.gguf --json` ({run}; files of {data['folder'].rsplit('/', 1)[-1]})."
    )


def gguf_agreement() -> str:
    """docs/performance.md: top-1 agreement with llama.cpp on a trained model's GGUF files
    (benchmarks/results/gguf_agreement.json)."""
    data = result("gguf_agreement")
    rows = [
        [
            f["file"].rsplit("-", 1)[-1].removesuffix(".gguf"),
            num(f["positions"]),
            f"**{f['top1_agreement']:.2%}**",
            f"**{f['top1_agreement_f32_kv']:.2%}**",
            f"{f['top1_agreement_llama_cpp_with_itself']:.2%}",
        ]
        for f in data["files"]
    ]
    header = ["file", "positions", "ours / llama.cpp (its float16 KV cache)", "ours / llama.cpp with a float32 KV cache"]
    header += ["llama.cpp / itself one token at a time"]
    run = f"commit `{data['commit']}`, {data['llama_cpp']}, {data['threads']} thread each, {data['machine']}"
    folder = "/".join(data["folder"].split("/")[-3:])
    return table(header, rows) + f"\n\nMeasured by `python -m benchmarks.gguf_agreement --json` ({run}; files of {folder})."


def measured_by(data: dict[str, Any], command: str) -> str:
    """The line under a vs_vllm table: the command, and the run's commit, systems, model and machine."""
    ours = f"ours: `{data['ours']}`, " if "ours" in data else ""
    run = f"commit `{data['commit']}`, {data['vllm']}, {ours}{data['model']}, {data['machine']}, {num(data['seconds'])} s in all"
    return f"\n\nMeasured by `{command}` ({run})."


REPORTS: dict[str, Callable[[], str]] = {
    "headline": headline,
    "speed": speed,
    "engine": engine,
    "engine-concurrency": engine_concurrency,
    "peers": peers,
    "peers-avx2": lambda: peers("peers_avx2"),
    "peers-targets": peers_targets,
    "peers-history": peers_history,
    "vs-vllm": vs_vllm,
    "vs-vllm-avx2": lambda: vs_vllm("vs_vllm_avx2"),
    "vs-vllm-tiny": vs_vllm_tiny,
    "vs-vllm-tiny-avx2": lambda: vs_vllm_tiny("vs_vllm_tiny_avx2"),
    "vs-vllm-speculation": vs_vllm_speculation,
    "vs-vllm-speculation-avx2": lambda: vs_vllm_speculation("vs_vllm_speculation_avx2"),
    "vs-vllm-copy": lambda: vs_vllm_speculation("vs_vllm_copy", "--copy FOLDER "),
    "vs-vllm-copy-avx2": lambda: vs_vllm_speculation("vs_vllm_copy_avx2", "--copy FOLDER "),
    "translator-drafting": translator_drafting,
    "gguf-llama-cpp": gguf_llama_cpp,
    "gguf-llama-cpp-avx2": lambda: gguf_llama_cpp("gguf_llama_cpp_avx2"),
    "gguf-agreement": gguf_agreement,
    "vs-vllm-gguf": lambda: vs_vllm_speculation("vs_vllm_gguf_Q4_1", "--gguf Q4_1 "),
    "serving": serving,
    "front-door": front_door,
    "overload": overload,
    "soak": soak,
    "sweep": sweep,
    "sweep-designs": sweep_designs,
    "scaling": scaling,
    "scores": scores,
    "generator-validation": generator_validation,
    "generator-validation-plays": generator_validation_plays,
    "generator-training": generator_training,
    "translator-bleu": translator_bleu,
    "training-speed": training_speed,
}


def pages() -> list[Path]:
    """The pages that may hold regions: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(text: str) -> str:
    """text with every region's body replaced by its report; ValueError for an unknown report."""

    def body(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in REPORTS:
            raise ValueError(f"no report named {name!r}")
        return f"{match[1]}{REPORTS[name]()}\n{match[4]}"

    return REGION.sub(body, text)


def stale(text: str) -> list[str]:
    """The names of text's regions whose body is not what their report gives now."""
    rendered = {m["name"]: m["body"] for m in REGION.finditer(render(text))}
    return [m["name"] for m in REGION.finditer(text) if m["body"] != rendered[m["name"]]]


def main(argv: list[str] | None = None) -> int:
    """Rewrite every page's regions, or with --check report stale ones: 0 when none, else 1."""
    parser = argparse.ArgumentParser(description="Rewrite the docs' figure tables from the results JSON.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a region differs from its JSON")
    args = parser.parse_args(argv)
    status = 0
    for page in pages():
        text = page.read_text()
        if args.check:
            for name in stale(text):
                print(f"{page.relative_to(ROOT)}: region {name!r} differs from its JSON (python -m benchmarks.report)")
                status = 1
        else:
            updated = render(text)
            if updated != text:
                page.write_text(updated)
                print(f"rewrote {page.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
