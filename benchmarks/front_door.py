"""The front door under a load generator that is not the bottleneck (Apache's `ab`): requests/s
and latency of `GET /healthz` and of a refused completion, at 50 and 400 connections.

    python -m benchmarks.front_door [--requests 4000] [--json] [--quick] [--out benchmarks/results/front_door.json]

Needs `ab` (Debian: apache2-utils; .ci/run installs it). Starts its own Ray and Serve app on
127.0.0.1, which must answer /readyz within READY_TIMEOUT_S (benchmarks/serving.py). To make
every completion a refusal, the generator gets one slot and a queue of one, its engine loop is
stalled with the test-only fault hook, and one request holds each of its three places (the slot,
the engine's queue, Serve's queue): every further completion is refused at the ingress (Serve's
backpressure on its handle, answered as a 429 with Retry-After, then the ingress's own fast
refusal of the saturated model) without reaching the replica. --quick (400 requests a run)
checks the script; its JSON goes to a temporary folder unless --out says where. The JSON holds
the commit measured.
"""

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.provenance import commit
from benchmarks.serving import local_app
from model.paths import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.config import ModelServingConfig, ServiceConfig
from service.engine.config import EngineConfig

COMPLETION = {"prompt": "ROMEO:\n", "max_tokens": 8}
RESULTS = Path(__file__).resolve().parent / "results" / "front_door.json"
QUICK_RESULTS = Path(tempfile.gettempdir()) / "benchmarks-quick" / "front_door.json"
QUICK_REQUESTS = 400  # ab takes no fewer requests than connections (400)


def refusing_config() -> ServiceConfig:
    return ServiceConfig(
        models=(
            ModelServingConfig(
                name="transformer-en-de",
                checkpoint=DEFAULT_TRANSLATOR,
                engine=EngineConfig(n_slots=4),
                deployment={"ray_actor_options": {"num_cpus": 0.1}},
            ),
            ModelServingConfig(
                name="transformer-shakespeare",
                checkpoint=DEFAULT_GENERATOR,
                engine=EngineConfig(n_slots=1, max_waiting=1, default_max_tokens=16, queue_timeout_s=None, request_timeout_s=None),
                deployment={"max_queued_requests": 1, "ray_actor_options": {"num_cpus": 0.1}},
                fault_injection=True,
                heartbeat_timeout_s=3600,  # its engine is stalled on purpose: Serve must not replace it meanwhile
            ),
        ),
    )


def ab(url: str, concurrency: int, requests: int, body: Path | None = None) -> dict[str, Any]:
    """One `ab` run: requests/s, latency percentiles (ms) and the count of non-2xx answers."""
    command = ["ab", "-q", "-n", str(requests), "-c", str(concurrency)]
    if body is not None:
        command += ["-p", str(body), "-T", "application/json"]
    output = subprocess.run([*command, url], capture_output=True, text=True, check=True).stdout
    percentiles = {int(p): float(ms) for p, ms in re.findall(r"^\s+(\d+)%\s+(\d+)", output, re.M)}
    non_2xx = re.search(r"Non-2xx responses:\s+(\d+)", output)
    return {
        "requests_per_s": float(re.search(r"Requests per second:\s+([\d.]+)", output).group(1)),  # type: ignore[union-attr]
        "p50_ms": percentiles[50],
        "p99_ms": percentiles[99],
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
    }


def measure(url: str, generator: Any, requests: int) -> dict[str, Any]:
    """The refusal, then `ab` against /healthz and a refused completion at each concurrency, once
    the generator (its deployment handle) is stalled and its three places are held."""
    generator.inject_fault.remote("stall", 1, 3600.0).result()

    def hold_a_place() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut when the service shuts down, as intended
            httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=3600)

    for _ in range(3):  # one stuck in the stalled step, one in the engine's queue, one in Serve's queue
        threading.Thread(target=hold_a_place, daemon=True).start()
        time.sleep(1.0)
    refused = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30)
    assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
    results: dict[str, Any] = {
        "refusal": {"status": refused.status_code, "retry_after": refused.headers["retry-after"], "body": refused.json()}
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as body:
        json.dump(COMPLETION, body)
        body.flush()
        for concurrency in (50, 400):
            results[f"healthz_c{concurrency}"] = ab(f"{url}/healthz", concurrency, requests)
            results[f"refused_completion_c{concurrency}"] = ab(f"{url}/v1/completions", concurrency, requests, Path(body.name))
    for concurrency in (50, 400):
        results[f"refused_vs_healthz_p50_c{concurrency}"] = round(
            results[f"refused_completion_c{concurrency}"]["p50_ms"] / max(results[f"healthz_c{concurrency}"]["p50_ms"], 1.0), 2
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000, help="requests of each `ab` run")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REQUESTS} requests a run: to check the script (JSON to {QUICK_RESULTS})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes (default: benchmarks/results/front_door.json)")
    args = parser.parse_args()
    if shutil.which("ab") is None:
        raise SystemExit("front_door: needs Apache's `ab` (Debian: apt-get install apache2-utils)")
    requests, out = (QUICK_REQUESTS, args.out or QUICK_RESULTS) if args.quick else (args.requests, args.out or RESULTS)
    config, app, measured = refusing_config(), "front-door", commit()
    with local_app(config, app, cpus=2) as url:
        from ray import serve  # imported by local_app, after the environment it needs

        results = measure(url, serve.get_deployment_handle(config.generator.name, app_name=app), requests)
    results = {"commit": measured, **results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for name, value in results.items():
        print(f"{name}: {value}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
