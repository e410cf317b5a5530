"""Security against the real service: API keys through Ray Serve's proxy (a second, keyed
application beside the session's, its keys read from the environment by app_builder), what the
logs hold, and what `python -m service` binds."""

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service import __main__ as entry
from service.config import LOCAL_RAY_ENVIRONMENT

KEYED_APP, KEYED_PREFIX, KEYS_ENV = "keyed", "/keyed", "KEYED_TEST_API_KEYS"
KEYS = [f"key-{uuid.uuid4().hex}", f"key-{uuid.uuid4().hex}"]
WRONG = f"wrong-{uuid.uuid4().hex}"
MARKER = f"MARKER{uuid.uuid4().hex}"  # stands for a user's text
# A Serve config's args: small replicas beside the session's (its Ray has 2 CPUs, 1.5 in use), with
# their own model names so that their metrics stay apart.
KEYED_ARGS: dict[str, Any] = {
    "models": [
        {
            "name": "keyed-en-de",
            "checkpoint": str(DEFAULT_TRANSLATOR),
            "engine": {"n_slots": 4, "max_waiting": 8},
            "deployment": {"ray_actor_options": {"num_cpus": 0.05}},
            "torch_threads": 1,
        },
        {
            "name": "keyed-shakespeare",
            "checkpoint": str(DEFAULT_GENERATOR),
            "engine": {"n_slots": 4, "max_waiting": 8, "default_max_tokens": 4},
            "deployment": {"ray_actor_options": {"num_cpus": 0.05}},
            "torch_threads": 1,
        },
    ],
    "api_keys_env": KEYS_ENV,
}


@pytest.fixture(scope="module")
def keyed_url(service_url: str) -> Iterator[str]:
    """The keyed application at /keyed, deleted after the module."""
    from ray import serve

    from service.app import app_builder

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEYS_ENV, ",".join(KEYS))
        app = app_builder(KEYED_ARGS)
    serve.run(app, name=KEYED_APP, route_prefix=KEYED_PREFIX)
    url = service_url + KEYED_PREFIX
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the keyed application is not ready"
        time.sleep(0.5)
    yield url
    serve.delete(KEYED_APP)


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def post(url: str, fields: dict[str, Any], kind: str, headers: dict[str, str]) -> httpx.Response:
    """POST fields as a JSON, urlencoded or multipart body."""
    if kind == "json":
        return httpx.post(url, json=fields, headers=headers, timeout=120)
    if kind == "form":
        return httpx.post(url, data=fields, headers=headers, timeout=120)
    return httpx.post(url, files={k: (None, str(v)) for k, v in fields.items()}, headers=headers, timeout=120)


OPENAI_STYLE = [
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3}),
    ("/v1/translate", {"text": "A dog runs.", "beam_size": 1}),
    ("/v1/attention", {"text": "ROMEO:"}),
]
LIBRETRANSLATE = [
    ("/translate", {"q": "A dog runs.", "source": "en", "target": "de"}),
    ("/detect", {"q": "A dog runs in the park."}),
]


@pytest.mark.parametrize("kind", ["json", "form", "multipart"])
def test_api_keys_through_the_proxy(keyed_url: str, kind: str) -> None:
    for path, fields in OPENAI_STYLE:
        for key in (None, WRONG):
            refused = post(keyed_url + path, fields, kind, bearer(key))
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", (path, refused.text)
            assert refused.json()["error"]["type"] == "authentication_error" and WRONG not in refused.text
        for key in KEYS:
            accepted = post(keyed_url + path, fields, kind, bearer(key))
            assert accepted.status_code == (200 if kind == "json" else 400), (path, accepted.text)  # /v1 takes JSON only
    for path, fields in LIBRETRANSLATE:
        missing = post(keyed_url + path, fields, kind, {})
        assert missing.status_code == 400 and missing.json() == {"error": "Invalid request: missing api_key parameter"}
        for wrong in (post(keyed_url + path, fields | {"api_key": WRONG}, kind, {}), post(keyed_url + path, fields, kind, bearer(WRONG))):
            assert wrong.status_code == 403 and wrong.json() == {"error": "Invalid API key"}
        for key in KEYS:
            for accepted in (
                post(keyed_url + path, fields | {"api_key": key}, kind, {}),
                post(keyed_url + path, fields, kind, bearer(key)),
            ):
                assert accepted.status_code == 200, (path, accepted.text)
                if path == "/translate":
                    assert accepted.json()["translatedText"]
                else:
                    assert accepted.json()[0]["language"] == "en"


def test_models_health_and_discovery_with_keys(keyed_url: str) -> None:
    assert httpx.get(f"{keyed_url}/v1/models").status_code == 401
    assert httpx.get(f"{keyed_url}/v1/models", headers=bearer(WRONG)).status_code == 401
    models = httpx.get(f"{keyed_url}/v1/models", headers=bearer(KEYS[0])).json()
    assert {m["id"] for m in models["data"]} == {"keyed-en-de", "keyed-shakespeare"}
    for path in ("/healthz", "/health", "/readyz", "/languages", "/", "/openapi.json"):
        assert httpx.get(keyed_url + path).status_code == 200, path
    assert httpx.get(f"{keyed_url}/frontend/settings").json()["keyRequired"] is True


def test_refusals_are_counted_as_unauthorized(keyed_url: str, metrics_url: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{keyed_url}/v1/completions", json={"prompt": "x"}, headers=bearer(WRONG))

    def refused() -> float:
        families = text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text)
        samples = [s for f in families for s in f.samples if s.name == "ray_serving_request_failure_total"]
        return sum(s.value for s in samples if s.labels.get("reason") == "unauthorized" and s.labels.get("model", "").startswith("keyed-"))

    deadline = time.monotonic() + 180  # Ray's endpoint shows a replica's counts at its next report
    while refused() < 1:
        assert time.monotonic() < deadline, "no unauthorized refusal counted"
        time.sleep(1)


def log_files() -> list[Path]:
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    return [p for p in logs.rglob("*") if p.is_file()]


def test_logs_carry_request_ids_sizes_and_times_never_text_or_keys(service_url: str, keyed_url: str) -> None:
    text = f"A dog runs. {MARKER}"
    sent = [
        httpx.post(f"{service_url}/v1/completions", json={"prompt": f"ROMEO: {MARKER}", "max_tokens": 3}, timeout=60),
        httpx.post(f"{service_url}/v1/translate", json={"text": text, "beam_size": 1}, timeout=60),
        httpx.post(f"{service_url}/translate?q={MARKER}", data={"q": text, "source": "en", "target": "de"}, timeout=60),
        httpx.post(f"{service_url}/detect", files={"q": (None, text)}, timeout=60),
        httpx.post(f"{service_url}/v1/completions", json={"prompt": MARKER, "n": 9}, timeout=60),  # refused: 400
        httpx.post(f"{keyed_url}/translate", data={"q": text, "api_key": MARKER}, timeout=60),  # a wrong key: 403
        httpx.post(f"{keyed_url}/v1/translate", json={"text": text}, headers=bearer(KEYS[0]), timeout=60),
    ]
    assert [r.status_code for r in sent] == [200, 200, 200, 200, 400, 403, 200]
    # EdgeMiddleware's line for each request in the ingress replicas' log files (Serve's logger).
    expected = [
        f"request_id={r.headers['x-request-id']} method=POST path={urlsplit(str(r.request.url)).path} status={r.status_code} "
        f"request_bytes={r.request.headers['content-length']} response_bytes={len(r.content)} ms="
        for r in sent
    ]
    deadline = time.monotonic() + 180
    while True:
        logs = b"".join(p.read_bytes() for p in log_files())
        missing = [line for line in expected if line.encode() not in logs]
        if not missing:
            break
        assert time.monotonic() < deadline, f"not logged: {missing}"
        time.sleep(1)
    for secret in (MARKER, *KEYS):
        found = [str(p) for p in log_files() if secret.encode() in p.read_bytes()]
        assert found == [], f"{secret[:6]}... is in {found}"


def test_python_m_service_binds_127_0_0_1_and_runs_no_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """main()'s Ray and Serve settings, read without starting another Ray (serve.run stops it).
    What they bind is checked on the session's Ray, started the same way, below."""
    import ray
    from ray import serve

    import service.app

    args = entry.parse_args([])
    assert (args.host, args.port, args.metrics_port) == ("127.0.0.1", 8000, 8080)
    seen: dict[str, Any] = {}

    class ServingReachedError(Exception):
        pass

    def run(*_: Any, **__: Any) -> None:
        raise ServingReachedError

    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(init=kwargs, environ=dict(os.environ)))
    monkeypatch.setattr(serve, "start", lambda **kwargs: seen.update(start=kwargs))
    monkeypatch.setattr(serve, "run", run)
    monkeypatch.setattr(service.app, "build_app", lambda config: seen.update(config=config))
    monkeypatch.setenv(entry.API_KEYS_ENV, f"{KEYS[0]}, {KEYS[1]}")
    for name in LOCAL_RAY_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)  # main() sets it (the tests' conftest does too)
    with pytest.raises(ServingReachedError):
        entry.main([])
    assert seen["init"]["include_dashboard"] is False
    assert seen["init"]["_node_ip_address"] == "127.0.0.1"
    assert LOCAL_RAY_ENVIRONMENT.items() <= seen["environ"].items()  # else Ray would take the machine's address
    assert seen["start"]["http_options"]["host"] == "127.0.0.1"
    assert [k.get_secret_value() for k in seen["config"].api_keys] == KEYS  # read at startup
    assert seen["config"].cors_origins == ()

    monkeypatch.setenv(entry.API_KEYS_ENV, " ")  # set but empty: refused, not served without keys
    seen.clear()
    with pytest.raises(ValueError, match=entry.API_KEYS_ENV):
        entry.main([])
    assert "init" not in seen


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def test_the_session_listens_on_127_0_0_1(service_url: str, metrics_url: str) -> None:
    """The session's Ray, started as main() starts it: Serve's HTTP proxy, the metrics export, GCS,
    raylets, agents and workers listen on the loopback address. The one exception is Ray's: each
    Serve replica's inter-deployment gRPC server, which Ray 2.60 binds to [::]:0 whatever the
    node's address (ray/serve/_private/replica.py), behind Ray's token authentication."""
    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    ours = {p.pid: (p.cmdline() or [""])[0] for p in psutil.Process().children(recursive=True)}
    listening = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    ports = {urlsplit(service_url).port, urlsplit(metrics_url).port}
    assert {c.laddr.port: c.laddr.ip for c in listening if c.laddr.port in ports} == dict.fromkeys(ports, "127.0.0.1")
    elsewhere = [(ours[c.pid], c.pid) for c in listening if c.laddr.ip not in LOOPBACK]
    assert all(name.startswith("ray::ServeReplica") for name, _ in elsewhere), elsewhere
    assert len(elsewhere) == len(set(elsewhere))  # one such server a replica
