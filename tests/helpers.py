"""What several test modules share: the Serve test session's config and probes, the deploy
configs, and one way to read the service's event streams (httpx-sse). Fixtures live in the
conftest.py files; the engine's fakes in tests/engine/helpers.py (which imports no Ray, FastAPI
or pydantic)."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml
from httpx_sse import aconnect_sse, connect_sse
from prometheus_client.parser import text_string_to_metric_families

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.api.backend import Backends, ModelBackend
from service.config import ModelServingConfig, ServiceConfig
from service.engine.config import EngineConfig
from service.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def backends_for(config: ServiceConfig, backend: ModelBackend) -> Backends:
    """Every model of config answered by one backend (a fake, for tests of the HTTP layer)."""
    return Backends({m.name: backend for m in config.models})


# --- The configs in deploy/ ---


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rayservice() -> dict[str, Any]:
    manifest: dict[str, Any] = load(DEPLOY / "kuberay" / "rayservice.yaml")
    return manifest


def serve_configs() -> dict[str, dict[str, Any]]:
    return {
        "serve_config.yaml": load(DEPLOY / "serve_config.yaml"),
        "serve_config.gpu.yaml": load(DEPLOY / "serve_config.gpu.yaml"),
        "rayservice.yaml": yaml.safe_load(rayservice()["spec"]["serveConfigV2"]),
    }


# --- The Serve application of the test session (tests/service/conftest.py) ---

APP_NAME = "transformers"
TEST_CONFIG = ServiceConfig(
    models=(
        ModelServingConfig(
            name="transformer-en-de",
            checkpoint=DEFAULT_TRANSLATOR,
            engine=EngineConfig(n_slots=16, max_waiting=16),
            deployment={"ray_actor_options": {"num_cpus": 0.5}},
            torch_threads=1,
            fault_injection=True,  # see the generator's
            heartbeat_timeout_s=600,  # see the generator's
        ),
        ModelServingConfig(
            name="transformer-shakespeare",
            checkpoint=DEFAULT_GENERATOR,
            # Requests not yet taken in by the engine count as waiting: 32 streams at once may all
            # reach one replica before its next step. (The 429 tests flood the translator.)
            engine=EngineConfig(n_slots=16, max_waiting=32, default_max_tokens=16),
            deployment={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
            torch_threads=1,
            # Unarmed, its runner only passes the steps on. The overload tests hold the engines'
            # steps (hold_next_step) while a burst arrives: what is refused does not depend on how
            # fast the engines drain their queues.
            fault_injection=True,
            # A held step sends no heartbeat: the health check must not replace a replica whose
            # step a test holds while a loaded machine brings its requests in. (tests/service/
            # test_faults.py checks a wedged step's replacement, with a 3 s timeout of its own.)
            heartbeat_timeout_s=600,
        ),
    ),
)


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 120.0, interval_s: float = 0.3) -> None:
    """Polls condition every interval_s until it holds; the timeout bounds a broken service, it is
    not a speed limit."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(interval_s)


def hold_next_step(model: ModelServingConfig, release_file: Path, open_counts: Path | None = None) -> None:
    """Arms every replica of the session's `model` so that its engine's next step waits until
    release_file exists (fault injection, tests only); given open_counts (a folder), each replica
    writes its number of open requests there (see open_requests). Create release_file in a `finally`."""
    from ray import serve

    handle = serve.get_deployment_handle(model.name, app_name=APP_NAME)
    replicas = model.deployment.get("num_replicas", 1)
    if open_counts is not None:
        open_counts.mkdir(parents=True, exist_ok=True)
    armed: set[str] = set()
    for _ in range(100):  # the router picks a replica per call
        counts = None if open_counts is None else str(open_counts)
        armed.add(handle.inject_fault.remote("stall", 1, None, str(release_file), counts).result())
        if len(armed) == replicas:
            return
    raise AssertionError(f"armed {len(armed)} of {replicas} replicas of {model.name} in 100 calls")


def open_requests(open_counts: Path) -> int:
    """The requests open on the replicas armed with this open_counts folder (hold_next_step),
    summed over the replicas' files: read from the files, since Serve's router sends a handle's
    calls to the replica with the fewest requests, so stats calls may never reach the others."""
    return sum(int(path.read_text()) for path in open_counts.iterdir() if not path.name.endswith(".tmp"))


@contextmanager
def held_until_open(model: ModelServingConfig, release_file: Path, count: int) -> Iterator[None]:
    """Holds the next step of every replica of the session's `model` (hold_next_step) while the
    block runs, and releases them once its replicas have `count` requests open between them
    (open_requests): requests the block sends are all in the engines before a step after the first
    runs, so they are batched whatever the machine's speed. Raises after the block if the count
    was not reached (within a bound on a broken service)."""
    open_counts = release_file.with_name(release_file.name + ".open")
    hold_next_step(model, release_file, open_counts)
    failures: list[BaseException] = []

    def release() -> None:
        try:
            wait_until(lambda: open_requests(open_counts) >= count, f"{count} requests open", interval_s=0.01)
        except BaseException as error:  # re-raised by the test's thread
            failures.append(error)
        finally:
            release_file.touch()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        yield
    finally:
        release_file.touch()
        releaser.join()
    if failures:
        raise failures[0]


def translations_while_held(service_url: str, body: dict[str, Any], count: int, release_file: Path) -> list[httpx.Response]:
    """`count` POST /v1/translate with this body at once while the translator's next step is held
    (hold_next_step): the ingress passes on max_requests_held of them and refuses the rest. The
    step is released once both hold: every refusal is back (so every request has reached the
    ingress) and the replica has all it was passed open (so its engine takes them in together
    before it steps again), whatever the machine's speed. Returns every response, in order."""
    held = TEST_CONFIG.translator.max_requests_held
    assert held is not None and count > held and TEST_CONFIG.translator.deployment.get("num_replicas", 1) == 1
    open_counts = release_file.with_name(release_file.name + ".open")
    hold_next_step(TEST_CONFIG.translator, release_file, open_counts)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=service_url, timeout=300, limits=httpx.Limits(max_connections=count)) as http:
            sent = [asyncio.ensure_future(http.post("/v1/translate", json=body)) for _ in range(count)]
            deadline = time.monotonic() + 300  # a bound on a broken service, not a speed limit
            # While the step is held nothing but the ingress answers: each answer is a refusal.
            while sum(task.done() for task in sent) < count - held or open_requests(open_counts) < held:
                assert time.monotonic() < deadline, f"{sum(t.done() for t in sent)} answered, {open_requests(open_counts)} open"
                await asyncio.sleep(0.01)
            release_file.touch()
            return await asyncio.gather(*sent)

    try:
        return asyncio.run(main())
    finally:
        release_file.touch()


def replica_stats(deployment: str, calls: int = 30, app: str = APP_NAME, replicas: int | None = None) -> dict[str, dict[str, Any]]:
    """Engine stats by replica id, from `calls` calls spread over the replicas by Serve's router;
    given `replicas`, more calls until that many have answered (bounded). The router picks by the
    queue lengths it cached (for seconds): after a burst it may send every call to one replica."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    stats: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 60  # a bound on a broken deployment, not a speed limit
    made = 0
    while made < calls or (replicas is not None and len(stats) < replicas and time.monotonic() < deadline):
        if made >= calls:
            time.sleep(0.05)  # until the router's cached queue lengths expire
        s = handle.stats.remote().result()
        stats[s["replica"]] = s
        made += 1
    return stats


def scrape(metrics_url: str, name: str, **labels: str) -> float:
    """The sum over all series (replicas) of sample `name` with these labels on Ray's endpoint."""
    text = httpx.get(metrics_url, timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


# --- Event streams (SSE) ---


def stream_data(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> list[str]:
    """POSTs `body` to `url`, asserts a 200 event stream, and returns every event's data, in order
    (the last is "[DONE]" for a stream that ended as the service ends one)."""
    with httpx.Client(timeout=timeout_s) as http, connect_sse(http, "POST", url, json=body) as source:
        assert source.response.status_code == 200, source.response.read()
        return [event.data for event in source.iter_sse()]


def leave_stream(url: str, body: dict[str, Any], after_events: int) -> None:
    """Opens a 200 event stream, reads `after_events` events, and closes the connection."""
    with httpx.Client(timeout=60) as http, connect_sse(http, "POST", url, json=body) as source:
        assert source.response.status_code == 200, source.response.read()
        events = source.iter_sse()
        for _ in range(after_events):
            next(events)


async def astream_data(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    """stream_data through an async client."""
    async with aconnect_sse(http, "POST", path, json=body) as source:
        assert source.response.status_code == 200, await source.response.aread()
        return [event.data async for event in source.aiter_sse()]


def assert_serves(url: str) -> None:
    """One translation, one completion and one stream through the app at `url`, answered in full."""
    translation = httpx.post(f"{url}/v1/translate", json={"text": "A man is riding a bike.", "beam_size": 1}, timeout=120)
    assert translation.status_code == 200 and translation.json()["translations"][0]["text"].startswith("Ein Mann"), translation.text
    body = {"model": "transformer-shakespeare", "prompt": "ROMEO:\n", "max_tokens": 8, "temperature": 0}
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 8, completion.text
    frames = stream_data(f"{url}/v1/completions", body | {"stream": True}, timeout_s=120)
    streamed = "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1])
    assert frames[-1] == "[DONE]" and streamed == completion.json()["choices"][0]["text"]


@contextmanager
def served_in_thread(app: Any) -> Iterator[str]:
    """An ASGI app served by uvicorn in this process on a free 127.0.0.1 port: its URL, until the
    block ends (for a browser that needs a real server in front of fake models)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server stopped before it started"
            time.sleep(0.05)  # a poll interval: the loop ends when the server has started (or died)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


SERVICE_START_TIMEOUT_S = 300.0  # a bound on a broken start, not a speed limit


SERVICE_START_ATTEMPTS = 3
# Decode steps eager in the services and clusters tests start, unless a test says otherwise: by
# default every model compiles 6-7 buckets in the background at each replica's start, CPU the tests
# beside it wait for (the compiled step has tests of its own: tests/engine/test_compiled_decode.py,
# test_compile_cache.py). EAGER_DECODE for a Serve config's engine.compiled_decode, EAGER for the command line.
EAGER_DECODE = "none"
EAGER = ("--compiled-decode", EAGER_DECODE)
# What Ray raises when a node's raylet never registered: it exits when an agent cannot bind its port.
RAY_NODE_FAILED = "The current node timed out during startup"


@contextmanager
def python_m_service(models: dict[str, Path], options: tuple[str, ...] = ()) -> Iterator[str]:
    """`python -m service` on these folders or files (name -> path), with further command-line
    options, as a user starts it (its own Ray, one torch thread, on the CPU), until it says it
    serves every model; yields its URL and stops it. Started anew, on other ports, when its Ray
    node did not come up (RAY_NODE_FAILED: a port free_port gave was taken before Ray bound it)."""
    for attempt in range(1, SERVICE_START_ATTEMPTS + 1):
        port = free_port()
        command = [sys.executable, "-m", "service", "--port", str(port), "--metrics-port", str(free_port()), "--device", "cpu"]
        command += ["--torch-threads", "1", *EAGER, *options]
        command += [arg for name, folder in models.items() for arg in ("--model", f"{name}={folder}")]
        environment = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
        assert process.stdout is not None
        lines, deadline, serving = [], time.monotonic() + SERVICE_START_TIMEOUT_S, False
        for line in process.stdout:  # "Serving on" once every model is ready
            lines.append(line)
            serving = line.startswith("Serving on")
            if serving:
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        if serving:
            break
        process.wait(timeout=60)  # its output ended: it exited
        if RAY_NODE_FAILED not in "".join(lines) or attempt == SERVICE_START_ATTEMPTS:
            break
    try:
        assert serving and process.poll() is None, "".join(lines[-30:])
        # Read on to the end (a pipe nobody reads would block the service once full); kept for the report below.
        threading.Thread(target=lambda: lines.extend(process.stdout or ()), name="service-output", daemon=True).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is not None:  # it ended before its tests did: why, in the tests' captured output
            print(f"python -m service exited with {process.returncode}:", "".join(lines[-60:]))
        process.terminate()
        process.wait(timeout=60)
