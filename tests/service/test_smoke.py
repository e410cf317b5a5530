"""The quick tier's one real Serve app (tests/service/conftest.py): Ray, Serve's proxy, the ingress
and both model deployments answer a translation, a completion and a stream, and report ready; the
replicas run below their engines' processes."""

import os
from typing import Any

import httpx

from tests.helpers import APP_NAME, TEST_CONFIG, assert_serves


def test_the_real_app_serves_both_models_and_streams(service_url: str) -> None:
    assert httpx.get(f"{service_url}/readyz", timeout=60).status_code == 200
    assert_serves(service_url)


def test_a_prompt_past_the_context_is_refused_naming_the_numbers_and_long_prompts_within_it_are_served(service_url: str) -> None:
    """Prompts are bounded by the model's context in tokens (256 for the shipped generator), not by
    characters: a long prompt within it is served, one past it is a 400 as vLLM words it."""
    verse = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    long_within = httpx.post(f"{service_url}/v1/completions", json={"prompt": verse * 8, "max_tokens": 4, "temperature": 0}, timeout=120)
    assert long_within.status_code == 200, long_within.text
    past = httpx.post(f"{service_url}/v1/completions", json={"prompt": verse * 60, "max_tokens": 4}, timeout=120)
    assert past.status_code == 400
    assert "maximum context length is 256 tokens. However, your request has" in past.json()["error"]["message"]


def test_the_replicas_run_below_their_engines_processes(service_url: str) -> None:
    """Ray starts the replicas at this process's priority (RAY_worker_niceness 0): each model's
    engine process stays there, the model replicas and the ingress run at their nice value (10
    by default) or there if that is lower."""
    from ray import serve

    started = os.getpriority(os.PRIO_PROCESS, 0)
    for model in TEST_CONFIG.models:
        stats: Any = serve.get_deployment_handle(model.name, app_name=APP_NAME).stats.remote().result()
        assert stats["engine_process"]["nice"] == started
        assert stats["nice"] == max(model.replica_niceness, started)
    ingress: Any = serve.get_deployment_handle("Ingress", app_name=APP_NAME).stats.remote().result()
    assert ingress["nice"] == max(TEST_CONFIG.ingress_niceness, started)
