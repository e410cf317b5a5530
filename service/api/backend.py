"""How the HTTP layer reaches a model: a stream of protocol items (service/protocol.py) from a
model deployment, turned into HTTP statuses here and nowhere else."""

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from fastapi import APIRouter
from fastapi.routing import APIRoute

from service.api.errors import APIError
from service.protocol import (
    AttentionMap,
    AttentionRequest,
    Chunk,
    GenerateRequest,
    Refusal,
    RefusalKind,
    ReplicaLostError,
    TokenizeRequest,
    TokenizerInfo,
    Tokens,
)

T = TypeVar("T")


class ModelBackend(Protocol):
    def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        """The deployment's `generate` stream; closing it early cancels the request."""

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        """The model's attention weights on one input."""

    async def tokenize(self, request: TokenizeRequest) -> Tokens | Refusal:
        """The prompt's token ids, as the model reads it."""

    async def detokenize(self, ids: tuple[int, ...]) -> str | Refusal:
        """The text of token ids (special tokens dropped)."""

    async def tokenizer_info(self) -> TokenizerInfo:
        """The model's tokenizer, as a client's own tokenizer needs it."""

    async def ready(self) -> bool: ...


@dataclass
class ModelLoad:
    """What the ingress knows of one model's load, kept by its backend (service/ingress.py): the
    model's requests it has in flight, the most it sends at once (what the model's replicas hold;
    None: no limit of its own, as for an autoscaled deployment), and until when (time.monotonic())
    Serve's queue for the model is taken to be full: set when it refused a request, for the
    Retry-After it answered, and cleared as soon as one of the model's requests finishes."""

    max_in_flight: int | None = None
    in_flight: int = 0
    refused_until: float = 0.0

    def full(self) -> bool:
        """A new request would be refused: refuse it before reading it."""
        at_limit = self.max_in_flight is not None and self.in_flight >= self.max_in_flight
        return at_limit or time.monotonic() < self.refused_until


@dataclass
class Backends:
    """The served models' backends and loads, by model name. The admission middleware refuses a
    route at once when every model of its kind is full (service/api/app.py)."""

    models: dict[str, ModelBackend]
    load: dict[str, ModelLoad] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.models:
            self.load.setdefault(name, ModelLoad())


# A route's OpenAPI extension naming the kind of model ("translator", "generator") its requests go to.
MODEL_EXTENSION = "x-model"


def model_of_path(routers: Iterable[APIRouter]) -> dict[str, str]:
    """Path -> the model its requests reach, for every route that declares one (MODEL_EXTENSION)."""
    return {
        route.path: route.openapi_extra[MODEL_EXTENSION]
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and route.openapi_extra and MODEL_EXTENSION in route.openapi_extra
    }


STATUS_OF_REFUSAL: dict[RefusalKind, int] = {"invalid": 400, "overloaded": 429, "unavailable": 503}


def refusal_error(refusal: Refusal, retry_after: int) -> APIError:
    """The HTTP error of a refusal; 429 and 503 tell the client when to come back."""
    status = STATUS_OF_REFUSAL[refusal.kind]
    return APIError(status, refusal.message, refusal.param, retry_after if status in (429, 503) else None, counted=True)


def answered(result: T | Refusal, retry_after: int) -> T:
    """A replica's answer, or its refusal as the HTTP error."""
    if isinstance(result, Refusal):
        raise refusal_error(result, retry_after)
    return result


async def open_streams(backend: ModelBackend, requests: list[GenerateRequest], retry_after: int) -> list[AsyncGenerator[Chunk, None]]:
    """One admitted stream per request, all admitted before any result is awaited; if one is
    refused, the others are closed (cancelled) and the refusal is raised."""
    streams = await asyncio.gather(*(open_stream(backend, r, retry_after) for r in requests), return_exceptions=True)
    failure = next((s for s in streams if isinstance(s, BaseException)), None)
    if failure is not None:
        for s in streams:
            if not isinstance(s, BaseException):
                await s.aclose()
        raise failure
    return streams  # type: ignore[return-value]


async def attention_map(backend: ModelBackend, request: AttentionRequest, retry_after: int) -> AttentionMap:
    """The attention weights, or the refusal as an HTTP error."""
    return answered(await backend.attention(request), retry_after)


async def open_stream(backend: ModelBackend, request: GenerateRequest, retry_after: int) -> AsyncGenerator[Chunk, None]:
    """Starts a request and waits for its first item, so a refusal becomes an HTTP status before
    any response byte is sent. Returns the stream of chunks with that first one put back in front."""
    stream = backend.stream(request)
    first = await anext(stream)
    if isinstance(first, Refusal):
        await stream.aclose()
        raise refusal_error(first, retry_after)
    if first.finish_reason == "timeout":
        await stream.aclose()
        raise ended_in_failure(first, "request", retry_after)
    return _chunks(first, stream, retry_after)


def ended_in_failure(chunk: Chunk, what: str, retry_after: int | None = None) -> APIError:
    """The HTTP error of a chunk that ends a request in failure: the engine's ("error") a 500 (the
    replica counted it), a deadline passed ("timeout") a 503 to retry (after retry_after, when the
    answer has not begun: a stream ends with an error event instead), an output that could not
    satisfy its structured output ("constraint") a 400 saying why."""
    if chunk.finish_reason == "constraint":
        return APIError(400, f"the {what} could not satisfy its structured output: {chunk.error}", counted=True)
    if chunk.finish_reason == "timeout":
        return APIError(503, f"the {what} timed out waiting for the model; retry later", None, retry_after, counted=True)
    return APIError(500, f"internal error during {what}", counted=True)


def failed(chunk: Chunk) -> bool:
    return chunk.finish_reason in ("error", "timeout", "constraint")


async def _chunks(first: Chunk, rest: AsyncGenerator[Chunk | Refusal, None], retry_after: int) -> AsyncGenerator[Chunk, None]:
    """The stream's chunks. Its replica lost after the answer began: a 503 APIError that says the
    request may be sent again (a route that has sent its 200 turns it into an error event)."""
    try:
        yield first
        async for item in rest:
            assert isinstance(item, Chunk), "a refusal comes first and alone"
            yield item
    except ReplicaLostError as error:
        raise APIError(503, str(error), None, retry_after, counted=True) from error
    finally:
        await rest.aclose()


async def final_chunk(stream: AsyncGenerator[Chunk, None], what: str, retry_after: int) -> Chunk:
    """The stream read to its end, as one chunk holding all the text; the stream is closed (its
    request cancelled) on the way out. A failure is ended_in_failure's error (nothing has been
    answered yet)."""
    whole: Chunk | None = None
    try:
        async for chunk in stream:
            if failed(chunk):
                raise ended_in_failure(chunk, what, retry_after)
            whole = chunk if whole is None else whole.followed_by(chunk)
            if whole.finish_reason is not None:
                return whole
        raise APIError(500, f"internal error during {what}: the stream ended without a result")
    finally:
        await stream.aclose()
