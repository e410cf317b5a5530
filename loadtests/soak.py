"""A soak: mixed traffic for a fixed time against 127.0.0.1, a fifth of the streams cancelled
midway, with the serving processes' memory, descriptors and asyncio tasks sampled throughout.

Used by tests/service/test_soak.py (which samples the replicas through Serve's handles); the
result's `slopes` are what the README reports.
"""

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse

StatsSampler = Callable[[], dict[str, dict[str, int]]]  # process name -> process_stats()

SENTENCES = ["A man is riding a bike down the street.", "Two dogs are running in the park.", "A woman reads a book on a bench."]


@dataclass
class SoakResult:
    outcomes: Counter[str] = field(default_factory=Counter)  # ok, cancelled (on purpose) or failed:<what>
    samples: list[tuple[float, dict[str, dict[str, int]]]] = field(default_factory=list)  # (seconds, stats)
    traffic_ended_s: float = float("inf")  # when the last request had its answer (seconds from the start)

    def quiet_samples(self) -> dict[str, list[dict[str, int]]]:
        """Each process's samples taken after the traffic ended."""
        quiet: dict[str, list[dict[str, int]]] = {}
        for t, stats in self.samples:
            if t >= self.traffic_ended_s:
                for name, values in stats.items():
                    quiet.setdefault(name, []).append(values)
        return quiet

    def slopes(self, key: str, after_s: float) -> dict[str, float]:
        """Least-squares slope per minute of `key` for each process, over samples after after_s."""
        series: dict[str, list[tuple[float, float]]] = {}
        for t, stats in self.samples:
            if t >= after_s:
                for name, values in stats.items():
                    series.setdefault(name, []).append((t / 60, float(values[key])))
        return {name: _slope(points) for name, points in series.items() if len(points) >= 2}


def _slope(points: list[tuple[float, float]]) -> float:
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


async def _one_request(http: httpx.AsyncClient, rng: random.Random) -> str:
    kind = rng.choice(["stream", "stream", "completion", "translation"])
    if kind == "translation":
        text = " ".join(rng.sample(SENTENCES, 2))
        response = await http.post("/v1/translate", json={"text": text})
        return "ok" if response.status_code == 200 and response.json()["translations"][0]["text"] else f"failed:{response.status_code}"
    if kind == "completion":
        response = await http.post("/v1/completions", json={"prompt": "ROMEO:\n", "max_tokens": 32, "seed": rng.randrange(1000)})
        return "ok" if response.status_code == 200 else f"failed:{response.status_code}"
    cancel_after = rng.randrange(2, 6) if rng.random() < 0.2 else None  # a fifth are cancelled midway
    body = {"prompt": "JULIET:\n", "max_tokens": 64, "seed": rng.randrange(1000), "stream": True}
    async with aconnect_sse(http, "POST", "/v1/completions", json=body) as source:
        if source.response.status_code != 200:
            return f"failed:{source.response.status_code}"
        frames = 0
        async for event in source.aiter_sse():
            if event.data == "[DONE]":
                return "ok"
            frames += 1
            if cancel_after is not None and frames >= cancel_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
    return "failed:cut"


async def _worker(http: httpx.AsyncClient, rng: random.Random, deadline: float, outcomes: Counter[str]) -> None:
    while time.monotonic() < deadline:
        try:
            outcomes[await _one_request(http, rng)] += 1
        except (httpx.HTTPError, SSEError) as error:
            outcomes[f"failed:{type(error).__name__}"] += 1


# Samples after the traffic: a replica runs Serve's own periodic tasks on the loop that serves its
# requests (service/app.py REPLICA_ENVIRONMENT), so one sample may catch a few that come and go, and
# a sample can miss a replica (Serve's router picks which answers); a leaked task is in every one.
QUIET_SAMPLES = 3
QUIET_LIMIT_S = 90.0  # sampling after the traffic stops once `settled` says so, or after this long


async def soak(
    url: str,
    seconds: float,
    sample_stats: StatsSampler,
    users: int = 6,
    sample_every_s: float = 5.0,
    seed: int = 0,
    settled: Callable[[SoakResult], bool] = lambda _: True,
) -> SoakResult:
    """Runs `users` closed-loop clients for `seconds`, sampling stats every sample_every_s (and
    once before), then, the traffic stopped, every 2 s: at least QUIET_SAMPLES times, until
    `settled(result)` or for QUIET_LIMIT_S (a bound for a service that never settles: a leak)."""
    result = SoakResult()
    started = time.monotonic()
    loop = asyncio.get_running_loop()

    async def sample() -> None:
        stats = await loop.run_in_executor(None, sample_stats)
        result.samples.append((time.monotonic() - started, stats))

    await sample()
    deadline = started + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        workers = [asyncio.ensure_future(_worker(http, random.Random(seed + i), deadline, result.outcomes)) for i in range(users)]
        while time.monotonic() < deadline:
            await asyncio.sleep(sample_every_s)
            await sample()
        await asyncio.gather(*workers)
    result.traffic_ended_s = time.monotonic() - started
    limit, quiet = time.monotonic() + QUIET_LIMIT_S, 0
    while quiet < QUIET_SAMPLES or not (settled(result) or time.monotonic() > limit):
        await asyncio.sleep(2.0)  # cancelled requests leave the engines within a step or so
        await sample()
        quiet += 1
    return result


def report(result: SoakResult, warmup_s: float) -> dict[str, Any]:
    """What the README shows: outcomes, and per process the slope of each resource after warm-up."""
    return {
        "outcomes": dict(result.outcomes),
        "rss_mb_per_min": {k: round(v / 1e6, 3) for k, v in result.slopes("rss_bytes", warmup_s).items()},
        "open_fds_per_min": {k: round(v, 3) for k, v in result.slopes("open_fds", warmup_s).items()},
        "asyncio_tasks_per_min": {k: round(v, 3) for k, v in result.slopes("asyncio_tasks", warmup_s).items()},
        "rss_mb_series": {
            name: [[round(t / 60, 2), round(stats[name]["rss_bytes"] / 1e6, 1)] for t, stats in result.samples if name in stats]
            for name in result.samples[-1][1]
        },
    }


def dumps(result: SoakResult, warmup_s: float) -> str:
    return json.dumps(report(result, warmup_s), indent=2)
