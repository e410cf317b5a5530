"""One real Serve application for the whole test session (Ray starts once)."""

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from model.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.config import RAY_ENVIRONMENT, ModelServingConfig, ServiceConfig
from service.engine.config import EngineConfig

APP_NAME = "transformers"
TEST_CONFIG = ServiceConfig(
    translator=ModelServingConfig(
        name="transformer-en-de",
        checkpoint=DEFAULT_TRANSLATOR,
        engine=EngineConfig(n_slots=16, max_waiting=16),
        num_cpus=0.5,
        torch_threads=1,
    ),
    generator=ModelServingConfig(
        name="transformer-shakespeare",
        checkpoint=DEFAULT_GENERATOR,
        # Requests not yet taken in by the engine count as waiting: 32 streams at once may all
        # reach one replica before its next step. (The 429 tests flood the translator.)
        engine=EngineConfig(n_slots=16, max_waiting=32, default_max_tokens=16),
        num_replicas=2,
        num_cpus=0.5,
        torch_threads=1,
    ),
)


SESSION: dict[str, str] = {}  # what the running session exposes besides its URL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def service_url() -> Iterator[str]:
    import ray
    from ray import serve

    from service.app import build_app

    os.environ.update(RAY_ENVIRONMENT)
    port = free_port()
    metrics_port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _metrics_export_port=metrics_port, logging_level="warning")
    SESSION["metrics_url"] = f"http://127.0.0.1:{metrics_port}/metrics"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(TEST_CONFIG), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "service not ready"
        time.sleep(0.5)
    yield url
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(service_url: str) -> str:
    """Ray's Prometheus endpoint of this node (custom metrics are exported as ray_<name>)."""
    return SESSION["metrics_url"]


def replica_stats(deployment: str, calls: int = 30) -> dict[str, dict[str, Any]]:
    """Engine stats by replica id (calls spread over the replicas by Serve's router)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP_NAME)
    stats: dict[str, dict[str, Any]] = {}
    for _ in range(calls):
        s = handle.stats.remote().result()
        stats[s["replica"]] = s
    return stats
