"""Soaks against the real service: mixed traffic, a fifth of the streams cancelled midway; nothing
fails but the cancelled; descriptors and asyncio tasks of every process come back after the
traffic. RELIABILITY.md's T8, short in CI and long by hand: the 1-minute soak runs in `make
test-all`, the 5-minute one in `make test-long` (tests/conftest.py LONG_TIER), which also holds
resident memory flat after warm-up (the ingress's too, since Ray's processes run with two malloc
arenas: service/config.py). Python's allocator keeps growing, ever slower, for a few minutes: a
1-minute run's slope would measure that, not a leak (tests/api/test_memory.py holds the HTTP
layer's memory flat over 12,000 requests in `make test-all`)."""

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from loadtests.soak import SoakResult, report, soak
from tests.helpers import APP_NAME, TEST_CONFIG

SHORT_SOAK_S = 60.0
LONG_SOAK_S = float(os.environ.get("SOAK_SECONDS", "300"))  # at least 5 minutes unless told otherwise
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


def _warm_samples(result: SoakResult, warmup_s: float) -> dict[str, dict[str, int]]:
    """Each process's first sample after warm-up, before the traffic ended."""
    warm: dict[str, dict[str, int]] = {}
    for t, stats in result.samples:
        if warmup_s <= t < result.traffic_ended_s:
            for process, values in stats.items():
                warm.setdefault(process, values)
    return warm


def _unsettled(result: SoakResult, warmup_s: float) -> list[str]:
    """The processes not (yet) seen back within 2 descriptors and 2 asyncio tasks of their first
    sample after warm-up, in their least sample since the traffic ended (Serve's own periodic
    tasks come and go, a leak stays); every process must have a quiet sample."""
    quiet, warm = result.quiet_samples(), _warm_samples(result, warmup_s)
    if {p.split(":")[0] for p in warm if p in quiet} != PROCESSES:
        return sorted(PROCESSES - {p.split(":")[0] for p in warm if p in quiet})
    return [
        process
        for process, first in warm.items()
        if process in quiet
        and (
            min(s["open_fds"] for s in quiet[process]) > first["open_fds"] + 2
            or min(s["asyncio_tasks"] for s in quiet[process]) > first["asyncio_tasks"] + 2
        )
    ]


@pytest.mark.parametrize(("seconds", "holds_memory_flat"), [(SHORT_SOAK_S, False), (LONG_SOAK_S, True)], ids=["1-minute", "5-minutes"])
def test_soak_with_cancelled_streams_leaks_nothing(service_url: str, seconds: float, holds_memory_flat: bool) -> None:
    warmup_s = seconds / 2
    result = asyncio.run(soak(service_url, seconds, sample_stats, settled=lambda r: not _unsettled(r, warmup_s)))
    summary = report(result, warmup_s)
    RESULTS.mkdir(exist_ok=True)
    figures = {"seconds": seconds, "warmup_s": warmup_s, **summary}
    (RESULTS / f"soak_{int(seconds)}s.json").write_text(json.dumps(figures, indent=2) + "\n")
    failed = {k: v for k, v in result.outcomes.items() if k.startswith("failed")}
    assert not failed, summary
    assert result.outcomes["ok"] > 0 and result.outcomes["cancelled"] > 0
    # Sampled after the traffic until every process is back (or for loadtests/soak.py's
    # QUIET_LIMIT_S): a process still above its warm-up sample then holds what it leaked.
    unsettled = _unsettled(result, warmup_s)
    assert not unsettled, (unsettled, result.quiet_samples(), _warm_samples(result, warmup_s), summary)
    if holds_memory_flat:  # the module's docstring: memory only where a run is long enough to warm up
        for process, mb_per_min in summary["rss_mb_per_min"].items():
            assert mb_per_min < 2.0, (process, summary)  # flat: under 2 MB a minute after warm-up
