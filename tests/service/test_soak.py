"""A 5-minute soak against the real service: mixed traffic, a fifth of the streams cancelled
midway; nothing fails but the cancelled; descriptors, asyncio tasks and resident memory of every
process stay flat after warm-up (the ingress's memory too, since Ray's processes run with two
malloc arenas: service/config.py)."""

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from loadtests.soak import report, soak
from tests.helpers import APP_NAME, TEST_CONFIG

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "300"))  # at least 5 minutes unless told otherwise
WARMUP_S = SOAK_SECONDS / 2  # Python's allocator keeps growing, ever slower, for a few minutes
DEPLOYMENTS = (*(m.name for m in TEST_CONFIG.models), "Ingress")
PROCESSES = {*DEPLOYMENTS, *(f"{m.name}/engine" for m in TEST_CONFIG.models)}  # each model replica's engine process too
RESULTS = Path(__file__).resolve().parents[2] / "loadtests" / "results"


def sample_stats() -> dict[str, dict[str, int]]:
    """process_stats() of every replica of the app (calls spread over replicas by Serve's router)."""
    from ray import serve

    stats: dict[str, dict[str, int]] = {}
    for deployment in DEPLOYMENTS:
        handle: Any = serve.get_deployment_handle(deployment, app_name=APP_NAME)
        for _ in range(16):
            s = handle.stats.remote().result()
            stats[f"{deployment}:{s['pid']}"] = {k: s[k] for k in ("rss_bytes", "open_fds", "asyncio_tasks")}
            if "engine_process" in s:
                engine = s["engine_process"]
                stats[f"{deployment}/engine:{engine['pid']}"] = {k: engine[k] for k in ("rss_bytes", "open_fds", "asyncio_tasks")}
    return stats


def test_soak_with_cancelled_streams_leaks_nothing(service_url: str) -> None:
    result = asyncio.run(soak(service_url, SOAK_SECONDS, sample_stats))
    summary = report(result, WARMUP_S)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps({"seconds": SOAK_SECONDS, "warmup_s": WARMUP_S, **summary}, indent=2) + "\n")
    failed = {k: v for k, v in result.outcomes.items() if k.startswith("failed")}
    assert not failed, summary
    assert result.outcomes["ok"] > 0 and result.outcomes["cancelled"] > 0
    # Each process's first sample after warm-up against the least of its samples once the traffic
    # has stopped (loadtests/soak.py QUIET_SAMPLES: Serve's own periodic tasks come and go, a leak
    # stays): a sample can miss a replica (Serve's router picks which one answers, and favours
    # some), so processes are followed one by one.
    after_warmup: dict[str, list[dict[str, int]]] = {}
    quiet: dict[str, list[dict[str, int]]] = {}
    for t, stats in result.samples:
        for process, values in stats.items():
            if WARMUP_S <= t < SOAK_SECONDS:
                after_warmup.setdefault(process, []).append(values)
            elif t >= SOAK_SECONDS:
                quiet.setdefault(process, []).append(values)
    compared = {process: (series[0], quiet[process]) for process, series in after_warmup.items() if process in quiet}
    assert {p.split(":")[0] for p in compared} == PROCESSES, (list(after_warmup), list(quiet))
    for process, (warm, last) in compared.items():
        assert min(s["open_fds"] for s in last) <= warm["open_fds"] + 2, (process, summary)
        assert min(s["asyncio_tasks"] for s in last) <= warm["asyncio_tasks"] + 2, (process, summary)
    for process, mb_per_min in summary["rss_mb_per_min"].items():
        assert mb_per_min < 2.0, (process, summary)  # flat: under 2 MB a minute after warm-up
