"""A two-node Ray cluster on this machine, as `ray start` makes one, with Ray's token
authentication on; for the scaling scenario (loadtests/scaling.py) and tests/cluster/.

Both nodes run in their own sessions (`ray start --block` under setsid), so `stop()` ends exactly
the processes this cluster started, found by session id; never `ray stop`, which ends every Ray
process on the machine. Every port is picked free, the dashboard and the Serve proxy bind
127.0.0.1, and the token lives in the cluster's own directory (not ~/.ray). Ray's own internal
ports (GCS, raylets, agents) listen on the node's address, as they do for any Ray cluster; the
token guards them.
"""

import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from service.config import RAY_ENVIRONMENT
from service.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP_NAME = "transformers"
# The model deployments of deploy/serve_config.yaml (named as their models).
TRANSLATOR, GENERATOR = "transformer-en-de", "transformer-shakespeare"
MODEL_DEPLOYMENTS = (TRANSLATOR, GENERATOR)
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class Replica:
    """One replica as Serve's REST API reports it."""

    replica_id: str
    deployment: str
    state: str  # STARTING, RUNNING, STOPPING, ...
    node_id: str | None  # None until the replica is placed


@dataclass
class LocalCluster:
    """A running two-node cluster; `start_cluster` makes one, `stop` ends it."""

    directory: Path
    env: dict[str, str]  # what every Ray process and CLI call of this cluster runs with
    gcs_address: str
    dashboard_url: str
    metrics_ports: tuple[int, int]  # head, worker: Ray's Prometheus endpoints
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def token(self) -> str:
        return (self.directory / "auth_token").read_text()

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def service_discovery_file(self) -> Path:
        """Every node's metrics endpoint, kept current by the head (Prometheus file_sd format)."""
        return self.directory / "ray" / "prom_metrics_service_discovery.json"

    def cli(self, *args: str, timeout_s: float = 300.0, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Runs a Ray or Serve CLI command (e.g. "serve", "deploy", ...) in the cluster's environment;
        raises CalledProcessError (with its output) when it fails."""
        command = [str(BIN / args[0]), *args[1:]]
        done = subprocess.run(command, cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
        return done

    def deploy(self, config: Path) -> None:
        """`serve deploy` through the dashboard's REST API, as KubeRay sends serveConfigV2."""
        self.cli("serve", "deploy", str(config), "--address", self.dashboard_url)

    def get(self, path: str) -> Any:
        """A GET of the dashboard's REST API, with the token; raises on any status but 200."""
        response = httpx.get(f"{self.dashboard_url}{path}", headers=self.auth_headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def serve_log_lines(self, start: float, end: float, levels: tuple[str, ...] = ("WARNING", "ERROR")) -> list[str]:
        """Serve's log entries at these levels (controller, proxies, replicas of both nodes) logged
        between the wall-clock times start and end, oldest first, each after its file's name and
        with its traceback: the cluster's side of a failed request."""
        found: list[tuple[float, list[str]]] = []
        for log in (self.directory / "ray" / "session_latest" / "logs" / "serve").glob("*.log"):
            kept = False  # whether the entry being read is kept
            for line in log.read_text(errors="replace").splitlines():
                level, _, rest = line.partition(" ")
                try:
                    logged = datetime.strptime(rest[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # Ray logs local time
                except ValueError:  # a line of the entry above (its traceback)
                    if kept:
                        found[-1][1].append(line[:400])
                    continue
                kept = level in levels and start <= logged <= end
                if kept:
                    found.append((logged, [f"{log.stem}: {line[:400]}"]))
        return ["\n".join(lines) for _, lines in sorted(found, key=lambda entry: entry[0])]

    def alive_nodes(self) -> set[str]:
        nodes = self.get("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        return {n["node_id"] for n in nodes if n["state"] == "ALIVE"}

    def application(self) -> dict[str, Any] | None:
        """The application's details (status, deployments, replicas, deployed config), if deployed."""
        app: dict[str, Any] | None = self.get("/api/serve/applications/")["applications"].get(APP_NAME)
        return app

    def wait_for(self, settled: Callable[[list[Replica]], bool], timeout_s: float = 300.0) -> list[Replica]:
        """Polls until the application runs and its replicas pass `settled`; returns them. Raises
        TimeoutError with the last state seen after timeout_s (a bound on a broken cluster, not a
        performance limit)."""
        deadline = time.monotonic() + timeout_s
        while True:
            app = self.application()
            running = app is not None and app["status"] == "RUNNING"
            replicas = replicas_of(app) if app is not None else []
            if running and settled(replicas):
                return replicas
            if time.monotonic() > deadline:
                raise TimeoutError(f"application not settled after {timeout_s:.0f} s: {app and app['status']}, {replicas}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Ends every process of both nodes' sessions: SIGTERM, then SIGKILL for what is left after
        STOP_GRACE_S (`ray start --block` itself outlives SIGTERM)."""
        sessions = {p.pid for p in self.processes}
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            for pid in session_members(sessions):
                with suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while set(session_members(sessions)) - sessions and time.monotonic() < deadline:
                time.sleep(0.2)
        for process in self.processes:
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)


class ReplicaCheck:
    """What `wait_for` waits for: the model deployments' RUNNING replica counts (None: any), no
    replica of them starting or stopping, and none of `gone` left."""

    def __init__(self, running: Mapping[str, int] | None = None, gone: frozenset[str] = frozenset()) -> None:
        self.running = dict(running or {})
        self.gone = gone

    def __call__(self, replicas: list[Replica]) -> bool:
        models = [r for r in replicas if r.deployment in MODEL_DEPLOYMENTS]
        if any(r.state != "RUNNING" for r in models) or any(r.replica_id in self.gone for r in replicas):
            return False
        counts = {d: sum(r.deployment == d for r in models) for d in MODEL_DEPLOYMENTS}
        return all(counts[d] >= 1 for d in MODEL_DEPLOYMENTS) and all(counts[d] == n for d, n in self.running.items())


def replicas_of(app: Mapping[str, Any]) -> list[Replica]:
    return [
        Replica(r["replica_id"], name, r["state"], r.get("node_id"))
        for name, deployment in app["deployments"].items()
        for r in deployment["replicas"]
    ]


def session_members(sessions: set[int]) -> list[int]:
    """Pids of live (not zombie) processes in these sessions."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(process.pid) in sessions:
                members.append(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def cluster_env(directory: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of every process of the cluster: token authentication with the cluster's
    own token file, the Serve proxy timeouts this busy machine needs, no usage stats."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ENVIRONMENT)
    env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(directory / "auth_token"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    env.update(extra)
    return env


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (Linux prctl
    PR_SET_PDEATHSIG). `ray start --block`'s reaper then ends its node, so a cluster does not
    outlive a killed test run."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def start_node(directory: Path, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = (directory / f"{name}.log").open("wb")
    command = [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
    )


def start_cluster(
    directory: Path, *, num_cpus: int = 4, num_gpus: int = 0, extra_env: Mapping[str, str] | None = None, timeout_s: float = 180.0
) -> LocalCluster:
    """A head and a worker node on this machine, each with `num_cpus` CPUs and `num_gpus` GPUs (Ray's
    logical resources: a node may declare GPUs it lacks, to place a GPU config's replicas); the head
    also has the resource "head" (1), to keep a replica there (ServiceConfig.ingress_actor_options). Returns
    once both nodes are alive; on failure, ends what it started and raises."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "auth_token").write_text(secrets.token_hex(32))
    env = cluster_env(directory, extra_env or {})
    gcs_port, dashboard_port, head_metrics, worker_metrics = free_port(), free_port(), free_port(), free_port()
    resources = [f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}"]
    cluster = LocalCluster(
        directory=directory,
        env=env,
        gcs_address=f"127.0.0.1:{gcs_port}",
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        metrics_ports=(head_metrics, worker_metrics),
    )
    try:
        head_args = [
            "--head", f"--port={gcs_port}", "--node-ip-address=127.0.0.1", f"--temp-dir={directory / 'ray'}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={head_metrics}",
            f"--ray-client-server-port={free_port()}", '--resources={"head": 1}', *resources,
        ]  # fmt: skip
        cluster.processes.append(start_node(directory, "head", head_args, env))
        wait_until(lambda: len(cluster.alive_nodes()) == 1, timeout_s, "the head node", cluster)
        worker_args = [
            f"--address={cluster.gcs_address}", f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={worker_metrics}", *resources,
        ]  # fmt: skip
        cluster.processes.append(start_node(directory, "worker", worker_args, env))
        wait_until(lambda: len(cluster.alive_nodes()) == 2, timeout_s, "the worker node", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


class RayStartError(RuntimeError):
    """A `ray start` ended before its node came up: Ray gives a raylet 30 s to register with the
    GCS (ray/_private/node.py, not configurable), and a raylet exits when one of its agents cannot
    bind its port (one free_port gave, taken before the agent bound it)."""


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if any(p.poll() is not None for p in cluster.processes):
            raise RayStartError(f"`ray start` exited while waiting for {what}: {logs_tail(cluster.directory)}")
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass  # the dashboard is not up yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up in {timeout_s:.0f} s: {logs_tail(cluster.directory)}")
        time.sleep(0.5)


def logs_tail(directory: Path, chars: int = 2000) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}" for log in sorted(directory.glob("*.log")))


START_ATTEMPTS = 3


@contextmanager
def local_cluster(directory: Path, **options: Any) -> Iterator[LocalCluster]:
    """`start_cluster`, stopped on exit whatever happens; started anew (up to START_ATTEMPTS in all)
    when a `ray start` ended before its node came up."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            cluster = start_cluster(directory, **options)
            break
        except RayStartError:
            if attempt == START_ATTEMPTS:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()


def write_config(config: Mapping[str, Any], path: Path) -> Path:
    """A Serve config file (JSON is YAML) for `serve deploy` / `serve run`."""
    path.write_text(json.dumps(config, indent=2))
    return path
