"""A real two-node Ray cluster on this machine (token authentication on), the app deployed from
deploy/serve_config.yaml with `serve deploy`, then, in order: placement and serving, autoscaling
under a bounded load, the replicas panel of the dashboard, a rollout under load, and the Docker
image's command on deploy/serve_config.gpu.yaml. Every process runs outside pytest's (the
cluster's nodes and the Serve CLI), so this module never meets the session's own `ray.init`."""

import asyncio
import json
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from httpx_sse import connect_sse

from loadtests.cluster import (
    GENERATOR,
    MODEL_DEPLOYMENTS,
    ROOT,
    TRANSLATOR,
    LocalCluster,
    Replica,
    ReplicaCheck,
    local_cluster,
    replicas_of,
    session_members,
    write_config,
)
from loadtests.scaling import (
    Load,
    Prometheus,
    Scenario,
    Timeline,
    autoscaling_scenario,
    cluster_config,
    run_prometheus,
    run_scenario,
    summary,
)
from service.ports import free_port
from tests.helpers import EAGER_DECODE, assert_serves

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "serving.json"
GPU_CONFIG = ROOT / "deploy" / "serve_config.gpu.yaml"
RUNS: dict[str, Timeline] = {}  # what one test measured, for a later one to read
METRICS_SETTLE_S = 180.0  # a bound on a broken exporter: Ray reports every 10 s
BROKEN_CLUSTER_REQUESTS = 1000  # a load's bound per client where it runs until a rollout is over
SHIPPED = cluster_config(0)  # deploy/serve_config.yaml as the tests serve it
HELD_S = SHIPPED["http_options"]["request_timeout_s"] - 20.0  # the held generator's deadlines: below Serve's own


def shipped_model(name: str) -> dict[str, Any]:
    """The model's entry in the shipped CPU config."""
    (model,) = [m for m in SHIPPED["applications"][0]["args"]["models"] if m["name"] == name]
    return model


@dataclass
class Deployed:
    cluster: LocalCluster
    url: str
    port: int
    prometheus: Prometheus | None  # a Prometheus scraping both nodes (the shipped intervals), where one is installed
    directory: Path


@pytest.fixture(scope="module")
def deployed() -> Iterator[Deployed]:
    # Ray's socket paths must stay short: not under pytest's tmp_path.
    directory = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    try:
        # Four logical CPUs and one logical GPU a node: room for the CPU config's half-CPU
        # replicas, a rollout's surge, and the GPU config's half-GPU replicas (on the CPU here).
        # 6 logical CPUs a node: the GPU config's three models (2 CPUs a replica) start beside the old ones.
        with local_cluster(directory / "cluster", num_cpus=6, num_gpus=1) as cluster:
            monitor = run_prometheus(cluster, directory / "prometheus") if shutil.which("prometheus") else None
            try:
                port = free_port()
                # The generator can be held by the rollout test (fault injection, tests only); its
                # engine is then stalled on purpose, so its heartbeat is allowed as long, and the
                # requests queued meanwhile wait as long as Serve lets them (they are answered at
                # the release, once the new replica runs, however long it took to start here).
                engine = {**shipped_model(GENERATOR)["engine"], "queue_timeout_s": HELD_S, "request_timeout_s": HELD_S}
                held = {GENERATOR: {"fault_injection": True, "heartbeat_timeout_s": 600, "engine": engine}}
                cluster.deploy(write_config(cluster_config(port, models=held, compiled_decode=EAGER_DECODE), directory / "v1.json"))
                cluster.wait_for(ReplicaCheck(running={TRANSLATOR: 1, GENERATOR: 1}))
                yield Deployed(cluster, f"http://127.0.0.1:{port}", port, monitor, directory)
            finally:
                if monitor is not None:
                    monitor.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def failure_report(cluster: LocalCluster, timeline: Timeline) -> str:
    """The first failed requests, and Serve's warnings and errors from 10 s before the first failure
    to 5 s after the last: what a failed run shows of both sides."""
    failures = timeline.failures()
    first, last = (timeline.wall_start + t for t in (min(r.start for r in failures), max(r.end for r in failures)))
    logs = "\n".join(cluster.serve_log_lines(first - 10, last + 5)[-40:])
    return f"{len(failures)} failed, the first: {failures[:5]}\nServe's warnings and errors around them:\n{logs}"


def replicas(cluster: LocalCluster) -> list[Replica]:
    app = cluster.application()
    assert app is not None
    return replicas_of(app)


def listening(cluster: LocalCluster, port: int) -> set[str]:
    """The addresses the cluster's own processes listen on at this port."""
    pids = set(session_members({p.pid for p in cluster.processes}))
    connections = psutil.net_connections(kind="tcp")
    return {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid in pids}


def test_the_app_serves_from_both_nodes_of_a_token_authenticated_cluster(deployed: Deployed) -> None:
    cluster = deployed.cluster
    nodes = cluster.alive_nodes()
    assert len(nodes) == 2
    # Token authentication is on: the dashboard's API refuses a request without the token, and a
    # node with another token does not join (the GCS refuses it).
    assert httpx.get(f"{cluster.dashboard_url}/api/serve/applications/", timeout=30).status_code == 401
    ports = [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    with pytest.raises(subprocess.CalledProcessError) as refused:
        cluster.cli("ray", "start", f"--address={cluster.gcs_address}", *ports, env={"RAY_AUTH_TOKEN": "0" * 64}, timeout_s=180)
    assert "InvalidAuthToken" in refused.value.stderr + refused.value.stdout
    assert cluster.alive_nodes() == nodes
    placed = {r.node_id for r in replicas(cluster) if r.deployment in MODEL_DEPLOYMENTS}
    assert placed == nodes, f"the model replicas are on {placed}, the nodes are {nodes}"  # Serve spreads replicas
    assert_serves(deployed.url)
    # A Serve proxy on each node, both on the loopback interface only.
    assert len(cluster.get("/api/serve/applications/")["proxies"]) == 2
    assert listening(cluster, deployed.port) == {"127.0.0.1"}


def test_the_generator_scales_out_under_load_and_back_in_after_with_every_request_answered(deployed: Deployed) -> None:
    cluster = deployed.cluster
    cluster.wait_for(ReplicaCheck(running={TRANSLATOR: 1, GENERATOR: 1}))
    timeline = asyncio.run(run_scenario(cluster, deployed.url, autoscaling_scenario(dashboard=deployed.prometheus)))
    RUNS["autoscaling"] = timeline
    numbers = summary(timeline)
    print("autoscaling:", numbers)
    assert timeline.failures() == [], failure_report(cluster, timeline)
    assert numbers["statuses"] == {"200": numbers["requests"]}
    assert timeline.running(GENERATOR)[0][1] == 1  # before the load
    scale_out = timeline.first(GENERATOR, 2)
    assert scale_out is not None and timeline.load_end is not None and timeline.load_start < scale_out < timeline.load_end, numbers
    assert timeline.settled is not None, f"the generator did not get back to one replica: {numbers}"
    assert timeline.running(GENERATOR)[-1][1] == 1 and timeline.running(TRANSLATOR)[-1][1] == 1
    # The translator's load (two clients) stayed below its target: it did not scale with the generator.
    assert max(n for _, n in timeline.running(TRANSLATOR)) == 1


def query_range(prometheus: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": "1s"}, timeout=60)
    body = response.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def panel_exprs(title: str) -> list[str]:
    (panel,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    return [t["expr"].replace("$model", ".*") for t in panel["targets"]]  # Grafana's "All"


def exporter_report(prometheus: str, timeline: Timeline, end: float) -> str:
    """Serve's and Prometheus's views of the generator's replicas, for a failure's message: when
    each replica was RUNNING (s since the start), each one's health series as runs of (first s,
    last s, value), and failed scrapes per target."""
    start = timeline.wall_start
    running: dict[str, list[float]] = {}
    for sample in timeline.samples:
        for r in sample.replicas:
            if r.deployment == GENERATOR and r.state == "RUNNING":
                running.setdefault(r.replica_id, [sample.t, sample.t])[1] = sample.t
    healthy = query_range(prometheus, f'ray_serve_deployment_replica_healthy{{deployment="{GENERATOR}"}}', start, end)
    lines = []
    for series in healthy:
        runs: list[list[Any]] = []
        for t, v in series["values"]:
            if runs and runs[-1][2] == v and t - runs[-1][1] <= 1.5:
                runs[-1][1] = t
            else:
                runs.append([t, t, v])
        where = f"{series['metric'].get('replica')} @ {series['metric'].get('instance')}"
        lines.append(f"{where}: {[(round(a - start), round(b - start), v) for a, b, v in runs]}")
    scrapes = query_range(prometheus, "up", start, end)
    failed = {s["metric"]["instance"]: sum(v == "0" for _, v in s["values"]) for s in scrapes}
    return "\n".join([f"RUNNING: {running}", *lines, f"failed scrapes: {failed}"])


def test_the_replicas_panel_shows_each_generator_replica_come_and_go(deployed: Deployed) -> None:
    if deployed.prometheus is None:
        pytest.skip("the prometheus binary is not installed (CI installs it)")
    prometheus = deployed.prometheus.url
    if "autoscaling" not in RUNS:
        pytest.skip("needs the autoscaling test's run")
    timeline = RUNS["autoscaling"]
    start = timeline.wall_start
    per_replica, count = panel_exprs("Replicas over time")

    def generator_count(end: float) -> list[int]:
        (generator,) = [s for s in query_range(prometheus, count, start, end) if s["metric"]["deployment"] == GENERATOR]
        return [int(float(v)) for _, v in generator["values"]]

    # Ray's endpoints show a replica's end at their next report (every 10 s): wait for it, bounded.
    deadline = time.monotonic() + METRICS_SETTLE_S
    while (values := generator_count(end := time.time()))[-1] != 1 and time.monotonic() < deadline:
        time.sleep(2)
    report = exporter_report(prometheus, timeline, end)
    assert values[0] == 1 and max(values) >= 2 and values[-1] == 1, (values, summary(timeline), report)
    series = [s for s in query_range(prometheus, per_replica, start, end) if s["metric"]["deployment"] == GENERATOR]
    assert len({s["metric"]["replica"] for s in series}) >= 2, series  # one series per replica
    # Both generator replicas answered requests (their own counters, per replica).
    successes = 'ray_serving_request_success_total{model="transformer-shakespeare"}'
    served = f"max by (replica) (max_over_time({successes}[{int(end - start) + 60}s]))"
    answered = httpx.get(f"{prometheus}/api/v1/query", params={"query": served, "time": end}, timeout=60).json()["data"]["result"]
    assert sum(float(r["value"][1]) > 0 for r in answered) >= 2, answered


def rollout(deployed: Deployed, deploy: Callable[[], object], load: Load, after_rollout: int) -> tuple[Timeline, frozenset[str]]:
    """Runs `deploy` (a changed config) under `load` (below the generator's autoscaling target, so
    only the rollout changes replicas); the load goes on until no old replica is left, each
    deployment has a new one running, and `after_rollout` more requests are answered."""
    cluster = deployed.cluster
    old = frozenset(r.replica_id for r in cluster.wait_for(ReplicaCheck(running={TRANSLATOR: 1, GENERATOR: 1})))

    def replaced(sample: list[Replica]) -> bool:
        running = {r.deployment for r in sample if r.state == "RUNNING"}
        # A superset: the GPU config adds the second language pair.
        return not old & {r.replica_id for r in sample} and running >= {"Ingress", *MODEL_DEPLOYMENTS}

    def rolled_out(timeline: Timeline) -> bool:
        if timeline.action_end is None:
            return False
        done = next((s.t for s in timeline.samples if s.t > timeline.action_end and replaced(s.replicas)), None)
        return done is not None and timeline.completed_after(done) >= after_rollout

    scenario = Scenario(load=load, stop_when=rolled_out, settled=replaced, action=deploy, action_after=load.streams)
    return asyncio.run(run_scenario(cluster, deployed.url, scenario)), old


# Run in the cluster's environment as a Ray driver: arms every running generator replica's
# FaultInjectingRunner so that its next step stalls until the file argv[2] exists, or ("busy")
# waits until the armed replicas hold a request. Prints the replica ids.
GENERATOR_CONTROL = """
import sys, time, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="error")
handle = serve.get_deployment_handle("transformer-shakespeare", app_name="transformers")
if sys.argv[3] == "arm":
    print(" ".join(sorted({handle.inject_fault.remote("stall", 1, None, sys.argv[2]).result() for _ in range(20)})))
else:
    deadline = time.monotonic() + 120
    while not any(s["running"] + s["waiting"] for s in (handle.stats.remote().result() for _ in range(5))):
        assert time.monotonic() < deadline, "the held request never reached the generator"
        time.sleep(0.2)
"""


def control_generator(cluster: LocalCluster, release: Path, command: str) -> list[str]:
    done = cluster.cli(
        "python", "-c", GENERATOR_CONTROL, cluster.gcs_address, str(release), command, env={"RAY_ADDRESS": cluster.gcs_address}
    )
    return done.stdout.split()


def read_held_stream(url: str, body: dict[str, Any], result: dict[str, Any]) -> None:
    """Reads one streamed completion to its end into result: its data lines, its text, and when it ended."""
    with httpx.Client(timeout=600) as http, connect_sse(http, "POST", f"{url}/v1/completions", json=body) as source:
        result["status"] = source.response.status_code
        result["data"] = [event.data for event in source.iter_sse()]
    result["ended"] = time.monotonic()


def test_a_changed_config_rolls_out_under_load_without_a_failed_request_or_a_cut_stream(deployed: Deployed) -> None:
    """The rollout loses nothing, and the old generator replica drains: a stream it holds when it
    is told to stop ends with [DONE] and the text the model makes for its request.

    The stream spans the switch by construction, whatever the machine's speed: the old replica's
    engine is held (a stall until a file exists, tests only: `fault_injection`) from before the
    stream is sent until the test has seen the new replica running and the old one draining;
    only then is the file written and the stream answered."""
    cluster = deployed.cluster
    release = deployed.directory / "release-old-generator"
    running = {r.replica_id for r in replicas(cluster) if r.deployment == GENERATOR and r.state == "RUNNING"}
    assert set(control_generator(cluster, release, "arm")) == running  # every generator replica held
    body = {"model": "transformer-shakespeare", "prompt": "ROMEO:\n", "max_tokens": 48, "temperature": 0, "stream": True}
    held: dict[str, Any] = {}
    reader = threading.Thread(target=read_held_stream, args=(deployed.url, body, held), daemon=True)
    reader.start()
    control_generator(cluster, release, "busy")  # the stream is in the held replica's engine

    def release_once_switched() -> None:
        """Writes the release file once a new generator replica runs and the held ones drain. (Not
        LocalCluster.wait_for: that waits for the application to be RUNNING, which it is not
        until the held replicas have drained, that is until the release.)"""
        deadline = time.monotonic() + 600  # a bound on a broken cluster
        while time.monotonic() < deadline:
            generators = [r for r in replicas(cluster) if r.deployment == GENERATOR]
            new_running = any(r.state == "RUNNING" and r.replica_id not in running for r in generators)
            if new_running and all(r.state != "RUNNING" for r in generators if r.replica_id in running):
                held["released"] = time.monotonic()
                release.touch()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=release_once_switched, daemon=True)
    watcher.start()
    # A new checkpoint folder for the translator, new engine limits and pacing for the generator.
    checkpoint = shutil.copytree(ROOT / "model" / "checkpoints" / "translator-en-de", deployed.directory / "translator-en-de-v2")
    models = {
        TRANSLATOR: {"checkpoint": str(checkpoint)},
        GENERATOR: {"engine": {"n_slots": 24, "max_waiting": 48, "default_max_tokens": 16}, "stream_interval_ms": 20},
    }
    v2 = write_config(cluster_config(deployed.port, models=models, compiled_decode=EAGER_DECODE), deployed.directory / "v2.json")
    load = Load(
        streams=6, completions=1, translations=2, max_requests=BROKEN_CLUSTER_REQUESTS, max_tokens=200, request_timeout_s=HELD_S + 30
    )
    timeline, old = rollout(deployed, lambda: cluster.deploy(v2), load, after_rollout=8)
    print("rollout:", summary(timeline), "deploy from", timeline.action_start, "to", timeline.action_end, "settled", timeline.settled)
    watcher.join(timeout=60)
    reader.join(timeout=600)
    assert timeline.failures() == [], failure_report(cluster, timeline)
    assert all(r.status == 200 for r in timeline.results)
    final = replicas(cluster)
    assert timeline.settled is not None and not old & {r.replica_id for r in final}, final
    assert {r.deployment for r in final} == {"Ingress", *MODEL_DEPLOYMENTS}
    app = cluster.application()
    assert app is not None
    (translator,) = [m for m in app["deployed_app_config"]["args"]["models"] if m["name"] == TRANSLATOR]
    assert translator["checkpoint"] == str(checkpoint)

    # The held stream: answered only after the switch was seen, in full, with the model's text.
    assert "released" in held and held["ended"] > held["released"], held
    assert held["status"] == 200 and held["data"][-1] == "[DONE]", held
    text = "".join(c["text"] for d in held["data"][:-1] for c in json.loads(d).get("choices", []))
    again = httpx.post(f"{deployed.url}/v1/completions", json={**body, "stream": False}, timeout=120)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == text, (text, again.text)


def test_the_images_command_serves_the_gpu_config_here(deployed: Deployed) -> None:
    """The Dockerfile's `serve run` of deploy/serve_config.gpu.yaml, run against this cluster (its
    nodes declare a GPU each; `device: auto` runs the models on the CPU): the app rolls over to it
    under load, and Serve keeps the proxies it has, on 127.0.0.1 (the config's 0.0.0.0 is ignored)."""
    command = dockerfile_serve_run()
    assert command[:2] == ["serve", "run"] and (ROOT / command[-1]).resolve() == GPU_CONFIG
    non_blocking = [*command[:2], "--non-blocking", *command[2:]]
    env = {"RAY_ADDRESS": deployed.cluster.gcs_address}
    load = Load(streams=2, completions=1, translations=1, max_requests=BROKEN_CLUSTER_REQUESTS, max_tokens=32)
    timeline, old = rollout(deployed, lambda: deployed.cluster.cli(*non_blocking, env=env), load, after_rollout=8)
    print("image command:", summary(timeline), "deploy from", timeline.action_start, "to", timeline.action_end, "settled", timeline.settled)
    assert timeline.failures() == [], failure_report(deployed.cluster, timeline)
    app = deployed.cluster.application()
    assert app is not None and app["deployed_app_config"]["args"] == yaml.safe_load(GPU_CONFIG.read_text())["applications"][0]["args"]
    for model in yaml.safe_load(GPU_CONFIG.read_text())["applications"][0]["args"]["models"]:
        gpus = model["deployment"]["ray_actor_options"]["num_gpus"]
        assert gpus > 0 and app["deployments"][model["name"]]["deployment_config"]["ray_actor_options"]["num_gpus"] == gpus
    assert not old & {r.replica_id for r in replicas(deployed.cluster)}
    assert_serves(deployed.url)
    assert listening(deployed.cluster, deployed.port) == {"127.0.0.1"} and listening(deployed.cluster, 8000) == set()


def dockerfile_serve_run() -> list[str]:
    """The `serve run ...` the image's CMD ends with (after starting a head node)."""
    (cmd,) = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("CMD ")]
    shell, flag, script = json.loads(cmd.removeprefix("CMD "))
    assert (shell, flag) == ("sh", "-c")
    start, serve_run = script.split(" && exec ")
    assert start.startswith("ray start --head ")
    return shlex.split(serve_run)
