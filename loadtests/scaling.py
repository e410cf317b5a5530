"""Autoscaling and rollouts on a two-node Ray cluster (loadtests/cluster.py), measured from the
client side: closed-loop HTTP clients, bounded in requests, against the Serve proxy, while Serve's
REST API is polled for every replica's state and node.

    .venv/bin/python -m loadtests.scaling [--out loadtests/scaling] [--dashboard docs/dashboard.png]

runs the scaling scenario of tests/cluster/ once: deploy/serve_config.yaml (its autoscaling
targets, with the delays of CLUSTER_AUTOSCALING so it takes a minute) on a fresh cluster, then
load until the generator has scaled out and served more requests, then idle until it is back to
one replica. Writes timeline.json and timeline.png (replicas and requests in flight over time)
under --out; with --dashboard, also re-renders that PNG (deploy/grafana/render_dashboard.py)
from a Prometheus that scraped both nodes during the run.
"""

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from httpx_sse import SSEError, aconnect_sse

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
    write_config,
)
from service.ports import free_port

CPU_CONFIG = ROOT / "deploy" / "serve_config.yaml"
# The shipped Prometheus's intervals (5 s; Ray's nodes report every 10 s, so nothing is missed). A
# tighter timeout fails scrapes of a busy head node: each failed scrape leaves a gap in every series.
SHIPPED_PROMETHEUS_GLOBAL = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())["global"]
DATA = json.loads((Path(__file__).parent / "data" / "prompts.json").read_text())
# Changes to the shipped CPU config for a run on one machine: replicas scale on the shipped
# targets, but within seconds instead of minutes (Serve's handles report every 10 s regardless).
CLUSTER_AUTOSCALING = {"upscale_delay_s": 2, "downscale_delay_s": 10, "look_back_period_s": 5}
POLL_S = 0.5
REQUEST_TIMEOUT_S = 120.0
GENERATOR_REPLICAS = f'count(max by (replica) (ray_serve_deployment_replica_healthy{{deployment="{GENERATOR}"}}) == 1)'


def cluster_config(
    port: int, base: Path = CPU_CONFIG, models: Mapping[str, Mapping[str, Any]] | None = None, compiled_decode: str | None = None
) -> dict[str, Any]:
    """`base` (a Serve config file) served on 127.0.0.1:`port`, its translator and generator
    under test (MODEL_DEPLOYMENTS; the second language pair would only share the 2 cores), with
    CLUSTER_AUTOSCALING and, per model (by its name), these ModelServingConfig fields replaced;
    `compiled_decode` (e.g. "none") replaces every model's engine.compiled_decode after them."""
    config: dict[str, Any] = yaml.safe_load(base.read_text())
    config["http_options"].update({"host": "127.0.0.1", "port": port})
    args = config["applications"][0]["args"]
    args["models"] = [model for model in args["models"] if model["name"] in MODEL_DEPLOYMENTS]
    for model in args["models"]:
        if isinstance(model["deployment"].get("autoscaling_config"), dict):
            model["deployment"]["autoscaling_config"].update(CLUSTER_AUTOSCALING)
        model.update((models or {}).get(model["name"], {}))
        if compiled_decode is not None:
            model["engine"] = {**model.get("engine", {}), "compiled_decode": compiled_decode}
    return config


@dataclass(frozen=True)
class Load:
    """Closed-loop clients: each sends its next request when the last one is answered."""

    streams: int  # clients streaming /v1/completions
    completions: int  # clients of /v1/completions without streaming
    translations: int  # clients of /v1/translate (one sentence, beam 4)
    max_requests: int  # per client: the load's bound
    max_tokens: int = 32
    request_timeout_s: float = REQUEST_TIMEOUT_S  # a client's wait for its answer


@dataclass
class Result:
    kind: str  # "stream", "completion" or "translate"
    start: float  # seconds since the scenario started
    end: float
    status: int  # 0: no HTTP answer
    error: str | None  # None: a complete, well-formed answer
    body: dict[str, Any] = field(default_factory=dict)  # what was sent
    text: str = ""  # a completion's text (a stream's: its frames' text joined)
    retries: int = 0  # sent again after a connection closed before any answer (never_answered)


@dataclass
class Sample:
    t: float
    replicas: list[Replica]


@dataclass
class Timeline:
    wall_start: float = 0.0  # time.time() at t = 0
    samples: list[Sample] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    load_start: float = 0.0
    load_end: float | None = None
    action_start: float | None = None
    action_end: float | None = None
    settled: float | None = None

    def running(self, deployment: str, states: tuple[str, ...] = ("RUNNING",)) -> list[tuple[float, int]]:
        """(time, replicas of `deployment` in one of `states`) of every sample."""
        return [(s.t, sum(r.deployment == deployment and r.state in states for r in s.replicas)) for s in self.samples]

    def first(self, deployment: str, at_least: int, after: float = 0.0) -> float | None:
        """When `deployment` first had at_least RUNNING replicas, after `after`."""
        return next((t for t, n in self.running(deployment) if t >= after and n >= at_least), None)

    def first_at_most(self, deployment: str, at_most: int, after: float) -> float | None:
        return next((t for t, n in self.running(deployment) if t >= after and n <= at_most), None)

    def completed_after(self, t: float) -> int:
        return sum(r.end > t for r in self.results)

    def in_flight(self, kinds: tuple[str, ...], t: float) -> int:
        return sum(r.kind in kinds and r.start <= t < r.end for r in self.results)

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.error is not None]


@dataclass
class Scenario:
    load: Load
    stop_when: Callable[[Timeline], bool]  # checked as results and samples arrive; clients then stop
    settled: Callable[[list[Replica]], bool]  # after the load, the replicas the scenario waits for
    action: Callable[[], object] | None = None  # run in a thread once `action_after` requests are answered
    action_after: int = 0
    settle_timeout_s: float = 180.0  # a bound on a broken cluster, not a performance limit


def check_stream(frames: list[str]) -> tuple[str, str | None]:
    """The text of an OpenAI stream's data frames, and None when they are complete: text frames,
    a finish_reason, usage, then [DONE]; else what was wrong."""
    if not frames or frames[-1] != "[DONE]" or "[DONE]" in frames[:-1]:
        return "", "the stream did not end with [DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    text = "".join(c["text"] for chunk in chunks for c in chunk.get("choices", []))
    if any("error" in chunk for chunk in chunks):
        return text, f"error frame: {frames[-2][:300]}"
    if not any(c.get("finish_reason") for chunk in chunks for c in chunk.get("choices", [])):
        return text, "no finish_reason"
    if not any(chunk.get("usage") and chunk["usage"]["completion_tokens"] >= 1 for chunk in chunks):
        return text, "no usage frame"
    return text, None


def check_completion(answer: Any) -> str | None:
    choice = answer["choices"][0]
    if not isinstance(choice["text"], str) or choice["finish_reason"] not in ("length", "stop") or answer["usage"]["completion_tokens"] < 1:
        return f"malformed completion: {str(answer)[:300]}"
    return None


def check_translation(answer: Any) -> str | None:
    text = answer["translations"][0]["text"]
    return None if isinstance(text, str) and text.strip() else f"empty translation: {str(answer)[:300]}"


async def request(http: httpx.AsyncClient, kind: str, rng: random.Random, max_tokens: int) -> Result:
    """Sends one request of this kind; returns its Result (times not yet set)."""
    completion = {"model": GENERATOR, "prompt": rng.choice(DATA["prompts"]), "max_tokens": max_tokens}
    completion |= {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
    if kind == "stream":
        body = completion | {"stream": True, "stream_options": {"include_usage": True}}
        async with aconnect_sse(http, "POST", "/v1/completions", json=body) as source:
            if source.response.status_code != 200:
                return Result(kind, 0, 0, source.response.status_code, (await source.response.aread()).decode()[:300], body)
            text, error = check_stream([event.data async for event in source.aiter_sse()])
            return Result(kind, 0, 0, 200, error, body, text)
    if kind == "completion":
        response = await http.post("/v1/completions", json=completion)
        if response.status_code != 200:
            return Result(kind, 0, 0, response.status_code, response.text[:300], completion)
        return Result(kind, 0, 0, 200, check_completion(response.json()), completion, response.json()["choices"][0]["text"])
    body = {"text": rng.choice(DATA["sentences"]), "beam_size": 4}
    response = await http.post("/v1/translate", json=body)
    return Result(
        kind, 0, 0, response.status_code, check_translation(response.json()) if response.status_code == 200 else response.text[:300], body
    )


CLIENT_RETRIES = 2  # the openai client's default max_retries, which it spends on connection errors


def never_answered(failure: Exception) -> bool:
    """A connection refused, or closed before any byte of an answer: what the openai client sends
    again. Here that is a Serve proxy stopped while the kernel still queued connections for it: Serve
    drains the proxy of a node left without replicas (a rollout can leave one so), and both nodes'
    proxies listen on one port of this machine, where in production a load balancer stops sending to a
    proxy whose health check fails (Serve's draining proxies answer 503 there)."""
    closed_early = isinstance(failure, httpx.RemoteProtocolError) and "without sending a response" in str(failure)
    return isinstance(failure, httpx.ConnectError) or closed_early


async def client(
    http: httpx.AsyncClient, kind: str, seed: int, load: Load, timeline: Timeline, t0: float, stop: asyncio.Event, answered: asyncio.Event
) -> None:
    rng = random.Random(seed)
    for _ in range(load.max_requests):
        if stop.is_set():
            return
        start = time.monotonic() - t0
        state = rng.getstate()  # a retry sends the same request
        for retries in range(CLIENT_RETRIES + 1):
            rng.setstate(state)
            try:
                result = await request(http, kind, rng, load.max_tokens)
            except (httpx.HTTPError, SSEError, ValueError, KeyError, IndexError, TypeError) as failure:
                result = Result(kind, 0, 0, 0, repr(failure))
                if never_answered(failure) and retries < CLIENT_RETRIES:
                    continue
            break
        result.retries = retries
        result.start, result.end = start, time.monotonic() - t0
        timeline.results.append(result)
        answered.set()


async def poll(cluster: LocalCluster, timeline: Timeline, t0: float, done: asyncio.Event, changed: asyncio.Event) -> None:
    async with httpx.AsyncClient(headers=cluster.auth_headers, timeout=30) as http:
        while not done.is_set():
            try:
                response = await http.get(f"{cluster.dashboard_url}/api/serve/applications/")
                response.raise_for_status()
            except httpx.HTTPError:
                await asyncio.sleep(POLL_S)  # a busy dashboard: no sample this time
                continue
            app = response.json()["applications"].get("transformers")
            if app and app["deployments"]:  # none while a new config's app is being built: unknown, not zero
                timeline.samples.append(Sample(time.monotonic() - t0, replicas_of(app)))
                changed.set()
            await asyncio.sleep(POLL_S)


async def run_scenario(cluster: LocalCluster, url: str, scenario: Scenario) -> Timeline:
    """Samples replicas, runs the load until `stop_when` holds (or every client has sent
    max_requests), runs `action` meanwhile, then waits for `settled` replicas."""
    timeline, t0 = Timeline(wall_start=time.time()), time.monotonic()
    done, stop, changed = asyncio.Event(), asyncio.Event(), asyncio.Event()
    poller = asyncio.create_task(poll(cluster, timeline, t0, done, changed))
    load = scenario.load
    kinds = ["stream"] * load.streams + ["completion"] * load.completions + ["translate"] * load.translations
    action: asyncio.Task[None] | None = None
    try:
        while not timeline.samples:  # a first sample before the load
            await asyncio.sleep(0.05)
        timeline.load_start = time.monotonic() - t0
        async with httpx.AsyncClient(base_url=url, timeout=load.request_timeout_s, limits=httpx.Limits(max_connections=len(kinds))) as http:
            clients = [asyncio.create_task(client(http, k, i, load, timeline, t0, stop, changed)) for i, k in enumerate(kinds)]
            while not all(c.done() for c in clients):
                await changed.wait()
                changed.clear()
                if scenario.action is not None and action is None and len(timeline.results) >= scenario.action_after:
                    action = asyncio.create_task(timed(scenario.action, timeline, t0))
                    action.add_done_callback(lambda _: changed.set())
                if scenario.stop_when(timeline) or (action is not None and action.done() and action.exception() is not None):
                    stop.set()
            await asyncio.gather(*clients)
        timeline.load_end = time.monotonic() - t0
        if action is not None:
            await action
        deadline = time.monotonic() + scenario.settle_timeout_s
        while not (timeline.samples[-1].t > timeline.load_end and scenario.settled(timeline.samples[-1].replicas)):
            if time.monotonic() > deadline:
                break  # the caller's assertions show what did not settle
            await asyncio.sleep(POLL_S)
        else:
            timeline.settled = timeline.samples[-1].t
        await asyncio.sleep(2 * POLL_S)  # a little of the settled state in the record
    finally:
        done.set()
        await poller
    return timeline


async def timed(action: Callable[[], object], timeline: Timeline, t0: float) -> None:
    timeline.action_start = time.monotonic() - t0
    await asyncio.to_thread(action)
    timeline.action_end = time.monotonic() - t0


def autoscaling_scenario(after_scale_out: int = 200, dashboard: "Prometheus | None" = None) -> Scenario:
    """24 clients (the shipped generator target is 8 streams a replica): 16 streaming, 6
    non-streaming completions, 2 translating. The load goes on until the generator has 2 replicas
    RUNNING and `after_scale_out` more requests are answered, and, with `dashboard`, until that
    Prometheus counts both replicas healthy (Ray's endpoints show a replica up to 10 s after it
    started, and one that stopped before its first report never), then stops (at most 1,000 a
    client: a bound on a broken cluster); the scenario ends when the generator is back to one
    replica."""
    shown, asked_at = dashboard is None, 0.0

    def scaled_out_and_served(timeline: Timeline) -> bool:
        nonlocal shown, asked_at
        t = timeline.first(GENERATOR, 2)
        if t is None or timeline.completed_after(t) < after_scale_out:
            return False
        if not shown and dashboard is not None and time.monotonic() - asked_at >= 1.0:
            asked_at = time.monotonic()  # one query a second: the clients' loop waits for it
            shown = dashboard.query(GENERATOR_REPLICAS) == 2
        return shown

    return Scenario(
        load=Load(streams=16, completions=6, translations=2, max_requests=1000),
        stop_when=scaled_out_and_served,
        settled=ReplicaCheck(running={GENERATOR: 1, TRANSLATOR: 1}),
    )


def summary(timeline: Timeline) -> dict[str, Any]:
    """The numbers the README quotes: when the generator scaled out and back, the peak, requests."""
    scale_out = timeline.first(GENERATOR, 2)
    peak = max((n for _, n in timeline.running(GENERATOR)), default=0)
    back = timeline.first_at_most(GENERATOR, 1, timeline.load_end) if timeline.load_end is not None else None
    statuses: dict[str, int] = {}
    for r in timeline.results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "load_start_s": round(timeline.load_start, 1),
        "generator_2_replicas_running_s": scale_out and round(scale_out, 1),
        "generator_peak_replicas": peak,
        "load_end_s": timeline.load_end and round(timeline.load_end, 1),
        "generator_back_to_1_s": back and round(back, 1),
        "requests": len(timeline.results),
        "by_kind": {k: sum(r.kind == k for r in timeline.results) for k in ("stream", "completion", "translate")},
        "statuses": statuses,
        "failures": len(timeline.failures()),
        "sent_again": sum(r.retries for r in timeline.results),  # never_answered, as the openai client does
    }


def plot(timeline: Timeline, out: Path, title: str) -> None:
    """Replicas (RUNNING, per model deployment) and requests in flight, over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    starting = timeline.running(GENERATOR, ("STARTING", "RUNNING"))
    top.step(
        [t for t, _ in starting],
        [n for _, n in starting],
        where="post",
        label="Generator replicas starting or running",
        color="tab:blue",
        linestyle=":",
    )
    for deployment, color in ((GENERATOR, "tab:blue"), (TRANSLATOR, "tab:orange")):
        series = timeline.running(deployment)
        top.step([t for t, _ in series], [n for _, n in series], where="post", label=f"{deployment} replicas running", color=color)
    top.set_ylabel("replicas")
    top.set_ylim(0, max(max(n for _, n in timeline.running(GENERATOR)), 1) + 1)
    top.legend(loc="upper right", fontsize=8)
    times = [s.t for s in timeline.samples]
    generator = [timeline.in_flight(("stream", "completion"), t) for t in times]
    translator = [timeline.in_flight(("translate",), t) for t in times]
    bottom.plot(times, generator, label="completions in flight (clients)", color="tab:blue")
    bottom.plot(times, translator, label="translations in flight", color="tab:orange")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right", fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.axvspan(timeline.load_start, timeline.load_end or times[-1], color="grey", alpha=0.1)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def deploy_and_wait(cluster: LocalCluster, config: Mapping[str, Any], path: Path) -> None:
    cluster.deploy(write_config(config, path))
    cluster.wait_for(ReplicaCheck())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("loadtests/scaling"))
    parser.add_argument("--dashboard", type=Path, default=None, help="also re-render the Grafana panels from the run into this PNG")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rc-", dir="/tmp") as directory, local_cluster(Path(directory) / "cluster") as cluster:
        monitor = run_prometheus(cluster, Path(directory) / "prometheus") if args.dashboard else None
        try:
            port = free_port()
            deploy_and_wait(cluster, cluster_config(port), Path(directory) / "config.json")
            started = time.time()
            timeline = asyncio.run(run_scenario(cluster, f"http://127.0.0.1:{port}", autoscaling_scenario(dashboard=monitor)))
            numbers = summary(timeline)
            print(json.dumps(numbers, indent=2))
            args.out.mkdir(parents=True, exist_ok=True)
            record = {"summary": numbers, "config": cluster_config(port), "timeline": asdict(timeline)}
            (args.out / "timeline.json").write_text(json.dumps(record, indent=1))
            plot(timeline, args.out / "timeline.png", scaling_title(numbers))
            if monitor is not None:
                monitor.wait_for(GENERATOR_REPLICAS, 1.0)  # Ray's endpoints report every 10 s
                time.sleep(10)  # and some of the state after it in the picture
                minutes = (time.time() - started) / 60 + 0.5
                script = ROOT / "deploy" / "grafana" / "render_dashboard.py"
                render = [
                    sys.executable,
                    str(script),
                    "--prometheus",
                    monitor.url,
                    "--minutes",
                    f"{minutes:.1f}",
                    "--out",
                    str(args.dashboard),
                ]
                subprocess.run(render, check=True)
        finally:
            if monitor is not None:
                monitor.stop()
    print(f"wrote {args.out / 'timeline.json'} and {args.out / 'timeline.png'}")


def scaling_title(numbers: Mapping[str, Any]) -> str:
    return (
        f"Generator autoscaling on a 2-node Ray cluster (one 2-core machine): {numbers['requests']:,} requests, "
        f"{numbers['failures']} failed; target 8 ongoing requests a replica"
    )


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def query(self, expr: str) -> float | None:
        """The value of a one-element instant vector, None when it is empty."""
        result = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30).json()["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, value: float, timeout_s: float = 60.0) -> None:
        """Until `expr` evaluates to `value` (at most timeout_s: the render shows whatever it has)."""
        deadline = time.monotonic() + timeout_s
        while self.query(expr) != value and time.monotonic() < deadline:
            time.sleep(1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_prometheus(cluster: LocalCluster, directory: Path) -> Prometheus:
    """A Prometheus on 127.0.0.1 scraping every node of the cluster at the shipped intervals, found
    through the head's service-discovery file (deploy/prometheus/prometheus.yml's multi-node job)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "global": SHIPPED_PROMETHEUS_GLOBAL,
        "scrape_configs": [
            {"job_name": "ray", "file_sd_configs": [{"files": [str(cluster.service_discovery_file)], "refresh_interval": "1s"}]}
        ],
    }
    (directory / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    log = (directory / "prometheus.log").open("wb")
    command = [
        "prometheus", f"--config.file={directory / 'prometheus.yml'}", f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={directory / 'data'}",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    monitor = Prometheus(f"http://127.0.0.1:{port}", process)
    deadline = time.monotonic() + 60
    while True:
        try:
            response = httpx.get(f"{monitor.url}/api/v1/query", params={"query": 'count(up{job="ray"} == 1)'}, timeout=5)
            up = response.json()["data"]["result"] if response.status_code == 200 else []
            if up and float(up[0]["value"][1]) >= 2:
                return monitor
        except httpx.HTTPError:
            pass  # not listening yet
        if process.poll() is not None or time.monotonic() > deadline:
            monitor.stop()
            raise RuntimeError(f"Prometheus did not scrape the cluster: {(directory / 'prometheus.log').read_text()[-2000:]}")
        time.sleep(0.5)


if __name__ == "__main__":
    main()
