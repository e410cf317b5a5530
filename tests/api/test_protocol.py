"""The typed path from a replica's stream to HTTP: every refusal kind becomes its documented
status (with Retry-After where the client should come back), chunks become the response."""

from collections.abc import AsyncGenerator

import pytest
from fastapi.testclient import TestClient

from decoding.sampling_params import GREEDY
from service.api.app import create_api
from service.api.backend import STATUS_OF_REFUSAL
from service.config import ServiceConfig
from service.protocol import Chunk, GenerateRequest, Refusal, RefusalKind
from tests.helpers import backends_for

DOCUMENTED = {"invalid": 400, "overloaded": 429, "unavailable": 503}  # README, "HTTP API"


class ScriptedBackend:
    """Yields the given items for every request, and records the requests."""

    def __init__(self, items: list[Chunk | Refusal]) -> None:
        self.items = items
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        self.requests.append(request)
        for item in self.items:
            yield item

    async def ready(self) -> bool:
        return True


def client(items: list[Chunk | Refusal]) -> tuple[TestClient, ScriptedBackend]:
    backend = ScriptedBackend(items)
    return TestClient(create_api(ServiceConfig(), backends_for(ServiceConfig(), backend))), backend


def test_every_refusal_kind_has_a_documented_status() -> None:
    assert STATUS_OF_REFUSAL == DOCUMENTED


@pytest.mark.parametrize("kind", list(DOCUMENTED))
def test_a_refusal_becomes_its_status_on_every_route(kind: RefusalKind) -> None:
    http, _ = client([Refusal(kind, "no", "prompt" if kind == "invalid" else None)])
    for path, body in [
        ("/v1/completions", {"prompt": "ROMEO:"}),
        ("/v1/translate", {"text": "A dog runs."}),
        ("/translate", {"q": "A dog runs.", "source": "en", "target": "de"}),
    ]:
        response = http.post(path, json=body)
        assert response.status_code == DOCUMENTED[kind], (path, response.text)
        assert ("retry-after" in response.headers) == (kind != "invalid")
        error = response.json()["error"]
        assert (error["message"] if path.startswith("/v1/") else error) == "no"


def test_chunks_become_the_response_and_requests_are_typed() -> None:
    http, backend = client([Chunk(""), Chunk("Ein Hund", "stop", ("Ein Hund läuft",), 5, 3)])
    answer = http.post("/v1/translate", json={"text": "A dog.", "alternatives": 1}).json()
    assert answer["translations"][0]["text"] == "Ein Hund"
    assert answer["translations"][0]["alternatives"] == ["Ein Hund läuft"]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert backend.requests == [GenerateRequest(text="A dog.", sampling=GREEDY, beam_size=4, n_best=2)]
    completion = http.post("/v1/completions", json={"prompt": "ROMEO:", "stop": "\n"}).json()
    assert completion["choices"][0]["text"] == "Ein Hund"
    assert backend.requests[-1] == GenerateRequest(text="ROMEO:", stop=("\n",))  # max_tokens left to the engine


def test_an_engine_failure_is_a_500() -> None:
    http, _ = client([Chunk(""), Chunk("", "error")])
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 500
