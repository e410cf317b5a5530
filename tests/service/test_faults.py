"""Faults against a real Serve application of their own (route prefix /faults, beside the session's
app in the same Ray): a failing engine step, deadlines, a wedged loop, a replica killed under load."""

import asyncio
import itertools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from service.config import ServiceConfig
from service.engine.config import EngineConfig
from tests.helpers import TEST_CONFIG, scrape, wait_until
from tests.helpers import replica_stats as shared_replica_stats

APP = "faults"
FAST_HEALTH = {"fault_injection": True, "heartbeat_timeout_s": 3.0}
FAST_DEPLOYMENT = {"health_check_period_s": 1.0, "graceful_shutdown_timeout_s": 1.0, "ray_actor_options": {"num_cpus": 0.05}}
# The session's models under other names (their metrics stay apart), with fast health checks.
FAULT_CONFIG = ServiceConfig(
    models=(
        TEST_CONFIG.translator.model_copy(
            update={
                "name": "faulty-en-de",
                "engine": EngineConfig(n_slots=8, max_waiting=8, queue_timeout_s=1.0, request_timeout_s=2.0),
                "deployment": TEST_CONFIG.translator.deployment | FAST_DEPLOYMENT,
                **FAST_HEALTH,
            }
        ),
        TEST_CONFIG.generator.model_copy(
            update={
                "name": "faulty-shakespeare",
                "engine": EngineConfig(n_slots=8, max_waiting=16, default_max_tokens=16),
                "deployment": TEST_CONFIG.generator.deployment | FAST_DEPLOYMENT,
                "stream_interval_ms": 0,
                **FAST_HEALTH,
            }
        ),
    ),
)


@pytest.fixture(scope="module")
def faults_url(service_url: str) -> Iterator[str]:
    from ray import serve

    from service.app import build_app

    serve.run(build_app(FAULT_CONFIG), name=APP, route_prefix=f"/{APP}")
    url = f"{service_url}/{APP}"
    wait_until(lambda: httpx.get(f"{url}/readyz", timeout=10).status_code == 200, "fault app ready")
    yield url
    serve.delete(APP)


def handle(deployment: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP)


def replica_stats(deployment: str, calls: int = 20) -> dict[str, dict[str, Any]]:
    return shared_replica_stats(deployment, calls, APP)


def failures(metrics_url: str, model: str, reason: str) -> float:
    return scrape(metrics_url, "ray_serving_request_failure_total", model=model, reason=reason)


def test_a_failing_step_fails_only_its_requests(faults_url: str, metrics_url: str) -> None:
    body = {"text": "A dog runs on the beach.", "beam_size": 1}
    expected = httpx.post(f"{faults_url}/v1/translate", json=body, timeout=60).json()["translations"][0]["text"]
    before = failures(metrics_url, "faulty-en-de", "internal")
    handle(FAULT_CONFIG.translator.name).inject_fault.remote("error", 1).result()
    failed = httpx.post(f"{faults_url}/v1/translate", json=body, timeout=60)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "internal_error"
    after = httpx.post(f"{faults_url}/v1/translate", json=body, timeout=60)  # the loop goes on
    assert after.status_code == 200 and after.json()["translations"][0]["text"] == expected
    wait_until(lambda: failures(metrics_url, "faulty-en-de", "internal") > before, "the failure counted")
    (stats,) = replica_stats(FAULT_CONFIG.translator.name, 3).values()
    assert stats["running"] == 0 and stats["free_slots"] == 8


def test_deadlines_end_requests_with_a_clear_status_and_free_their_slots(faults_url: str) -> None:
    """A 3 s stall of the engine loop: the request it held passes its 2 s total deadline, the one
    that arrived meanwhile its 1 s queue deadline."""
    handle(FAULT_CONFIG.translator.name).inject_fault.remote("stall", 1, 3.0).result()

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            running = asyncio.ensure_future(http.post(f"{faults_url}/v1/translate", json={"text": "A man rides a bike.", "beam_size": 1}))
            await asyncio.sleep(0.5)
            queued = await http.post(f"{faults_url}/v1/translate", json={"text": "Two dogs play.", "beam_size": 1})
            return await running, queued

    running, queued = asyncio.run(main())
    for response in (running, queued):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1" and "timed out" in response.json()["error"]["message"]
    (stats,) = replica_stats(FAULT_CONFIG.translator.name, 3).values()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["free_slots"] == 8
    assert stats["finished"].get("timeout", 0) >= 2
    ok = httpx.post(f"{faults_url}/v1/translate", json={"text": "A cat sleeps.", "beam_size": 1}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize("where", ["queued", "prefill"])
def test_a_cancelled_request_frees_its_slot_and_leaves_the_others_unchanged(
    faults_url: str, metrics_url: str, where: str, tmp_path: Path
) -> None:
    """The engine's next step is held until a file exists. The client of one of two requests
    leaves while it is: "prefill" the one that step admitted, "queued" the one that arrived while
    the other held it. The step is released once the replica has sent the abort (its open_streams),
    so the abort reaches the engine before its next step. The other's translation is the same as
    alone; nothing is left running, waiting or holding cache rows (the replica's stats and gauges)."""
    first, second = {"text": "A man rides a bike.", "beam_size": 1}, {"text": "Two dogs play in the park.", "beam_size": 1}
    alone = {
        b["text"]: httpx.post(f"{faults_url}/v1/translate", json=b, timeout=60).json()["translations"][0]["text"] for b in (first, second)
    }
    (before,) = replica_stats(FAULT_CONFIG.translator.name, 3).values()
    release_file = tmp_path / "release"
    handle(FAULT_CONFIG.translator.name).inject_fault.remote("stall", 1, None, str(release_file)).result()

    def open_streams(count: int) -> None:
        """Until the replica has `count` requests open (polled often: the held requests' deadlines run)."""
        opened = lambda: next(iter(replica_stats(FAULT_CONFIG.translator.name, 1).values()))["open_streams"] == count  # noqa: E731
        wait_until(opened, f"{count} open", interval_s=0.01)

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http, httpx.AsyncClient(timeout=0.4) as leaving:
            translate = asyncio.ensure_future
            if where == "prefill":  # the leaving one is admitted by the held step; the kept one is sent once it has left
                left = translate(leaving.post(f"{faults_url}/v1/translate", json=first))
                with pytest.raises(httpx.TimeoutException):
                    await left  # the client gives up after 0.4 s and closes the connection
                await asyncio.to_thread(open_streams, 0)
                stays = translate(http.post(f"{faults_url}/v1/translate", json=second))  # before or after the release
            else:  # the kept one is admitted by the held step; the leaving one waits behind it
                stays = translate(http.post(f"{faults_url}/v1/translate", json=first))
                await asyncio.to_thread(open_streams, 1)
                left = translate(leaving.post(f"{faults_url}/v1/translate", json=second))
                await asyncio.to_thread(open_streams, 2)
                with pytest.raises(httpx.TimeoutException):
                    await left
                await asyncio.to_thread(open_streams, 1)
            release_file.touch()
            return await stays

    try:
        kept_response = asyncio.run(main())
    finally:
        release_file.touch()
    kept_text = second["text"] if where == "prefill" else first["text"]
    assert kept_response.status_code == 200 and kept_response.json()["translations"][0]["text"] == alone[kept_text]

    def idle() -> bool:
        (now,) = replica_stats(FAULT_CONFIG.translator.name, 3).values()
        return (
            now["running"] == 0
            and now["waiting"] == 0
            and now["free_slots"] == 8
            and now["finished"].get("abort", 0) > before["finished"].get("abort", 0)
        )

    wait_until(idle, "the cancelled request's slot freed")
    gauges = ("ray_serving_num_requests_running", "ray_serving_num_requests_waiting", "ray_serving_kv_cache_usage_ratio")
    wait_until(lambda: all(scrape(metrics_url, g, model="faulty-en-de") == 0 for g in gauges), "gauges back to 0")


def test_a_wedged_engine_loop_fails_health_checks_and_is_replaced(faults_url: str) -> None:
    (old,) = replica_stats(FAULT_CONFIG.translator.name, 3)
    handle(FAULT_CONFIG.translator.name).inject_fault.remote("stall", 1, None).result()  # the next step never returns
    stuck = httpx.post(f"{faults_url}/v1/translate", json={"text": "A dog runs.", "beam_size": 1}, timeout=120)
    # Its replica was replaced under it: the ingress sent it again (200), or had no replica left
    # to send it to within its tries (503); never a 500.
    assert stuck.status_code in (200, 503), stuck.text
    assert stuck.status_code == 503 or stuck.json()["translations"][0]["text"].startswith("Ein Hund")

    def replaced() -> bool:
        try:
            return list(replica_stats(FAULT_CONFIG.translator.name, 3)) not in ([old], [])
        except Exception:
            return False

    wait_until(replaced, "a new translator replica")
    wait_until(lambda: httpx.get(f"{faults_url}/readyz", timeout=10).status_code == 200, "ready again")
    ok = httpx.post(f"{faults_url}/v1/translate", json={"text": "A cat sleeps.", "beam_size": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["translations"][0]["text"]


def read_stream(url: str, index: int) -> tuple[str, str, dict[str, Any] | None]:
    """(the last data line, the text, the error event if any) of one sampled, streamed completion;
    "" when the connection was cut without [DONE]."""
    body = {"prompt": "ROMEO:\n", "max_tokens": 200, "temperature": 0.8, "seed": index, "stream": True}
    text, last, error = "", "", None
    try:
        with httpx.Client(timeout=120) as http, connect_sse(http, "POST", f"{url}/v1/completions", json=body) as source:
            assert source.response.status_code == 200, source.response.read()
            for event in source.iter_sse():
                last = event.data
                if event.data != "[DONE]":
                    error = event.json().get("error", error)
                    text += "".join(c["text"] for c in event.json().get("choices", []))
    except httpx.HTTPError:
        last = ""  # cut without [DONE]: what this test rules out
    return last, text, error


def complete(url: str, index: int) -> httpx.Response:
    body = {"prompt": "KING:\n", "max_tokens": 100, "temperature": 0.8, "seed": index}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_replica_killed_under_load_loses_no_request_and_is_replaced(faults_url: str, metrics_url: str) -> None:
    """SIGKILL one of two generator replicas under streamed and plain completions. Requests it
    had not begun to answer are sent to the other replica (the same seed, so the same text); a
    stream it had begun ends with one retryable error event and [DONE]; no 500, no bare cut."""
    stats = replica_stats(FAULT_CONFIG.generator.name)
    assert len(stats) == 2
    victim_id, victim = next(iter(stats.items()))
    retries_before = scrape(metrics_url, "ray_serving_request_retries_total", model="faulty-shakespeare")

    # Eight streaming and eight plain clients send request after request until the kill, so the
    # victim has work in flight whenever the router sends it some; each finishes the request it
    # has open when the kill comes, then stops.
    killed = threading.Event()
    streams: list[tuple[str, str, dict[str, Any] | None]] = []
    plain: list[httpx.Response] = []

    def keep_sending(send: Callable[[str, int], Any], answers: list[Any], client: int) -> None:
        for seed in itertools.count(client * 1000):
            answers.append(send(faults_url, seed))
            if killed.is_set():
                return

    with ThreadPoolExecutor(max_workers=16) as pool:
        clients = [pool.submit(keep_sending, read_stream, streams, i) for i in range(8)]
        clients += [pool.submit(keep_sending, complete, plain, i) for i in range(8)]
        try:
            wait_until(
                lambda: replica_stats(FAULT_CONFIG.generator.name, 10).get(victim_id, {}).get("running", 0) > 0,
                "the victim busy",
            )
            os.kill(victim["pid"], signal.SIGKILL)
        finally:
            killed.set()
        for client in clients:
            client.result()
    assert all(last == "[DONE]" for last, _, _ in streams), [last for last, _, _ in streams]  # never a bare cut
    errors = [error for _, _, error in streams if error is not None]
    assert all(e["type"] == "server_error" and e["code"] == 503 for e in errors), errors
    assert all(r.status_code in (200, 503) for r in plain), [(r.status_code, r.text) for r in plain]
    assert all("retry-after" in r.headers for r in plain if r.status_code == 503)
    assert all(r.json()["choices"][0]["text"] for r in plain if r.status_code == 200)
    wait_until(
        lambda: scrape(metrics_url, "ray_serving_request_retries_total", model="faulty-shakespeare") > retries_before,
        "the lost requests counted",
    )

    def replaced() -> bool:
        current = replica_stats(FAULT_CONFIG.generator.name)
        return len(current) == 2 and victim_id not in current

    wait_until(replaced, "a replacement generator replica")
    new_ids = set(replica_stats(FAULT_CONFIG.generator.name)) - set(stats)
    assert new_ids
    served = [httpx.post(f"{faults_url}/v1/completions", json={"prompt": "KING:", "max_tokens": 4}, timeout=60) for _ in range(10)]
    assert all(r.status_code == 200 for r in served)
    assert any(
        s["finished"] for s in replica_stats(FAULT_CONFIG.generator.name).values() if s["replica"] in new_ids
    )  # the replacement served
