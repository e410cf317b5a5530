"""The OpenAPI schema documents every route's answers: a schema for its success and for every error
status the route, its model and the middleware can send, in the error body of its path. Answers of
the HTTP layer (create_api over a fake model) are checked against it with schemathesis; the real
service is fuzzed in tests/service/test_schema_fuzz.py."""

from collections.abc import AsyncGenerator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, status_code_conformance

from service.api.app import HEALTH_PATHS, ROUTERS, create_api
from service.api.auth import BODY_KEY_PATHS, is_public
from service.api.backend import MODEL_EXTENSION, model_of_path
from service.api.errors import uses_openai_errors
from service.config import ServiceConfig
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest, Refusal, TokenizeRequest, TokenizerInfo, Tokens
from tests.helpers import backends_for

BROKEN = "break"  # a text whose request fails in the engine after it started


class FakeModel:
    """Every request: its text in two pieces, with beam search's alternatives; a small attention map."""

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        yield Chunk("", None, (), 3, 0)
        if BROKEN in (request.text, *(m.content for m in request.messages or ())):
            yield Chunk("", "error")
            return
        yield Chunk("Ein", None, (), 3, 1)
        yield Chunk(" Hund.", "stop", ("Der Hund.",) * (request.n_best - 1), 3, 2)

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        return AttentionMap(("A", "</s>"), ("Ein", "</s>"), [[[[1.0, 0.0], [0.5, 0.5]]]])

    async def tokenize(self, request: TokenizeRequest) -> Tokens | Refusal:
        if request.messages is not None:
            return Refusal("invalid", "the model has no chat template", "messages")
        return Tokens((5, 6), ("A", " dog"), 256)

    async def detokenize(self, ids: tuple[int, ...]) -> str | Refusal:
        return "A dog"

    async def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo("Tokenizer", "</s>", None, None, 256, None)

    async def ready(self) -> bool:
        return True


BACKENDS = backends_for(ServiceConfig(), FakeModel())
API = create_api(ServiceConfig(), BACKENDS)
OPERATIONS = [
    (method.upper(), path, operation) for path, methods in API.openapi()["paths"].items() for method, operation in methods.items()
]
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", API)
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def expected_errors(method: str, path: str, operation: dict[str, Any]) -> set[int]:
    """The error statuses a route can answer, from the middleware's rules (service/api/app.py, auth.py)."""
    statuses = set() if path in HEALTH_PATHS else {503}  # admission: the ingress is full
    if MODEL_EXTENSION in operation:
        statuses.add(429)  # admission: the route's model is full
    if not is_public(path):
        statuses |= {400, 403} if path in BODY_KEY_PATHS else {401}  # API keys
    if method == "POST":
        statuses |= {400, 413}  # validation, body size
    return statuses


def test_the_schema_names_no_status_the_service_never_sends() -> None:
    assert all("422" not in operation["responses"] for _, _, operation in OPERATIONS)  # validation is 400
    assert "HTTPValidationError" not in API.openapi()["components"]["schemas"]


@pytest.mark.parametrize(("method", "path", "operation"), OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_every_status_of_every_route_has_a_response_schema(method: str, path: str, operation: dict[str, Any]) -> None:
    responses = operation["responses"]
    assert responses["200"]["content"] and all(media.get("schema") for media in responses["200"]["content"].values())
    errors = {int(status) for status in responses if status != "200"}
    assert errors >= expected_errors(method, path, operation)
    error_body = "Readiness" if path == "/readyz" else "OpenAIError" if uses_openai_errors(path) else "LibreTranslateError"
    for status in errors:
        schema = responses[str(status)]["content"]["application/json"]["schema"]
        assert error_body in (schema.get("$ref", "").rpartition("/")[2], schema.get("title")), status


def test_streaming_routes_document_their_events_and_their_json() -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/translate"):
        content = API.openapi()["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path


# At least one answer of every route, in each of its shapes: streams (with usage, with an error
# event), alternatives, attention, detected languages, lists.
ANSWERS: list[tuple[str, str, Any, int]] = [
    ("GET", "/", None, 200),
    ("GET", "/healthz", None, 200),
    ("GET", "/health", None, 200),
    ("GET", "/readyz", None, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/languages", None, 200),
    ("GET", "/frontend/settings", None, 200),
    ("POST", "/v1/completions", {"prompt": "ROMEO:"}, 200),
    (
        "POST",
        "/v1/completions",
        {"prompt": "ROMEO:", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        200,
    ),
    ("POST", "/v1/completions", {"prompt": BROKEN, "stream": True}, 200),
    ("POST", "/v1/completions", {"prompt": "ROMEO:", "model": "no-such-model"}, 404),
    ("POST", "/v1/completions", {"prompt": "ROMEO:", "n": 2, "seed": 1}, 200),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, 200),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True}, 200),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": BROKEN}], "stream": True}, 200),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{}]}, 400),
    ("POST", "/v1/responses", {"input": "Hi", "instructions": "Be brief."}, 200),
    ("POST", "/v1/responses", {"input": [{"role": "user", "content": "Hi"}], "stream": True}, 200),
    ("POST", "/v1/responses", {"input": BROKEN, "stream": True}, 200),
    ("POST", "/v1/responses", {"input": "Hi", "background": True}, 400),
    ("POST", "/v1/responses", {"input": "Hi", "previous_response_id": "resp_none"}, 404),
    ("GET", "/v1/responses/{response_id}", {"response_id": "resp_none"}, 404),
    ("DELETE", "/v1/responses/{response_id}", {"response_id": "resp_none"}, 404),
    ("POST", "/tokenize", {"prompt": "A dog", "return_token_strs": True}, 200),
    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, 400),
    ("POST", "/detokenize", {"tokens": [5, 6]}, 200),
    ("GET", "/tokenizer_info", None, 200),
    ("POST", "/v1/translate", {"text": ["A dog. A cat.", "Hi."], "alternatives": 1, "return_attention": True}, 200),
    ("POST", "/v1/translate", {"text": "<p>A dog.</p>", "format": "html"}, 200),
    ("POST", "/v1/translate", {"text": "A dog. A cat.", "stream": True}, 200),
    ("POST", "/v1/translate", {"text": BROKEN, "stream": True}, 200),
    ("POST", "/v1/attention", {"text": "ROMEO:"}, 200),
    ("POST", "/translate", {"q": "A dog.", "source": "en", "target": "de"}, 200),
    ("POST", "/translate", {"q": ["A dog runs in the park.", "A cat sleeps."], "source": "auto", "alternatives": 1}, 200),
    ("POST", "/translate", {"q": "A dog.", "source": "fr"}, 400),
    ("POST", "/detect", {"q": "A dog runs in the park."}, 200),
    ("POST", "/detect", {"q": " "}, 400),
]


def test_every_route_has_an_answer_checked() -> None:
    assert {(method, path) for method, path, _, _ in ANSWERS} == {(method, path) for method, path, _ in OPERATIONS}


@pytest.mark.parametrize(("method", "path", "body", "status"), ANSWERS)
def test_answers_conform_to_the_schema(method: str, path: str, body: Any, status: int) -> None:
    operation = SCHEMA[path][method]
    if "{" in path:  # a path's parameters in place of a body
        case = operation.Case(path_parameters=body)
    else:
        case = operation.Case() if body is None else operation.Case(body=body, media_type="application/json")
    response = case.call()
    assert response.status_code == status, response.text
    case.validate_response(response, checks=CHECKS)


def test_refusals_of_api_keys_conform_to_the_schema() -> None:
    keyed = schemathesis.openapi.from_asgi("/openapi.json", create_api(ServiceConfig(api_keys=["a-key"]), BACKENDS))
    for method, path, _ in OPERATIONS:
        if is_public(path):
            continue
        operation = keyed[path][method]
        parameters = {"response_id": "resp_none"} if "{response_id}" in path else None
        case = operation.Case(body={}, media_type="application/json") if method == "POST" else operation.Case(path_parameters=parameters)
        response = case.call()
        assert response.status_code == (400 if path in BODY_KEY_PATHS else 401), path
        case.validate_response(response, checks=CHECKS)


# One test per route, named by it (SCHEMA.parametrize names every route's test alike, and the
# workers tell tests apart by name).
@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _ in OPERATIONS], ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_generated_requests_get_answers_that_conform_to_the_schema(method: str, path: str) -> None:
    @given(case=SCHEMA[path][method].as_strategy())
    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    def answered_within_the_schema(case: schemathesis.Case[Any]) -> None:
        response = case.call()
        assert response.status_code < 500, response.text
        case.validate_response(response, checks=CHECKS)

    answered_within_the_schema()


def test_every_route_that_reaches_a_model_declares_which_so_failures_count_against_it() -> None:
    """The ingress counts a refusal against the model its route declares (MODEL_EXTENSION)."""
    declared = model_of_path(ROUTERS)
    assert declared == {
        "/v1/completions": "generator",
        "/v1/chat/completions": "generator",
        "/v1/responses": "generator",
        "/v1/attention": "generator",
        "/v1/translate": "translator",
        "/translate": "translator",
    }
