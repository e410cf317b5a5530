"""The serving tax: the generator's throughput through the HTTP service against the same engine in
this process, at the same concurrency, side by side in one run.

    python -m benchmarks.serving [--json] [--quick] [--out benchmarks/results/serving.json] [--tokens 64]
                                 [--requests-per-client 4] [--repeats 2]
                                 [--stream-interval-ms 50]

Starts its own Ray and Serve app on 127.0.0.1: the default ServiceConfig, every model it serves,
the generator on the CPU with one torch thread. Ray gets as many logical CPUs as the app's
replicas ask (Serve's default: one each), so that every model is placed on a 2-core machine too
(the replicas share its real cores all the same); the app must answer /readyz within
READY_TIMEOUT_S, or the run stops naming each deployment's status. In this process runs the
engine a replica runs: the generator's EngineConfig, device and dtype, one torch thread, behind
the AsyncEngine (the replica's path without Serve, the ingress, HTTP and the replica's pacing of
streams). At each concurrency N (1, 16, 32), N clients each send --requests-per-client greedy
completions of at most --tokens tokens back to back, the same prompts in the same order in every
mode (the generator may end a text sooner, at end of sequence: every figure counts the tokens
made). The modes take turns, each while the others are idle: in-process, then
`POST /v1/completions` streamed (server-sent events, the usage in the last frame) and not
streamed, from one httpx.AsyncClient in this process. After one untimed round of each mode at
32 clients, each mode runs --repeats times in turn at each concurrency and keeps its best wall
time.

--quick (one request per client, one repeat) checks the script in about a minute; its JSON goes to
a temporary folder unless --out says where, never over the figures the docs show.

Prints a table; with --json the last line is one JSON object: inprocess_<n>_tok_s,
http_<n>_<mode>_tok_s (mode: stream or nostream), http_vs_inprocess_<n>_<mode> (HTTP throughput
over in-process), the median time to first token in ms (inprocess_<n>_ttft_p50_ms,
http_<n>_stream_ttft_p50_ms), the tokens each mode made (<prefix>_tokens: the same work, equal)
and <prefix>_cpu_per_s, this process's CPU seconds per second of the run (in-process: the
engine's; HTTP: the client's; near 1, the client may be what limits the HTTP figures), the
commit measured (`git describe --always --dirty`) and the logical CPUs Ray had (ray_cpus).
Writes the same object to --out.
"""

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
from httpx_sse import aconnect_sse

from benchmarks.provenance import commit
from decoding.sampling_params import GREEDY
from service.config import LOCAL_RAY_ENVIRONMENT, RAY_ENVIRONMENT, ServiceConfig
from service.engine.async_engine import AsyncEngine
from service.engine.core import EngineSpec
from service.engine.request import GenerationParams
from service.ports import free_port

CONCURRENCY = (1, 16, 32)
MODES = ("inprocess", "stream", "nostream")  # stream, nostream: over HTTP
TORCH_THREADS = 1
READY_TIMEOUT_S = 300.0  # a bound on a start that cannot finish, not a speed limit
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serving.json"
QUICK_RESULTS = Path(tempfile.gettempdir()) / "benchmarks-quick" / "serving.json"
REQUEST_TIMEOUT_S = 300.0
PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nNow", "To be", "JULIET:\nO", "MENENIUS:\n", "The king", "HAMLET:\n"]

# A prompt in, the completion tokens made and the seconds to the first (None when not streamed) out.
Completion = Callable[[str], Awaitable[tuple[int, float | None]]]


@dataclass
class Run:
    """One mode at one concurrency: each request's completion tokens (in the order sent) and time to
    first token, the wall time of it all and this process's CPU time meanwhile."""

    tokens: list[int]
    first_token_s: list[float]
    seconds: float
    cpu_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.seconds


def served_config(stream_interval_ms: float) -> ServiceConfig:
    """The default service, its generator on the CPU with TORCH_THREADS threads and the given stream interval."""
    default = ServiceConfig()
    update = {"device": "cpu", "torch_threads": TORCH_THREADS, "stream_interval_ms": stream_interval_ms}
    generator = default.generator.model_copy(update=update)
    return default.model_copy(update={"generator": generator})


def ray_cpus(config: ServiceConfig) -> int:
    """Logical CPUs enough for Ray to place every replica config's app can run: per model, its
    replicas (autoscaling's max_replicas, else num_replicas, 1 by default) times each one's
    ray_actor_options num_cpus (Serve's default 1); the ingress asks none. At least 2."""
    asked = 0.0
    for model in config.models:
        options = model.serve_options
        replicas = (options.get("autoscaling_config") or {}).get("max_replicas", options.get("num_replicas", 1))
        asked += replicas * options.get("ray_actor_options", {}).get("num_cpus", 1)
    return max(2, math.ceil(asked))


@contextmanager
def local_app(config: ServiceConfig, app: str, cpus: int) -> Iterator[str]:
    """The service's app on a Ray of its own (address="local": never one already running on this
    machine; everything on 127.0.0.1) with `cpus` logical CPUs, on a free port: its URL once every
    model is ready (wait_ready's deadline says what is stuck, where Serve's own wait has no bound).
    Serve and Ray are shut down on the way out."""
    os.environ.update({**RAY_ENVIRONMENT, **LOCAL_RAY_ENVIRONMENT})  # before Ray is imported
    import ray
    from ray import serve

    from service.app import build_app

    port = free_port()
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=40)  # errors only
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        target = serve.RunTarget(build_app(config), name=app, route_prefix="/")
        serve.run_many([target], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, app, READY_TIMEOUT_S)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_ready(url: str, app: str, timeout_s: float) -> None:
    """Returns once the app at url answers /readyz with 200; TimeoutError naming each deployment's
    status (a replica Ray cannot place says so) when it has not within timeout_s."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # the proxy or the route is not up yet
        time.sleep(0.5)
    deployments = serve.status().applications[app].deployments
    statuses = "; ".join(f"{name}: {d.status.value} {d.message}".strip() for name, d in deployments.items())
    raise TimeoutError(f"the service was not ready within {timeout_s:.0f} s: {statuses}")


def check_finish(finish_reason: str | None, tokens: int, max_tokens: int) -> None:
    """A completion ended by its limit made max_tokens tokens; one ended at end of sequence, at most that."""
    assert (finish_reason == "length" and tokens == max_tokens) or (finish_reason == "stop" and tokens <= max_tokens), (
        finish_reason,
        tokens,
    )


async def complete_inprocess(engine: AsyncEngine, prompt: str, max_tokens: int) -> tuple[int, float | None]:
    """One greedy completion through the AsyncEngine, read as the replica reads it (unpaced)."""
    started = time.perf_counter()
    stream = await engine.submit(engine.info.encode_prompt(prompt), GenerationParams(sampling=GREEDY, max_tokens=max_tokens))
    first_token_s, finish_reason, tokens = None, None, 0
    async for delta in stream:
        if first_token_s is None and delta.token_ids:
            first_token_s = time.perf_counter() - started
        finish_reason, tokens = delta.finish_reason, delta.completion_tokens
    check_finish(finish_reason, tokens, max_tokens)
    return tokens, first_token_s


async def complete_http(client: httpx.AsyncClient, prompt: str, model: str, max_tokens: int) -> tuple[int, float | None]:
    """One greedy completion, not streamed: 200 and its usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    check_finish(answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"], max_tokens)
    return answer["usage"]["completion_tokens"], None


async def complete_http_stream(client: httpx.AsyncClient, prompt: str, model: str, max_tokens: int) -> tuple[int, float | None]:
    """One greedy completion streamed: 200, frames read until [DONE], the tokens from the last
    frame's usage and the time to the first frame with text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first_token_s, finish_reason, tokens = None, None, -1
    async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
        assert source.response.status_code == 200, (await source.response.aread()).decode()
        async for event in source.aiter_sse():
            if event.data == "[DONE]":
                break
            frame = event.json()
            assert "error" not in frame, frame
            for choice in frame["choices"]:
                if first_token_s is None and choice["text"]:
                    first_token_s = time.perf_counter() - started
                finish_reason = choice["finish_reason"] or finish_reason
            if frame.get("usage"):
                tokens = frame["usage"]["completion_tokens"]
    check_finish(finish_reason, tokens, max_tokens)
    return tokens, first_token_s


async def clients(complete: Completion, concurrency: int, requests_per_client: int) -> Run:
    """concurrency clients at once, each sending requests_per_client completions back to back;
    client c's request r has prompt c * requests_per_client + r (cycling through PROMPTS)."""

    async def client(c: int) -> list[tuple[int, float | None]]:
        return [await complete(PROMPTS[(c * requests_per_client + r) % len(PROMPTS)]) for r in range(requests_per_client)]

    started, cpu_started = time.perf_counter(), time.process_time()
    per_client = await asyncio.gather(*(client(c) for c in range(concurrency)))
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    done = [result for results in per_client for result in results]
    return Run([tokens for tokens, _ in done], [first for _, first in done if first is not None], seconds, cpu_seconds)


async def measure(
    engine: AsyncEngine, url: str, model: str, tokens: int, requests_per_client: int, repeats: int
) -> dict[tuple[str, int], Run]:
    """Every mode at every concurrency, the modes taking turns (repeats rounds at each
    concurrency, the best wall time kept), after one untimed round of each at the highest."""
    limits = httpx.Limits(max_connections=max(CONCURRENCY), max_keepalive_connections=max(CONCURRENCY))
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        completions: dict[str, Completion] = {
            "inprocess": partial(complete_inprocess, engine, max_tokens=tokens),
            "stream": partial(complete_http_stream, http, model=model, max_tokens=tokens),
            "nostream": partial(complete_http, http, model=model, max_tokens=tokens),
        }
        for complete in completions.values():
            await clients(complete, max(CONCURRENCY), 1)
        best: dict[tuple[str, int], Run] = {}
        for concurrency in CONCURRENCY:
            for _ in range(repeats):
                for mode, complete in completions.items():
                    run = await clients(complete, concurrency, requests_per_client)
                    if (mode, concurrency) not in best or run.seconds < best[mode, concurrency].seconds:
                        best[mode, concurrency] = run
    return best


def label(mode: str, concurrency: int) -> str:
    """The figures' prefix: inprocess_<n>, or http_<n>_<mode> for stream and nostream."""
    return f"inprocess_{concurrency}" if mode == "inprocess" else f"http_{concurrency}_{mode}"


def figures(runs: dict[tuple[str, int], Run]) -> dict[str, float]:
    """The report's figures from the best runs (see the module docstring)."""
    results: dict[str, float] = {}
    for concurrency in CONCURRENCY:
        inprocess = runs["inprocess", concurrency]
        for mode in MODES:
            run, name = runs[mode, concurrency], label(mode, concurrency)
            results[f"{name}_tok_s"] = round(run.tokens_per_s, 1)
            results[f"{name}_tokens"] = sum(run.tokens)
            results[f"{name}_cpu_per_s"] = round(run.cpu_seconds / run.seconds, 2)
            if run.first_token_s:
                results[f"{name}_ttft_p50_ms"] = round(1000 * statistics.median(run.first_token_s), 1)
            if mode != "inprocess":
                results[f"http_vs_inprocess_{concurrency}_{mode}"] = round(run.tokens_per_s / inprocess.tokens_per_s, 2)
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"{'clients':>7s}  {'mode':9s} {'tokens':>7s} {'tokens/s':>9s} {'vs in-process':>13s} {'TTFT p50 ms':>11s} {'CPU/s here':>10s}")
    for concurrency in CONCURRENCY:
        for mode in MODES:
            name = label(mode, concurrency)
            ratio = results.get(f"http_vs_inprocess_{concurrency}_{mode}", 1.0)
            ttft = results.get(f"{name}_ttft_p50_ms")
            print(
                f"{concurrency:7d}  {mode:9s} {results[f'{name}_tokens']:7d} {results[f'{name}_tok_s']:9.1f} {ratio:13.2f} "
                f"{'' if ttft is None else f'{ttft:.1f}':>11s} {results[f'{name}_cpu_per_s']:10.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of every completion")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each mode at each concurrency, the best kept")
    parser.add_argument("--stream-interval-ms", type=float, default=ServiceConfig().generator.stream_interval_ms)
    parser.add_argument(
        "--quick", action="store_true", help=f"one request per client, one repeat: to check the script (JSON to {QUICK_RESULTS})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--out", type=Path, default=None, help=f"where the JSON goes (default: {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args()
    tokens, (requests_per_client, repeats) = args.tokens, (1, 1) if args.quick else (args.requests_per_client, args.repeats)
    out: Path = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    from service.deployments import resolve_device

    config, app = served_config(args.stream_interval_ms), "serving-benchmark"
    cpus, measured = ray_cpus(config), commit()
    started = time.perf_counter()
    with local_app(config, app, cpus) as url:
        torch.set_num_threads(TORCH_THREADS)
        generator = config.generator
        engine = AsyncEngine(EngineSpec(generator.checkpoint, generator.engine, *resolve_device(generator), torch_threads=TORCH_THREADS))
        try:
            runs = asyncio.run(measure(engine, url, generator.name, tokens, requests_per_client, repeats))
        finally:
            engine.stop()
    results: dict[str, Any] = {
        "commit": measured,
        "ray_cpus": cpus,
        "max_tokens": tokens,
        "requests_per_client": requests_per_client,
        "repeats": repeats,
        "torch_threads": TORCH_THREADS,
        "stream_interval_ms": args.stream_interval_ms,
        **figures(runs),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
