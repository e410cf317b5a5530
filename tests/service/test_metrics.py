"""Monitoring end to end: a real Prometheus scrapes the session's Ray metrics endpoint and loads
deploy/prometheus/alerts.yml; every dashboard query returns data, every alert rule evaluates, and
the serving metrics count exactly the requests this module sends."""

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml  # type: ignore[import-untyped]

from service.ports import free_port
from tests.helpers import TEST_CONFIG, astream_data, held_until_open, leave_stream, replica_stats, scrape, translations_while_held

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "serving.json"
SHIPPED_SCRAPE = {
    key: yaml.safe_load((ALERTS.parent / "prometheus.yml").read_text())["global"][key] for key in ("scrape_interval", "scrape_timeout")
}
TRANSLATOR = TEST_CONFIG.translator.name
GENERATOR = TEST_CONFIG.generator.name
TTFT_COUNT = "ray_serving_time_to_first_token_seconds_count"
FAILURES = "ray_serving_request_failure_total"
RUNNING = "ray_serving_num_requests_running"
# Ray's node endpoint shows what the replicas recorded only at its next report (every 10 s by
# default): a value counts as final once it has not changed for longer than that.
SETTLE_S = 12.0
SETTLE_TIMEOUT_S = 180.0  # a bound on a broken exporter, not a speed limit
SENTENCES = [
    "A man is riding a bike.",
    "Two dogs play in the snow.",
    "A woman reads a book in the park.",
    "Children are running on the beach.",
    "A group of people stand outside a shop.",
    "The cat sleeps on a red chair.",
]

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="the prometheus binary is not installed (CI installs it)")


def settled(read: Callable[[], dict[str, float]], until: Callable[[dict[str, float]], bool] = lambda _: True) -> dict[str, float]:
    """`read()` once `until` holds of it and it has not changed for SETTLE_S; the last value read
    when SETTLE_TIMEOUT_S passes first (the caller's assertion then shows what differs)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        current = read()
        if current != value:
            value, since = current, time.monotonic()
        elif until(value) and time.monotonic() - since >= SETTLE_S:
            break
    return value


def query(prometheus_url: str, expr: str) -> list[dict[str, Any]]:
    """The instant vector (or scalar) `expr` evaluates to now; fails the test unless Prometheus says success."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result = body["data"]["result"]
    return result if body["data"]["resultType"] == "vector" else [{"metric": {}, "value": result}]


def by_model(prometheus_url: str, expr: str) -> dict[str, float]:
    return {r["metric"]["model"]: float(r["value"][1]) for r in query(prometheus_url, expr)}


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, rows included."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panels = panels + [p for row in panels for p in row.get("panels", [])]
    # Grafana's "All" of the model variable is the regex .* (the variable's allValue)
    return [(p["title"], t["expr"].replace("$model", ".*")) for p in panels for t in p.get("targets", [])]


def alert_rules() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(rule.get("alert") or rule["record"], rule["expr"]) for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def prometheus_url(metrics_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 scraping Ray's endpoint as the shipped config does, with the alert rules; stopped after the module."""
    directory = tmp_path_factory.mktemp("prometheus")
    config = {
        # The shipped scrape interval and timeout: Ray's endpoint can take more than a second to answer
        # on a busy machine, and a scrape that times out leaves every gauge without a value.
        "global": {**SHIPPED_SCRAPE, "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [urlsplit(metrics_url).netloc]}]}],
    }
    config_file = directory / "prometheus.yml"
    config_file.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = (directory / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config_file}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={directory / 'data'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (directory / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200 and query(url, 'up{job="ray"} == 1'):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"Prometheus did not scrape Ray: {(directory / 'prometheus.log').read_text()[-3000:]}"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def _stream_completion(http: httpx.AsyncClient, i: int) -> list[str]:
    body = {"model": GENERATOR, "prompt": f"Scene {i}:\n", "max_tokens": 16, "stream": True, "temperature": 0}
    return await astream_data(http, "/v1/completions", body)


async def _mixed_load(service_url: str) -> None:
    """6 translations (greedy and beam 4), 6 streamed completions and one request refused as invalid, all at once."""
    async with httpx.AsyncClient(base_url=service_url, timeout=300) as http:
        translations = [http.post("/v1/translate", json={"text": s, "beam_size": 1 + 3 * (i % 2)}) for i, s in enumerate(SENTENCES)]
        streams = [_stream_completion(http, i) for i in range(6)]
        invalid = http.post("/v1/completions", json={"model": GENERATOR, "prompt": ""})
        results = await asyncio.gather(invalid, *translations, *streams)
    refused, answers, raws = results[0], results[1 : 1 + len(SENTENCES)], results[1 + len(SENTENCES) :]
    assert isinstance(refused, httpx.Response) and refused.status_code == 400
    assert all(isinstance(a, httpx.Response) and a.status_code == 200 and a.json()["translations"][0]["text"] for a in answers)
    assert all(isinstance(frames, list) and frames[-1] == "[DONE]" for frames in raws)


def test_promtool_accepts_the_config_and_the_rules() -> None:
    for args in (["check", "config", str(PROMETHEUS_CONFIG)], ["check", "rules", str(ALERTS)]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


# Synthetic series (one sample a minute) and the alerts they must raise 16 minutes in: each rule's
# firing case, beside a series of another model that must not fire it.
SYNTHETIC_SERIES = {
    'ray_serving_time_to_first_token_seconds_bucket{model="gen",le="1"}': "0x30",
    'ray_serving_time_to_first_token_seconds_bucket{model="gen",le="5"}': "0+10x30",
    'ray_serving_time_to_first_token_seconds_bucket{model="gen",le="+Inf"}': "0+10x30",
    'ray_serving_time_to_first_token_seconds_bucket{model="tr",le="1"}': "0+10x30",
    'ray_serving_time_to_first_token_seconds_bucket{model="tr",le="5"}': "0+10x30",
    'ray_serving_time_to_first_token_seconds_bucket{model="tr",le="+Inf"}': "0+10x30",
    'ray_serving_request_success_total{model="gen",finished_reason="length",replica="a"}': "0+10x30",
    'ray_serving_request_failure_total{model="gen",reason="internal",replica="a"}': "0+10x30",
    'ray_serving_request_failure_total{model="tr",reason="overloaded",replica="b"}': "0+5x30",  # no success at all
    'ray_serving_request_success_total{model="val",finished_reason="stop",replica="c"}': "0+10x30",
    'ray_serving_request_failure_total{model="val",reason="validation",replica="c"}': "0+10x30",  # the clients' fault
    'ray_serving_num_requests_waiting{model="gen",replica="a"}': "20x30",
    'ray_serving_num_requests_waiting{model="tr",replica="b"}': "0+1x30",
    'ray_serving_kv_cache_usage_ratio{model="gen",deployment="Generator",replica="a"}': "0.95x30",
    'ray_serving_kv_cache_usage_ratio{model="gen",deployment="Generator",replica="b"}': "0.5x30",
    'ray_serve_deployment_replica_healthy{application="transformers",deployment="Generator",replica="a"}': "1x30",
    'ray_serve_deployment_replica_healthy{application="transformers",deployment="Generator",replica="b"}': "1 1 0x30",
    'ray_serve_deployment_replica_healthy{application="transformers",deployment="Translator",replica="c"}': "1x5",  # then gone
    'up{job="ray",instance="127.0.0.1:8080"}': "1 1 0x30",
}
EXPECTED_ALERTS: dict[str, list[tuple[dict[str, str], str]]] = {
    "TimeToFirstTokenP99High": [({"model": "gen"}, "p99 time to first token of gen is 4.96s")],
    "ErrorRatioHigh": [({"model": "gen"}, "50% of gen requests fail"), ({"model": "tr"}, "100% of tr requests fail")],
    "EngineQueueBacklog": [({"model": "gen"}, "20 gen requests waiting for a KV-cache slot")],
    "EngineQueueGrowing": [({"model": "tr"}, "The tr queue keeps growing")],
    "KVCacheNearlyFull": [({"model": "gen", "deployment": "Generator", "replica": "a"}, "KV cache of gen replica a is 95% full")],
    "ServeReplicaUnhealthy": [
        ({"application": "transformers", "deployment": "Generator", "replica": "b"}, "Replica b of Generator fails its health check")
    ],
    "ServeReplicasAbsent": [({"application": "transformers", "deployment": "Translator"}, "No replica of Translator reports any more")],
    "RayMetricsTargetDown": [
        ({"job": "ray", "instance": "127.0.0.1:8080"}, "Prometheus cannot scrape Ray's metrics endpoint 127.0.0.1:8080")
    ],
}


def test_alert_rules_fire_exactly_on_synthetic_series(tmp_path: Path) -> None:
    rules = {r["alert"]: r for group in yaml.safe_load(ALERTS.read_text())["groups"] for r in group["rules"]}
    assert rules.keys() == EXPECTED_ALERTS.keys()
    checks: list[dict[str, Any]] = [
        {
            "eval_time": "16m",
            "alertname": name,
            "exp_alerts": [
                {
                    "exp_labels": labels | rules[name]["labels"],
                    "exp_annotations": {"summary": summary, "description": rules[name]["annotations"]["description"]},
                }
                for labels, summary in expected
            ],
        }
        for name, expected in EXPECTED_ALERTS.items()
    ]
    checks += [{"eval_time": "3m", "alertname": name, "exp_alerts": []} for name in ("TimeToFirstTokenP99High", "ErrorRatioHigh")]
    unit = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": series, "values": values} for series, values in SYNTHETIC_SERIES.items()],
                "alert_rule_test": checks,
            }
        ],
    }
    unit_file = tmp_path / "alerts_test.yml"
    unit_file.write_text(json.dumps(unit))
    done = subprocess.run(["promtool", "test", "rules", str(unit_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_panel_and_alert_evaluates_and_ttft_counts_every_request(service_url: str, prometheus_url: str) -> None:
    # last_over_time: a scrape that timed out on the busy machine leaves no gap in these reads.
    ttft_counts = f"sum by (model) (last_over_time({TTFT_COUNT}[15s]))"
    in_flight = f"sum(last_over_time({RUNNING}[15s])) + sum(last_over_time(ray_serving_num_requests_waiting[15s]))"

    def read() -> dict[str, float]:
        busy = sum(float(r["value"][1]) for r in query(prometheus_url, in_flight))
        return by_model(prometheus_url, ttft_counts) | {"busy": busy}

    before = settled(read, lambda v: v["busy"] == 0)
    assert before["busy"] == 0, "another test's requests are still in flight"

    asyncio.run(_mixed_load(service_url))

    expected = {TRANSLATOR: before.get(TRANSLATOR, 0.0) + len(SENTENCES), GENERATOR: before.get(GENERATOR, 0.0) + 6}
    after = settled(lambda: by_model(prometheus_url, ttft_counts), lambda v: all(v.get(m, 0.0) >= n for m, n in expected.items()))
    assert {m: v for m, v in after.items() if m in expected} == expected  # other tests' apps have models of their own

    empty = []
    for title, expr in dashboard_targets():
        deadline = time.monotonic() + 60  # a gauge misses from the instant after one slow scrape
        while not (result := query(prometheus_url, expr)) and time.monotonic() < deadline:
            time.sleep(1)
        if not result:
            empty.append(f"{title}: {expr}")
        if title in ("Time to first token", "Inter-token latency"):
            assert {TRANSLATOR, GENERATOR} <= {r["metric"]["model"] for r in result}, expr
    assert not empty, "panels without data:\n" + "\n".join(empty)
    rules = alert_rules()
    assert len(rules) >= 5
    for _, expr in rules:
        query(prometheus_url, expr)  # asserts status success

    deadline = time.monotonic() + 60  # Prometheus itself evaluates the rules every second
    while True:
        loaded = [r for g in httpx.get(f"{prometheus_url}/api/v1/rules", timeout=30).json()["data"]["groups"] for r in g["rules"]]
        if all(r["health"] == "ok" for r in loaded) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert sorted(r["name"] for r in loaded) == sorted(name for name, _ in rules)
    assert all(r["health"] == "ok" for r in loaded), [(r["name"], r["health"], r.get("lastError")) for r in loaded]


def test_mean_batch_size_read_from_the_metric_is_exact(service_url: str, metrics_url: str, tmp_path: Path) -> None:
    """sum / count of serving_batch_size, as the dashboard and the load sweep read it, equals the
    engines' own count of sequences per step (Ray rebuilds the sum from bucket midpoints)."""
    deployments = {
        GENERATOR: (GENERATOR, TEST_CONFIG.generator.deployment.get("num_replicas", 1)),
        TRANSLATOR: (TRANSLATOR, TEST_CONFIG.translator.deployment.get("num_replicas", 1)),
    }

    def metric() -> dict[str, float]:
        names = ("ray_serving_batch_size_sum", "ray_serving_batch_size_count")
        return {f"{model} {name}": scrape(metrics_url, name, model=model) for model in deployments for name in names}

    def engines() -> dict[str, float]:
        totals = {}
        for model, (deployment, replicas) in deployments.items():
            stats = replica_stats(deployment, calls=60, replicas=replicas)
            assert len(stats) == replicas, f"{deployment}: {len(stats)} of {replicas} replicas answered"
            totals[f"{model} ray_serving_batch_size_sum"] = float(sum(s["batch_size_sum"] for s in stats.values()))
            totals[f"{model} ray_serving_batch_size_count"] = float(sum(s["steps"] for s in stats.values()))
        return totals

    metric_before, engines_before = settled(metric), engines()
    with held_until_open(TEST_CONFIG.generator, tmp_path / "release", 6):  # the six streams reach the engines before they step
        asyncio.run(_mixed_load(service_url))
    engines_after = engines()
    engine_delta = {k: engines_after[k] - engines_before[k] for k in engines_after}
    metric_after = settled(metric, lambda v: all(v[k] - metric_before[k] >= engine_delta[k] for k in v))
    assert {k: metric_after[k] - metric_before[k] for k in metric_after} == engine_delta
    steps, sequences = engine_delta[f"{GENERATOR} ray_serving_batch_size_count"], engine_delta[f"{GENERATOR} ray_serving_batch_size_sum"]
    assert sequences / steps > 1  # the six concurrent streams were batched


def test_cancelled_stream_and_refused_requests_count_exactly_once(service_url: str, metrics_url: str, tmp_path: Path) -> None:
    def read() -> dict[str, float]:
        return {
            "cancelled": scrape(metrics_url, FAILURES, model=GENERATOR, reason="cancelled"),
            "overloaded": scrape(metrics_url, FAILURES, model=TRANSLATOR, reason="overloaded"),
            "running": scrape(metrics_url, RUNNING, model=GENERATOR),
        }

    before = settled(read, lambda v: v["running"] == 0)
    assert before["running"] == 0

    body = {"model": GENERATOR, "prompt": "HAMLET:", "max_tokens": 200, "stream": True}
    leave_stream(f"{service_url}/v1/completions", body, after_events=1)
    # Closed after one event: the engine aborts the sequence, which counts as cancelled.

    # 48 beam-8 translations at once while the translator's step is held: it holds 32, the rest are refused.
    flood = translations_while_held(service_url, {"text": SENTENCES[0], "beam_size": 8, "max_tokens": 10}, 48, tmp_path / "release")
    statuses = [r.status_code for r in flood]
    assert set(statuses) <= {200, 429}
    refused = statuses.count(429)
    assert refused > 0

    expected = {"cancelled": before["cancelled"] + 1, "overloaded": before["overloaded"] + refused, "running": 0.0}
    after = settled(read, lambda v: all(v[k] >= n for k, n in expected.items()) and v["running"] == 0)
    assert after == expected
