"""Load sweep: steps the number of Locust users against a running service and records, per step,
throughput, latency percentiles and the generator's mean engine batch size.

    .venv/bin/python -m loadtests.sweep --host http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8080/metrics

Each step is one headless Locust run (a subprocess, `--step-seconds` long) of loadtests/locustfile.py.
Every step runs `--translation-users` translation users (default 1: a constant background of
translation traffic) and streaming generator users for the rest, so the steps vary the streaming
load alone. By default users do not pause between requests: each user is one request in flight,
and the generator users of a step are its concurrent streams. Per step:

- requests/s (HTTP requests of all routes, 429/503 excluded) and rejected/s (429/503), over the step's
  nominal length; translation requests/s alone for the translation curve. A request still in flight
  when the step ends is waited for (Locust's `--stop-timeout`, the locustfile's request timeout) and
  counted: the slowest requests stay in the percentiles, and a step shorter than one request still
  measures it;
- generated tokens/s: client side from the streams' usage (`stream` row: count x mean tokens), and
  server side from the delta of `ray_serving_generation_tokens_total{model=transformer-shakespeare}`;
- p50/p95/p99 of TTFT, ITL (one sample per gap between text frames) and single-sentence
  `/v1/translate` latency (beam 4), from Locust's stats CSV (Locust rounds times above 100 ms to 2-3
  significant digits);
- the generator's mean batch size: delta of `ray_serving_batch_size_sum` / delta of
  `ray_serving_batch_size_count` for the generator, summed over replicas (a mean over engine steps).

Ray exports replica metrics every few seconds, so metrics are scraped `--settle-seconds` after each
run, when the service is idle again; consecutive scrapes then bracket exactly one step.
Writes sweep.json, sweep.md and sweep.png under `--out`; Locust's CSVs go under `--results`.
The whole sweep stops starting new steps once `--budget-seconds` would be exceeded.
"""

import argparse
import csv
import json
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

GENERATOR = "transformer-shakespeare"
LOCUSTFILE = Path(__file__).parent / "locustfile.py"
METRICS = ("ray_serving_batch_size_sum", "ray_serving_batch_size_count", "ray_serving_generation_tokens_total")
TTFT, ITL, STREAM = ("SSE", "ttft /v1/completions"), ("SSE", "itl /v1/completions"), ("SSE", "stream /v1/completions")
TRANSLATE = ("POST", "/v1/translate")
ROUTE_ROWS = {
    "translate": TRANSLATE,
    "translate_list": ("POST", "/v1/translate [list]"),
    "libretranslate": ("POST", "/translate"),
    "ttft": TTFT,
    "itl": ITL,
    "stream": STREAM,
}
KNEE_FACTOR = 3.0
DRAIN_SECONDS = 120  # loadtests/locustfile.py's TIMEOUT_S: no request outlives it
KNEE_KEYS = (
    "baseline_users", "baseline_ttft_p99_ms", "knee_users", "knee_ttft_p99_ms", "below_knee_users", "below_knee_batch",
    "below_knee_tokens_per_step",
)  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="http://127.0.0.1:8000")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics")
    parser.add_argument("--users", default="2,3,5,7,9,13,17,25,33", help="comma-separated user counts, one step each")
    parser.add_argument("--step-seconds", type=int, default=60)
    parser.add_argument("--translation-users", type=int, default=1, help="translation users in every step; the rest stream")
    parser.add_argument(
        "--think-max-seconds", type=float, default=0.0, help="users' pause between requests; 0: one request in flight per user"
    )
    parser.add_argument("--settle-seconds", type=float, default=11.0, help="idle time before each metrics scrape (Ray exports every 10 s)")
    parser.add_argument("--budget-seconds", type=float, default=900.0, help="no step starts that would end after this")
    parser.add_argument("--out", type=Path, default=Path("loadtests/sweep"))
    parser.add_argument("--results", type=Path, default=Path("loadtests/results/sweep"))
    parser.add_argument("--from-json", type=Path, default=None, help="rewrite sweep.md and sweep.png from this sweep.json; runs nothing")
    return parser.parse_args(argv)


def scrape(url: str) -> dict[str, float]:
    """The generator's METRICS, each summed over replicas (0 when not exported yet)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode("utf-8")
    totals = dict.fromkeys(METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("model") == GENERATOR:
                totals[sample.name] += sample.value
    return totals


def number(value: str) -> float | None:
    """A Locust CSV cell as a number; None for "N/A" or empty."""
    try:
        return float(value)
    except ValueError:
        return None


def read_stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """Locust's `_stats.csv` rows by (type, name), without the Aggregated row."""
    with path.open(newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f) if row["Name"] != "Aggregated"}


def percentiles(row: dict[str, str] | None) -> dict[str, float | None]:
    """p50/p95/p99 in ms of one stats row (None when the row is missing or empty)."""
    if row is None or not int(row["Request Count"]):
        return {"p50": None, "p95": None, "p99": None}
    return {"p50": number(row["50%"]), "p95": number(row["95%"]), "p99": number(row["99%"])}


def run_locust(
    users: int, seconds: int, host: str, prefix: Path, think_max_seconds: float, translation_users: int
) -> subprocess.CompletedProcess[str]:
    """One headless run; thresholds are disabled, since an overloaded step is data, not an error."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    weights = [{"user_class_name": "TranslationUser", "fixed_count": translation_users}]
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--host", host, "--csv", str(prefix),
        "--ttft-p95-ms", "1e12", "--max-fail-ratio", "1", "--think-max-seconds", str(think_max_seconds),
        "--config-users", json.dumps(weights), "--stop-timeout", str(DRAIN_SECONDS),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + DRAIN_SECONDS + 60, check=False)


def summarize(users: int, seconds: int, rc: int, stats: dict[tuple[str, str], dict[str, str]], delta: dict[str, float]) -> dict[str, Any]:
    """One step's record from Locust's stats rows and the metric deltas over the step."""
    count = {key: int(row["Request Count"]) for key, row in stats.items()}
    answered = sum(n for (kind, _), n in count.items() if kind == "POST")
    rejected = sum(n for (kind, _), n in count.items() if kind == "rejected")
    stream = stats.get(STREAM)
    client_tokens = count.get(STREAM, 0) * (number(stream["Average Content Size"]) or 0.0) if stream else 0.0
    batches = delta["ray_serving_batch_size_count"]
    return {
        "users": users,
        "seconds": seconds,
        "locust_exit_code": rc,
        "requests_per_s": answered / seconds,
        "rejected_per_s": rejected / seconds,
        "translation_requests_per_s": sum(count.get(ROUTE_ROWS[r], 0) for r in ("translate", "translate_list", "libretranslate")) / seconds,
        "failures": sum(int(row["Failure Count"]) for row in stats.values()),
        "streams": count.get(STREAM, 0),
        "translations": count.get(TRANSLATE, 0),
        "tokens_per_s_client": client_tokens / seconds,
        "tokens_per_s_server": delta["ray_serving_generation_tokens_total"] / seconds,
        "mean_batch_size_generator": delta["ray_serving_batch_size_sum"] / batches if batches else None,
        "engine_steps_generator": batches,
        "tokens_per_engine_step_generator": delta["ray_serving_generation_tokens_total"] / batches if batches else None,
        **{f"{route}_ms": percentiles(stats.get(key)) for route, key in ROUTE_ROWS.items()},
    }


def find_knee(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The first step whose p99 TTFT exceeds KNEE_FACTOR x the lowest step's, and the generator's
    mean batch size at the highest load below it (the last step when there is no knee)."""
    measured = [s for s in steps if s["ttft_ms"]["p99"] is not None]
    if not measured:
        return dict.fromkeys(KNEE_KEYS)
    base = measured[0]["ttft_ms"]["p99"]
    knee = next((s for s in measured[1:] if s["ttft_ms"]["p99"] > KNEE_FACTOR * base), None)
    below = [s for s in measured if knee is None or s["users"] < knee["users"]]
    return {
        "baseline_users": measured[0]["users"],
        "baseline_ttft_p99_ms": base,
        "knee_users": knee["users"] if knee else None,
        "knee_ttft_p99_ms": knee["ttft_ms"]["p99"] if knee else None,
        "below_knee_users": below[-1]["users"],
        "below_knee_batch": below[-1]["mean_batch_size_generator"],
        "below_knee_tokens_per_step": below[-1]["tokens_per_engine_step_generator"],
    }


def cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The sweep as a markdown table plus the knee sentence."""
    lines = [
        f"Sweep of {result['host']} on {result['date']}, {result['step_seconds']} s per step; each step: "
        f"{result['translation_users']} translation user(s), the other users streaming, pausing up to "
        f"{result['think_max_seconds']:g} s between requests. Latencies in ms (ITL: one sample per gap between streamed "
        "text frames; translate: one sentence, beam 4).",
        "",
        "| users | req/s | rejected/s | failures | gen tok/s (client) | gen tok/s (server) | TTFT p50 | TTFT p95 | TTFT p99 "
        "| ITL p50 | ITL p95 | ITL p99 | translate p50 | translate p95 | translate p99 | mean gen batch (metric) | gen tokens/step |",
        "|---:" * 17 + "|",
    ]
    for s in result["steps"]:
        t, i, tr = s["ttft_ms"], s["itl_ms"], s["translate_ms"]
        row = [
            str(s["users"]), f"{s['requests_per_s']:.2f}", f"{s['rejected_per_s']:.2f}", str(s["failures"]),
            f"{s['tokens_per_s_client']:.1f}", f"{s['tokens_per_s_server']:.1f}",
            *(cell(q[k]) for q in (t, i, tr) for k in ("p50", "p95", "p99")), cell(s["mean_batch_size_generator"], 2),
            cell(s["tokens_per_engine_step_generator"], 2),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    knee = result["knee"]
    lines.append("")
    if knee["baseline_users"] is None:
        lines.append("No step measured a TTFT.")
    else:
        lines.append(f"Low-load p99 TTFT: {knee['baseline_ttft_p99_ms']:.0f} ms at {knee['baseline_users']} users.")
        if knee["knee_users"] is None:
            lines.append(f"p99 TTFT never exceeded {KNEE_FACTOR:g}x that within the sweep.")
        else:
            lines.append(f"p99 TTFT exceeds {KNEE_FACTOR:g}x it at {knee['knee_users']} users ({knee['knee_ttft_p99_ms']:.0f} ms).")
        lines.append(
            f"Mean generator batch size at the highest load below that point ({knee['below_knee_users']} users): "
            f"{cell(knee['below_knee_batch'], 2)} by the metric, "
            f"{cell(knee['below_knee_tokens_per_step'], 2)} generated tokens per engine step."
        )
    lines.append(
        "\n`mean gen batch (metric)` = delta(ray_serving_batch_size_sum) / delta(ray_serving_batch_size_count) of the generator. "
        "Ray rebuilds histogram sums from bucket midpoints; the batch-size histogram has one bucket per size up to 32, so the "
        "mean is exact. `gen tokens/step` = delta(ray_serving_generation_tokens_total) / delta(ray_serving_batch_size_count) "
        "checks it: each sequence of a generator step emits one token."
    )
    if result["skipped_users"]:
        lines.append(f"Not run (time budget): {', '.join(map(str, result['skipped_users']))} users.")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency vs throughput: TTFT/ITL against generated tokens/s, translation latency against req/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    fig, (gen, tr) = plt.subplots(1, 2, figsize=(12, 4.5))
    tokens = [s["tokens_per_s_server"] or s["tokens_per_s_client"] for s in steps]
    for key, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^-")):
        gen.plot(tokens, [s["ttft_ms"][key] for s in steps], style, label=f"TTFT {key}")
    gen.plot(tokens, [s["itl_ms"]["p95"] for s in steps], "x--", label="ITL p95")
    for s, x in zip(steps, tokens, strict=True):
        gen.annotate(f"{s['users']}u", (x, s["ttft_ms"]["p99"] or 0), textcoords="offset points", xytext=(4, 4), fontsize=8)
    knee = result["knee"]
    if knee["baseline_ttft_p99_ms"] is not None:
        gen.axhline(KNEE_FACTOR * knee["baseline_ttft_p99_ms"], color="grey", lw=0.8, ls=":", label=f"{KNEE_FACTOR:g}x low-load TTFT p99")
    gen.set(xlabel="generated tokens/s", ylabel="ms", yscale="log", title=f"{GENERATOR} (streamed)")
    gen.legend(fontsize=8)
    rps = [s["translation_requests_per_s"] for s in steps]
    for key, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^-")):
        tr.plot(rps, [s["translate_ms"][key] for s in steps], style, label=f"translate {key}")
    for s, x in zip(steps, rps, strict=True):
        tr.annotate(f"{s['users']}u", (x, s["translate_ms"]["p99"] or 0), textcoords="offset points", xytext=(4, 4), fontsize=8)
    tr.set(xlabel="translation requests/s (all three routes)", ylabel="ms", yscale="log", title="/v1/translate, one sentence, beam 4")
    tr.legend(fontsize=8)
    fig.suptitle(f"Latency vs throughput, {result['step_seconds']} s per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        result["knee"] = find_knee(result["steps"])
        write(result, args.out)
        return
    users = [int(u) for u in args.users.split(",")]
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    time.sleep(args.settle_seconds)  # let earlier activity (warm-up) reach the exporter first
    before = scrape(args.metrics_url)
    steps: list[dict[str, Any]] = []
    skipped: list[int] = []
    for n in users:
        if time.monotonic() - started + args.step_seconds + args.settle_seconds + 10 > args.budget_seconds:
            skipped.append(n)
            continue
        prefix = args.results / f"u{n}"
        done = run_locust(n, args.step_seconds, args.host, prefix, args.think_max_seconds, args.translation_users)
        time.sleep(args.settle_seconds)
        after = scrape(args.metrics_url)
        stats = read_stats(prefix.with_name(f"{prefix.name}_stats.csv"))
        step = summarize(n, args.step_seconds, done.returncode, stats, {k: after[k] - before[k] for k in METRICS})
        before = after
        steps.append(step)
        print(
            f"{n:3d} users: {step['requests_per_s']:.2f} req/s, {step['tokens_per_s_server']:.1f} tok/s, "
            f"TTFT p99 {cell(step['ttft_ms']['p99'])} ms, batch {cell(step['mean_batch_size_generator'], 2)}, "
            f"failures {step['failures']}, locust rc {done.returncode}",
            flush=True,
        )
    result = {
        "host": args.host,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "step_seconds": args.step_seconds,
        "think_max_seconds": args.think_max_seconds,
        "translation_users": args.translation_users,
        "knee_factor": KNEE_FACTOR,
        "steps": steps,
        "skipped_users": skipped,
        "knee": find_knee(steps),
    }
    write(result, args.out)


def write(result: dict[str, Any], out: Path) -> None:
    """sweep.json, sweep.md and sweep.png under `out`; prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / "sweep.md").write_text(table)
    if result["steps"]:
        plot(result, out / "sweep.png")
    print(table)


if __name__ == "__main__":
    main()
