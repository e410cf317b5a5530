"""The ingress's own refusals, before anything is parsed: past ingress_max_in_flight requests at
once, a 503 with Retry-After and the documented body (health checks still answer); a full model's
routes, a 429."""

import asyncio
import time
from collections.abc import AsyncGenerator

import httpx

from service.api.app import create_api
from service.config import ServiceConfig
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest, Refusal
from tests.helpers import backends_for


class HeldBackend:
    """Every stream waits until `release` is set, then finishes."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        self.started += 1
        await self.release.wait()
        yield Chunk("done", "stop", (), 1, 1)

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        return Refusal("invalid", "not here")

    async def ready(self) -> bool:
        return True


def test_past_the_in_flight_limit_the_ingress_refuses_at_once() -> None:
    backend = HeldBackend()
    api = create_api(ServiceConfig(ingress_max_in_flight=2), backends_for(ServiceConfig(), backend))

    async def main() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress") as http:
            held = [asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x"})) for _ in range(2)]
            while backend.started < 2:
                await asyncio.sleep(0.01)
            refused = await http.post("/v1/completions", json={"prompt": "x"})
            health = await http.get("/healthz")
            backend.release.set()
            return list(await asyncio.gather(*held)), refused, health

    held, refused, health = asyncio.run(main())
    assert [r.status_code for r in held] == [200, 200]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"] == {
        "message": "the server is busy; retry later",
        "type": "service_unavailable",
        "param": None,
        "code": 503,
    }
    assert backend.started == 2  # the refused request never reached a backend
    assert health.status_code == 200


def test_a_saturated_model_is_refused_before_its_request_is_read() -> None:
    backend = HeldBackend()
    backends = backends_for(ServiceConfig(), backend)
    api = create_api(ServiceConfig(), backends)
    backends.load[ServiceConfig().generator.name].refused_until = time.monotonic() + 60  # as RayBackend marks it on Serve's backpressure

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress") as http:
            refused = await http.post("/v1/completions", content=b"not even JSON")
            backends.load[ServiceConfig().generator.name].refused_until = time.monotonic() - 1  # its Retry-After has passed
            backend.release.set()
            admitted = await http.post("/v1/completions", json={"prompt": "x"})
            return refused, admitted

    refused, admitted = asyncio.run(main())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert admitted.status_code == 200


def test_a_saturated_translator_refuses_its_routes_only() -> None:
    backend = HeldBackend()
    backend.release.set()
    backends = backends_for(ServiceConfig(), backend)
    api = create_api(ServiceConfig(), backends)
    for translator in ServiceConfig().models_of("translator"):
        backends.load[translator.name].refused_until = time.monotonic() + 60

    async def main() -> dict[str, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress") as http:
            return {
                "/v1/translate": (await http.post("/v1/translate", json={"text": "A dog."})).status_code,
                "/translate": (await http.post("/translate", json={"q": "A dog.", "source": "en", "target": "de"})).status_code,
                "/v1/completions": (await http.post("/v1/completions", json={"prompt": "x"})).status_code,
                "/languages": (await http.get("/languages")).status_code,
            }

    assert asyncio.run(main()) == {"/v1/translate": 429, "/translate": 429, "/v1/completions": 200, "/languages": 200}


def test_a_model_with_all_it_holds_in_flight_is_refused_before_its_request_is_read() -> None:
    backend = HeldBackend()
    backend.release.set()
    backends = backends_for(ServiceConfig(), backend)
    api = create_api(ServiceConfig(), backends)
    generator = backends.load[ServiceConfig().generator.name]
    generator.max_in_flight, generator.in_flight = 2, 2  # as RayBackend counts its streams

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress") as http:
            refused = await http.post("/v1/completions", content=b"not even JSON")
            translated = await http.post("/v1/translate", json={"text": "A dog."})
            generator.in_flight = 1  # one of them finished
            admitted = await http.post("/v1/completions", json={"prompt": "x"})
            return refused, translated, admitted

    refused, translated, admitted = asyncio.run(main())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert backend.started == 2  # the translation and the admitted completion, never the refused one
    assert translated.status_code == 200 and admitted.status_code == 200
