"""The ingress's retry policy (service/ingress.py RayBackend) against a fake deployment handle
whose replicas die as told, through the real HTTP app: a request whose replica is lost before
any of its answer has gone out is sent again; a stream cut after it began ends with an error
event and [DONE]; past the tries, a 503 with Retry-After. Never a 500, never a bare cut."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse
from ray.exceptions import ActorDiedError

from service.api.app import create_api
from service.api.backend import ModelLoad
from service.config import ServiceConfig
from service.ingress import RayBackend, RetryPolicy
from service.protocol import Chunk, GenerateRequest
from tests.helpers import backends_for

WORDS = ["To", " be", " or", " not", " to", " be"]


class FakeResponse:
    """One replica's stream of a request: its chunks, or Ray's actor-died error after `die_after`
    chunks (None: it lives)."""

    def __init__(self, request: GenerateRequest, die_after: int | None) -> None:
        self.request, self.die_after, self.cancelled = request, die_after, False

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        n = len(WORDS)
        words = [w + f"#{self.request.sampling.seed}" for w in WORDS] if not self.request.sampling.greedy else WORDS
        chunks = [Chunk("", None, (), 3, 0)] + [Chunk(w, "length" if i == n else None, (), 3, i) for i, w in enumerate(words, 1)]
        if not self.request.stream:
            chunks = [chunks[0], Chunk("".join(words), "length", (), 3, n)]
        for i, chunk in enumerate(chunks):
            if self.die_after is not None and i >= self.die_after:
                raise ActorDiedError()
            yield chunk
            await asyncio.sleep(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A DeploymentHandle whose n-th request goes to a replica that dies after deaths[n] chunks."""

    def __init__(self, deaths: list[int | None]) -> None:
        self.deaths, self.requests = deaths, []
        self.generate = self

    def options(self, stream: bool) -> "FakeHandle":
        return self

    def remote(self, request: GenerateRequest) -> FakeResponse:
        self.requests.append(request)
        return FakeResponse(request, self.deaths[len(self.requests) - 1] if len(self.requests) <= len(self.deaths) else None)


def serve(deaths: list[int | None], body: dict[str, Any]) -> tuple[list[str] | httpx.Response, FakeHandle, list[str], list[str]]:
    """The answer to body (the stream's data lines, or the response), the handle, and the
    failures and retry outcomes counted."""
    handle, failures, outcomes = FakeHandle(deaths), [], []
    backend: Any = RayBackend(handle, ModelLoad(), 1.0, failures.append, outcomes.append, RetryPolicy(max_tries=3))  # type: ignore[arg-type]
    api = create_api(ServiceConfig(), backends_for(ServiceConfig(), backend))

    async def main() -> list[str] | httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress") as http:
            if not body.get("stream"):
                return await http.post("/v1/completions", json=body)
            async with aconnect_sse(http, "POST", "/v1/completions", json=body) as source:
                if source.response.status_code != 200:
                    await source.response.aread()
                    return source.response
                return [event.data async for event in source.aiter_sse()]

    return asyncio.run(main()), handle, failures, outcomes


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_lost_before_the_answer_began_is_retried_and_the_client_cannot_tell(stream: bool) -> None:
    body = {"prompt": "x", "max_tokens": 6, "temperature": 0.8, "stream": stream}
    # Not streamed: the replica dies after its first chunk (nothing has gone out before the end).
    # Streamed: it dies before its first chunk.
    answer, handle, failures, outcomes = serve([1 if not stream else 0, None], body)
    seed = handle.requests[0].sampling.seed
    assert seed is not None and [r.sampling.seed for r in handle.requests] == [seed, seed]  # the retry samples alike
    expected = "".join(w + f"#{seed}" for w in WORDS)
    if stream:
        assert isinstance(answer, list) and answer[-1] == "[DONE]"
        assert "".join(c["text"] for d in answer[:-1] for c in json.loads(d)["choices"]) == expected
    else:
        assert isinstance(answer, httpx.Response) and answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == expected
    assert outcomes == ["retried", "answered"] and failures == []


def test_a_stream_cut_after_it_began_ends_with_one_retryable_error_event_then_done() -> None:
    answer, handle, failures, outcomes = serve([3], {"prompt": "x", "max_tokens": 6, "temperature": 0, "stream": True})
    assert isinstance(answer, list) and answer[-1] == "[DONE]"
    events = [json.loads(d) for d in answer[:-1]]
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == "To be"  # what went out before the loss
    error = events[-1]["error"]
    assert error["type"] == "server_error" and error["code"] == 503 and "retry" in error["message"]
    assert len(handle.requests) == 1  # part of the answer had gone out: not sent again
    assert outcomes == ["cut"] and failures == ["unavailable"]


@pytest.mark.parametrize("stream", [False, True])
def test_past_the_tries_the_answer_is_a_503_with_retry_after(stream: bool) -> None:
    answer, handle, failures, outcomes = serve([0, 0, 0], {"prompt": "x", "max_tokens": 6, "temperature": 0, "stream": stream})
    assert isinstance(answer, httpx.Response)  # the stream too: nothing had gone out, so a status
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == 503
    assert len(handle.requests) == 3
    assert outcomes == ["retried", "retried", "unavailable"] and failures == ["unavailable"]
