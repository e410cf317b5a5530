"""Losing a node under load loses no request: a two-node cluster of its own, both models with two
replicas spread over the nodes, the ingress and the one proxy on the head (in production the load
balancer stops sending to a lost node's proxy; here both nodes share one address, so only the
head's proxy serves). Under a bounded mixed load the worker node's raylet is SIGKILLed, as a lost
spot instance would be."""

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from loadtests.cluster import (
    GENERATOR,
    TRANSLATOR,
    LocalCluster,
    Replica,
    ReplicaCheck,
    local_cluster,
    replicas_of,
    write_config,
)
from loadtests.scaling import Load, Result, Scenario, Timeline, cluster_config, run_scenario
from service.metrics import RETRY_OUTCOMES
from service.ports import free_port
from tests.helpers import EAGER_DECODE, assert_serves, scrape

SERVED_AGAIN_WITHIN_S = 10.0  # the bound: from the kill, every new request is served
SERVED_LATER = 30  # requests sent past that bound, which the load goes on for


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalCluster, str]]:
    directory = Path(tempfile.mkdtemp(prefix="nl-", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        with local_cluster(directory / "cluster", num_cpus=4) as cluster:
            port = free_port()
            config = cluster_config(port, compiled_decode=EAGER_DECODE)
            config["proxy_location"] = "HeadOnly"
            args = config["applications"][0]["args"]
            args["ingress_actor_options"] = {"resources": {"head": 0.01}}
            for model in args["models"]:
                deployment = model["deployment"]
                deployment.pop("autoscaling_config")
                deployment["num_replicas"] = 2
            cluster.deploy(write_config(config, directory / "config.json"))
            cluster.wait_for(ReplicaCheck(running={TRANSLATOR: 2, GENERATOR: 2}))
            yield cluster, f"http://127.0.0.1:{port}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def worker_raylet(cluster: LocalCluster) -> psutil.Process:
    """The raylet of the worker node (the second `ray start` of the cluster)."""
    worker_start = psutil.Process(cluster.processes[1].pid)
    (raylet,) = [p for p in worker_start.children(recursive=True) if p.name() == "raylet"]
    return raylet


def error_of(text: str) -> dict[str, Any]:
    """The OpenAI error envelope's inside, from a response body or an error event."""
    try:
        error: dict[str, Any] = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error


def allowed(result: Result) -> bool:
    """200 in full; a 503 that says to come back; or a stream that ended with the retryable error
    event and [DONE] (check_stream: "error frame: <the event>"). Never a 500, never a connection
    cut (status 0)."""
    if result.error is None:
        return result.status == 200
    if result.kind == "stream" and result.status == 200 and result.error.startswith("error frame: "):
        event = error_of(result.error.removeprefix("error frame: "))
        return event.get("type") == "server_error" and event.get("code") == 503
    return result.status == 503 and error_of(result.error).get("code") == 503


def test_losing_the_worker_node_under_load_loses_no_request(cluster: tuple[LocalCluster, str]) -> None:
    ray_cluster, url = cluster
    app = ray_cluster.application()
    assert app is not None
    placed: list[Replica] = replicas_of(app)
    (head,) = {r.node_id for r in placed if r.deployment == "Ingress"}
    assert any(r.node_id != head for r in placed if r.deployment in (TRANSLATOR, GENERATOR)), placed  # something to lose
    raylet = worker_raylet(ray_cluster)

    def served_after_the_loss(timeline: Timeline) -> bool:
        if timeline.action_end is None:
            return False
        return sum(r.start > timeline.action_end + SERVED_AGAIN_WITHIN_S for r in timeline.results) >= SERVED_LATER

    worker_metrics = f"http://127.0.0.1:{ray_cluster.metrics_ports[1]}/metrics"

    def kill_while_the_worker_serves() -> None:
        """SIGKILLs the worker's raylet once its replicas have shown running requests on two
        consecutive scrapes: the router may leave a node idle for a while, and a loss with nothing
        in flight there would test nothing."""
        deadline, busy = time.monotonic() + 120, 0
        while busy < 2:
            busy = busy + 1 if scrape(worker_metrics, "ray_serving_num_requests_running") > 0 else 0
            assert time.monotonic() < deadline, "the worker node's replicas were never given a request to lose"
            time.sleep(1)  # a poll interval: the loop ends on the gauge
        raylet.kill()

    # Requests of 160 tokens (seconds each here): a worker seen busy is still busy when the kill lands.
    # With 48, one run under a loaded machine lost nothing (every request on the worker had ended).
    load = Load(streams=8, completions=4, translations=4, max_requests=1000, max_tokens=160)
    scenario = Scenario(
        load=load, stop_when=served_after_the_loss, settled=lambda replicas: True, action=kill_while_the_worker_serves, action_after=40
    )
    timeline = asyncio.run(run_scenario(ray_cluster, url, scenario))
    killed_t = timeline.action_end  # when the SIGKILL had been sent, on the timeline's clock
    assert killed_t is not None
    bad = [r for r in timeline.results if not allowed(r)]
    assert not bad, [(r.kind, r.status, r.error) for r in bad[:5]]
    late = [r for r in timeline.results if r.start > killed_t + SERVED_AGAIN_WITHIN_S]
    assert len(late) >= SERVED_LATER and all(r.error is None for r in late), [(r.kind, r.start, r.status, r.error) for r in late[:5]]
    print(
        f"node lost at {killed_t:.1f} s: {len(timeline.results)} requests, "
        f"{sum(r.error is None for r in timeline.results)} answered in full, "
        f"{sum(r.status == 503 for r in timeline.results)} 503, "
        f"{sum(r.kind == 'stream' and r.error is not None for r in timeline.results)} streams ended with the error event"
    )
    assert_serves(url)
    # The ingress's count of what became of the lost requests: every stream that ended with the
    # error event is a "cut", and every request sent again ended "answered" or "unavailable".
    cut = sum(r.kind == "stream" and r.error is not None for r in timeline.results)
    head_metrics = f"http://127.0.0.1:{ray_cluster.metrics_ports[0]}/metrics"

    def outcomes() -> dict[str, float]:
        return {o: scrape(head_metrics, "ray_serving_request_retries_total", outcome=o) for o in RETRY_OUTCOMES}

    def counted(seen: dict[str, float]) -> bool:
        return seen["cut"] == cut and sum(seen.values()) > 0 and (seen["retried"] == 0 or seen["answered"] + seen["unavailable"] > 0)

    # Ray exports metrics every few seconds; 120 s bounds a broken exporter. (Not loadtests.cluster's
    # wait_until: it stops when a `ray start` has exited, as the worker's has.)
    deadline = time.monotonic() + 120
    while not counted(seen := outcomes()):
        assert time.monotonic() < deadline, f"the ingress's counts {seen} against {cut} streams cut"
        time.sleep(2)  # a poll interval: the loop ends on the counts, not on time
    print("retries by outcome:", seen)
