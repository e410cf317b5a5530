"""Load-test smoke run: 30 s of the Locust traffic mix (loadtests/locustfile.py) against the session's
real service, in a subprocess (Locust's gevent patching must stay out of pytest's process)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.sweep import find_knee, read_stats

ROOT = Path(__file__).resolve().parents[2]
TRANSLATION_ROWS = [("POST", "/v1/translate"), ("POST", "/v1/translate [list]"), ("POST", "/translate")]
# The run's verdict on this machine is its failures, not its speed: the TTFT gate at the request timeout.
NO_TTFT_LIMIT_MS = 120_000
STREAM_ROWS = [("POST", "/v1/completions"), ("SSE", "ttft /v1/completions"), ("SSE", "stream /v1/completions")]


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")
def test_locust_smoke_run_passes_with_both_user_types(service_url: str, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless", "--only-summary",
        "-u", "4", "-r", "4", "-t", "30s", "--host", service_url, "--csv", str(tmp_path / "run"),
        "--exit-code-on-error", "1", "--ttft-p95-ms", str(NO_TTFT_LIMIT_MS),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    stats = read_stats(tmp_path / "run_stats.csv")
    assert sum(int(row["Failure Count"]) for row in stats.values()) == 0, stats
    count = {key: int(row["Request Count"]) for key, row in stats.items()}
    assert sum(count.get(key, 0) for key in TRANSLATION_ROWS) > 0, count
    assert all(count.get(key, 0) > 0 for key in STREAM_ROWS), count


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")
def test_the_sweep_command_runs_in_its_quickest_form(service_url: str, metrics_url: str, tmp_path: Path) -> None:
    """`python -m loadtests.sweep` as the README lists it: one short step, its JSON and page written."""
    cmd = [
        sys.executable, "-m", "loadtests.sweep", "--host", service_url, "--metrics-url", metrics_url, "--users", "2",
        "--step-seconds", "8", "--settle-seconds", "1", "--out", str(tmp_path / "sweep"), "--results", str(tmp_path / "results"),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["steps"]
    assert [s["users"] for s in steps] == [2] and steps[0]["requests_per_s"] > 0 and steps[0]["failures"] == 0, steps


def step(users: int, ttft_p99: float, batch: float) -> dict[str, object]:
    ttft = {"p50": None, "p95": None, "p99": ttft_p99}
    return {"users": users, "ttft_ms": ttft, "mean_batch_size_generator": batch, "tokens_per_engine_step_generator": batch}


def test_sweep_knee_is_the_first_step_over_three_times_the_low_load_p99() -> None:
    knee = find_knee([step(2, 100.0, 1.5), step(4, 250.0, 3.0), step(8, 310.0, 6.0), step(16, 900.0, 12.0)])
    assert (knee["baseline_ttft_p99_ms"], knee["knee_users"], knee["below_knee_users"], knee["below_knee_batch"]) == (100.0, 8, 4, 3.0)
    assert find_knee([step(2, 100.0, 1.5), step(4, 120.0, 2.5)])["knee_users"] is None
