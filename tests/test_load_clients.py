"""The cluster scenarios' clients (loadtests/scaling.py) send a request again, as the openai client
does, only where the connection closed before any answer; a stream cut after its answer began
is a failure. Against an httpx transport that plays the server."""

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from loadtests.scaling import CLIENT_RETRIES, Load, Timeline, client

STREAM = b'data: {"choices": [{"text": "A", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n'


def run_one_client(handler: httpx.MockTransport) -> Timeline:
    """One streaming client's one request against the transport."""
    timeline = Timeline()

    async def go() -> None:
        async with httpx.AsyncClient(transport=handler, base_url="http://127.0.0.1:1") as http:
            load = Load(streams=1, completions=0, translations=0, max_requests=1)
            await client(http, "stream", 7, load, timeline, 0.0, asyncio.Event(), asyncio.Event())

    asyncio.run(go())
    return timeline


def test_a_connection_closed_before_any_answer_is_sent_again_as_the_same_request() -> None:
    bodies: list[dict[str, object]] = []

    def serve(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        if len(bodies) <= CLIENT_RETRIES:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, content=STREAM, headers={"content-type": "text/event-stream"})

    (result,) = run_one_client(httpx.MockTransport(serve)).results
    assert (result.status, result.error, result.text, result.retries) == (200, None, "A", CLIENT_RETRIES)
    assert len(bodies) == CLIENT_RETRIES + 1 and all(body == bodies[0] for body in bodies)


def test_retries_end_after_the_openai_clients_number_and_the_request_fails() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    (result,) = run_one_client(httpx.MockTransport(refuse)).results
    assert result.status == 0 and result.error is not None and "ConnectError" in result.error and result.retries == CLIENT_RETRIES


def test_a_stream_cut_after_its_answer_began_is_a_failure_never_sent_again() -> None:
    calls: list[httpx.Request] = []

    def cut(request: httpx.Request) -> httpx.Response:
        calls.append(request)

        async def frames() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"text": "A"}]}\n\n'
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body", request=request)

        return httpx.Response(200, content=frames(), headers={"content-type": "text/event-stream"})

    (result,) = run_one_client(httpx.MockTransport(cut)).results
    assert result.status == 0 and result.error is not None and "complete message body" in result.error
    assert result.retries == 0 and len(calls) == 1
