"""The quick tier's one real Serve app (tests/service/conftest.py): Ray, Serve's proxy, the ingress
and both model deployments answer a translation, a completion and a stream, and report ready."""

import httpx

from tests.helpers import assert_serves


def test_the_real_app_serves_both_models_and_streams(service_url: str) -> None:
    assert httpx.get(f"{service_url}/readyz", timeout=60).status_code == 200
    assert_serves(service_url)
