"""One real Serve application for the whole test session (Ray starts once)."""

import time
from collections.abc import Iterator

import httpx
import pytest

from service.ports import free_port
from tests.helpers import APP_NAME, TEST_CONFIG

SESSION: dict[str, str] = {}  # what the running session exposes besides its URL


@pytest.fixture(scope="session")
def service_url() -> Iterator[str]:
    import ray
    from ray import serve

    from service.app import build_app

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
