"""What the routes share for answering: server-sent events, their error event, and the merged
streams of a request's n choices."""

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from service.api.schemas import OpenAIError, ResponseModel
from service.protocol import Chunk


def sse(event: type[ResponseModel], data: dict[str, Any]) -> str:
    """One server-sent event, `data: <json>` and a blank line: data read as the event model the
    route's schema documents (a frame that does not conform raises), written with what was set."""
    return f"data: {event.model_validate(data).model_dump_json(exclude_unset=True)}\n\n"


DONE = "data: [DONE]\n\n"  # the last event of every stream


def sse_error(message: str, status: int) -> str:
    """An error event in OpenAI's envelope, sent when a stream fails after its 200: a 503 (its
    replica was lost, or a deadline passed) is a "server_error" that may be retried."""
    kind = {429: "rate_limit_error", 503: "server_error"}.get(status, "internal_error")
    return sse(OpenAIError, {"error": {"message": message, "type": kind, "param": None, "code": status}})


async def merged(streams: list[AsyncGenerator[Chunk, None]]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """The chunks of several streams as they come, each with its stream's index (n choices of one
    request). A stream's failure is raised after the others are closed; closing this closes all."""
    if len(streams) == 1:  # the common case, without tasks
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[Chunk, None]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
            await queue.put((index, None))
        except Exception as error:
            await queue.put((index, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
