"""The HTTP layer holds nothing per request: 12,000 mixed requests through the ASGI app (streamed
completions, a tenth of them cut off midway, plain completions, both translation routes and
malformed bodies, eight at a time, against a fake model) leave its process's resident memory
where it was after the first 2,400. The soak (tests/service/test_soak.py) measures the same for
the real ingress, with Ray in the process."""

import asyncio
import gc
from collections.abc import AsyncGenerator

import httpx
from httpx_sse import aconnect_sse

from service.api.app import create_api
from service.config import ServiceConfig
from service.process import process_stats
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest, Refusal
from tests.helpers import backends_for


class WordsBackend:
    """Ten chunks a request: an empty first, eight words, a full stop."""

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        yield Chunk("", None, (), 3, 0)
        for i in range(8):
            await asyncio.sleep(0)
            yield Chunk(" word", None, (), 3, i + 1)
        yield Chunk(".", "stop", (), 3, 9)

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        return Refusal("invalid", "not here")

    async def ready(self) -> bool:
        return True


def resident_mb() -> float:
    return process_stats()["rss_bytes"] / 1e6


async def one_request(http: httpx.AsyncClient, i: int) -> int:
    kind = i % 5
    if kind == 0:
        async with aconnect_sse(http, "POST", "/v1/completions", json={"prompt": "x", "stream": True}) as source:
            events = 0
            async for _ in source.aiter_sse():
                events += 1
                if i % 10 == 0 and events > 2:
                    break  # the client goes away midway
            return source.response.status_code
    if kind == 1:
        return (await http.post("/v1/completions", json={"prompt": "x"})).status_code
    if kind == 2:
        return (await http.post("/v1/translate", json={"text": "A dog runs. A cat sits."})).status_code
    if kind == 3:
        return (await http.post("/translate", json={"q": "A dog.", "source": "en", "target": "de"})).status_code
    return (await http.post("/v1/completions", content=b"{not json")).status_code


def test_resident_memory_is_flat_over_12000_requests() -> None:
    backend = WordsBackend()
    api = create_api(ServiceConfig(), backends_for(ServiceConfig(), backend))

    async def main() -> tuple[list[float], set[int]]:
        samples, statuses = [], set()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress") as http:
            for round_ in range(5):
                for batch in range(300):
                    first = (round_ * 300 + batch) * 8
                    statuses |= set(await asyncio.gather(*(one_request(http, first + k) for k in range(8))))
                gc.collect()
                samples.append(resident_mb())
        return samples, statuses

    samples, statuses = asyncio.run(main())
    print(f"resident MB after each 2,400 requests: {[round(s, 1) for s in samples]}")
    assert statuses == {200, 400}  # the malformed bodies are refused, everything else served
    assert samples[-1] - samples[0] < 1.0  # no per-request growth (1 KB a request would be 9.6 MB)
