"""API keys, CORS and the access log of the HTTP layer (create_api over fake backends; the real
service is tested in tests/service/test_security.py)."""

import hmac
import logging
import shutil
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.api import auth
from service.api.app import create_api
from service.api.auth import BODY_KEY_PATHS, is_public
from service.config import ServiceConfig
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest, Refusal
from tests.helpers import backends_for, served_in_thread

KEYS = ["right-key", "second-key"]
WRONG = "wrong-key-3f9a"
MARKER = "SECRET-TEXT-7c1e"  # stands for a user's text: never logged


class RecordingBackend:
    """Answers every request with a short translation; records what reached it (model work)."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest | AttentionRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        self.requests.append(request)
        yield Chunk("")
        yield Chunk("Ein Hund.", "stop", (), 4, 3)

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        self.requests.append(request)
        return AttentionMap(("A", "</s>"), ("A", "</s>"), [[[[1.0, 0.0], [0.5, 0.5]]]])

    async def ready(self) -> bool:
        return True


def api(config: ServiceConfig) -> tuple[TestClient, RecordingBackend, list[tuple[str, str]]]:
    backend, failures = RecordingBackend(), []
    app = create_api(config, backends_for(config, backend), lambda path, reason: failures.append((path, reason)))
    return TestClient(app), backend, failures


@pytest.fixture
def keyed() -> tuple[TestClient, RecordingBackend, list[tuple[str, str]]]:
    return api(ServiceConfig(api_keys=KEYS))


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


JSON_ROUTES = [
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4}),
    ("/v1/translate", {"text": "A dog runs."}),
    ("/v1/attention", {"text": "ROMEO:"}),
]
LIBRETRANSLATE_ROUTES = [
    ("/translate", {"q": "A dog runs.", "source": "en", "target": "de"}),
    ("/detect", {"q": "A dog runs in the park."}),
]
BODY_KINDS = ["json", "form", "multipart"]


def post(http: TestClient, path: str, fields: dict[str, Any], kind: str, headers: dict[str, str]) -> Any:
    """POST fields as a JSON, urlencoded or multipart body."""
    if kind == "json":
        return http.post(path, json=fields, headers=headers)
    if kind == "form":
        return http.post(path, data=fields, headers=headers)
    return http.post(path, files={k: (None, str(v)) for k, v in fields.items()}, headers=headers)


def assert_openai_401(response: Any, sent_key: str | None) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == 401 and error["param"] is None
    assert error["message"]
    assert sent_key is None or sent_key not in response.text


@pytest.mark.parametrize("kind", BODY_KINDS)
@pytest.mark.parametrize(("path", "fields"), JSON_ROUTES)
def test_openai_style_routes_need_a_bearer_key(keyed: Any, path: str, fields: dict[str, Any], kind: str) -> None:
    http, backend, failures = keyed
    for key in (None, WRONG):
        assert_openai_401(post(http, path, fields, kind, bearer(key)), key)
    assert backend.requests == []  # refused before any model work
    assert failures == [(path, "unauthorized")] * 2
    for key in KEYS:
        accepted = post(http, path, fields, kind, bearer(key))
        # Past the key: JSON is served; a form is these routes' own 400 (they take JSON only).
        assert accepted.status_code == (200 if kind == "json" else 400), accepted.text


def test_the_models_list_needs_a_bearer_key(keyed: Any) -> None:
    http, _, _ = keyed
    assert_openai_401(http.get("/v1/models"), None)
    assert_openai_401(http.get("/v1/models", headers=bearer(WRONG)), WRONG)
    assert_openai_401(http.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"}), None)
    assert http.get("/v1/models", headers=bearer(KEYS[1])).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": f"bearer  {KEYS[0]} "}).status_code == 200  # the scheme is case-insensitive


@pytest.mark.parametrize("kind", BODY_KINDS)
@pytest.mark.parametrize(("path", "fields"), LIBRETRANSLATE_ROUTES)
def test_libretranslate_routes_take_the_body_api_key_or_a_bearer_key(keyed: Any, path: str, fields: dict[str, Any], kind: str) -> None:
    http, backend, failures = keyed
    missing = post(http, path, fields, kind, {})
    assert missing.status_code == 400 and missing.json() == {"error": "Invalid request: missing api_key parameter"}
    assert post(http, path, fields | {"api_key": ""}, kind, {}).status_code == 400  # empty is missing, as LibreTranslate reads it
    wrong = post(http, path, fields | {"api_key": WRONG}, kind, {})
    assert wrong.status_code == 403 and wrong.json() == {"error": "Invalid API key"}
    assert WRONG not in wrong.text
    assert post(http, path, fields, kind, bearer(WRONG)).status_code == 403
    assert backend.requests == []
    assert failures == [(path, "unauthorized")] * 4
    for key in KEYS:
        in_body = post(http, path, fields | {"api_key": key}, kind, {})
        assert in_body.status_code == 200, in_body.text
        in_header = post(http, path, fields, kind, bearer(key))
        assert in_header.status_code == 200, in_header.text
    if path == "/translate":
        assert len(backend.requests) == 4 and all(r.text == "A dog runs." for r in backend.requests)  # type: ignore[union-attr]


def test_the_key_is_checked_before_the_body_is_read_or_validated(keyed: Any) -> None:
    http, backend, _ = keyed
    broken = {"content-type": "application/json"}
    assert_openai_401(http.post("/v1/completions", content=b'{"prompt": 5, "surprise": ', headers=broken), None)
    missing = http.post("/translate", content=b'{"q": ', headers=broken)
    assert missing.status_code == 400 and missing.json() == {"error": "Invalid request: missing api_key parameter"}
    wrong = http.post("/translate", json={"q": 5, "api_key": WRONG})
    assert wrong.status_code == 403  # not the 400 that would name q
    assert backend.requests == []
    with_key = http.post("/translate", content=b'{"q": ', headers={**broken, **bearer(KEYS[0])})
    assert with_key.status_code == 400 and "api_key" not in with_key.text  # now the body's own error


def test_every_route_but_the_public_ones_needs_a_key(keyed: Any) -> None:
    http, _, _ = keyed
    paths = http.get("/openapi.json").json()["paths"]  # every route the app serves, but the page at /
    protected = [(method.upper(), path) for path, methods in paths.items() for method in methods if not is_public(path)]
    assert {p for _, p in protected} >= {"/v1/completions", "/v1/models", "/v1/translate", "/v1/attention", "/translate", "/detect"}
    for method, path in protected:
        response = http.request(method, path)
        assert response.status_code == (400 if path in BODY_KEY_PATHS else 401), (method, path)
    assert http.get("/no-such-route").status_code == 401  # unknown routes too: nothing to enumerate without a key


def test_health_discovery_playground_and_docs_need_no_key(keyed: Any) -> None:
    http, _, _ = keyed
    for path in ("/healthz", "/health", "/readyz", "/languages", "/", "/static/playground.js", "/openapi.json", "/docs"):
        assert http.get(path).status_code == 200, path
    settings = http.get("/frontend/settings").json()
    assert settings["keyRequired"] is True and settings["apiKeys"] is True


def test_without_keys_nothing_needs_one() -> None:
    http, _, failures = api(ServiceConfig())
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert http.post("/translate", data={"q": "A dog.", "source": "en", "target": "de", "api_key": "anything"}).status_code == 200
    settings = http.get("/frontend/settings").json()
    assert settings["keyRequired"] is False and settings["apiKeys"] is False
    assert failures == []


def test_a_key_is_compared_with_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    constant_time = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", compare)
    middleware = auth.ApiKeyMiddleware(lambda *_: None, ["k1", "k2", "k3"])  # type: ignore[arg-type, misc]
    assert middleware.accepts(b"k1") and len(calls) == 3  # a match on the first still compares all
    assert not middleware.accepts(b"k") and len(calls) == 6
    assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: equal lengths, whatever was sent
    assert not middleware.accepts(None) and not middleware.accepts(b"") and len(calls) == 6


def test_keys_stay_out_of_reprs_dumps_and_errors() -> None:
    config = ServiceConfig(api_keys=KEYS)
    for shown in (repr(config), str(config), config.model_dump_json()):
        assert KEYS[0] not in shown
    with pytest.raises(ValidationError) as error:
        ServiceConfig(api_keys=["has space-in-the-key"])
    assert "space-in-the-key" not in str(error.value)


def test_keys_from_a_named_environment_variable() -> None:
    config = ServiceConfig(api_keys=["a-key"], api_keys_env="KEYS_VAR")
    resolved = config.with_environment_keys({"KEYS_VAR": " b-key, c-key ,,"})
    assert [k.get_secret_value() for k in resolved.api_keys] == ["a-key", "b-key", "c-key"]
    assert resolved.api_keys_env is None and resolved.with_environment_keys({}) == resolved
    for environ in ({}, {"KEYS_VAR": " , "}):  # named but empty: refused, not served without keys
        with pytest.raises(ValueError, match="KEYS_VAR"):
            config.with_environment_keys(environ)
    assert ServiceConfig().with_environment_keys({"KEYS_VAR": "x"}) == ServiceConfig()


ALLOWED = "https://translate.example.org"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_no_cors_without_an_allowlist() -> None:
    http, _, _ = api(ServiceConfig())
    simple = http.post("/v1/translate", json={"text": "A dog."}, headers={"Origin": ALLOWED})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers
    preflight = http.options("/v1/translate", headers={"Origin": ALLOWED, **PREFLIGHT})
    assert not any(h.startswith("access-control-") for h in preflight.headers)


def test_cors_answers_the_allowed_origins_only() -> None:
    http, _, _ = api(ServiceConfig(cors_origins=[ALLOWED], api_keys=KEYS))
    preflight = http.options("/v1/translate", headers={"Origin": ALLOWED, **PREFLIGHT})  # a preflight carries no key
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ALLOWED
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    allowed = http.post("/v1/translate", json={"text": "A dog."}, headers={"Origin": ALLOWED, **bearer(KEYS[0])})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    refused = http.post("/v1/translate", json={"text": "A dog."}, headers={"Origin": ALLOWED})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ALLOWED  # the page can read why
    other = "https://evil.example.com"
    assert "access-control-allow-origin" not in http.options("/v1/translate", headers={"Origin": other, **PREFLIGHT}).headers
    assert "access-control-allow-origin" not in http.get("/healthz", headers={"Origin": other}).headers
    with pytest.raises(ValidationError):
        ServiceConfig(cors_origins=["https://example.org/path"])


def test_the_access_log_has_ids_sizes_and_times_and_no_text_or_key(caplog: pytest.LogCaptureFixture) -> None:
    http, _, _ = api(ServiceConfig(api_keys=KEYS))
    caplog.set_level(logging.INFO, logger="service.api.access")
    body = {"q": f"A dog. {MARKER}", "source": "en", "target": "de", "api_key": KEYS[0]}
    served = http.post(f"/translate?q={MARKER}", data=body)
    refused = http.post("/v1/completions", json={"prompt": MARKER}, headers={**bearer(WRONG), "X-Request-Id": "client-7"})
    assert served.status_code == 200 and refused.status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "service.api.access"]
    assert len(lines) == 2
    assert lines[0].startswith(f"request_id={served.headers['x-request-id']} method=POST path=/translate status=200 ")
    assert f"request_bytes={len(served.request.content)} response_bytes={len(served.content)} ms=" in lines[0]
    assert lines[1].startswith("request_id=client-7 method=POST path=/v1/completions status=401 ")
    for line in lines:
        assert MARKER not in line and KEYS[0] not in line and WRONG not in line


def test_the_playground_sends_the_key_it_is_given() -> None:
    """The page at / (served without a key) calls the API with the key typed into its field."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (CI installs it)")
    backend = RecordingBackend()
    with served_in_thread(create_api(ServiceConfig(api_keys=KEYS), backends_for(ServiceConfig(), backend))) as url:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            page = browser.new_page()
            page.goto(f"{url}/")
            page.click("#translate-button")
            sync_api.expect(page.locator("#translate-status")).to_contain_text("missing API key", timeout=60_000)
            assert backend.requests == []
            page.fill("#api-key", KEYS[1])
            page.press("#api-key", "Tab")  # leaving the field loads the models with the key
            sync_api.expect(page.locator("#translate-model option")).not_to_have_count(0, timeout=60_000)
            page.click("#translate-button")
            sync_api.expect(page.locator("#translation")).to_contain_text("Ein Hund.", timeout=60_000)
            page.click("#generate-button")
            sync_api.expect(page.locator("#self-tokens .token").first).to_be_visible(timeout=60_000)
            browser.close()
        assert {type(r) for r in backend.requests} == {GenerateRequest, AttentionRequest}  # translations, completion, attention
