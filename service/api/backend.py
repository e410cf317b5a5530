"""How the HTTP layer reaches a model: a stream of plain dicts from a model deployment."""

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from service.api.errors import APIError


class ModelBackend(Protocol):
    def stream(self, payload: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The deployment's `generate` stream; closing it early cancels the request."""

    async def ready(self) -> bool: ...


@dataclass
class Backends:
    translator: ModelBackend
    generator: ModelBackend


STATUS_OF_ERROR = {"invalid": 400, "overloaded": 429, "unavailable": 503, "internal": 500}


async def open_stream(backend: ModelBackend, payload: dict[str, Any], retry_after: int) -> AsyncGenerator[dict[str, Any], None]:
    """Starts a request and waits for its first item, so a refusal becomes an HTTP status before
    any response byte is sent. Returns the stream with that first item put back in front."""
    stream = backend.stream(payload)
    first = await anext(stream)
    if isinstance(first.get("error"), dict):  # a refusal (error_item); an engine failure is a string
        await stream.aclose()
        e = first["error"]
        status = STATUS_OF_ERROR.get(e["kind"], 500)
        raise APIError(status, e["message"], e.get("param"), retry_after if status in (429, 503) else None, counted=True)
    return _prepend(first, stream)


async def _prepend(first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
