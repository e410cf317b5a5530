"""Overload and oversized bodies against the real service: refusals are fast, always carry
Retry-After and the documented body, accepted work is unharmed, and the service serves normally
right after; bodies over the limit get 413 before they are read whole."""

import asyncio
import json
import random
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.helpers import TEST_CONFIG, hold_next_step

PROMPT = {"prompt": "ROMEO:\n", "max_tokens": 64, "temperature": 0}


def capacity() -> int:
    """Requests the generator deployment holds at once: slots and queue of every replica."""
    held = TEST_CONFIG.generator.max_requests_held
    assert held is not None, "the test's generator has a fixed number of replicas"
    return held


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    seconds: float  # from sending the request to the end of the response

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(host: str, method: str, path: str, body: dict[str, Any] | None) -> bytes:
    """One whole HTTP/1.1 request (keep-alive), as bytes."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(payload)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    return (head + "\r\n").encode() + payload


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, lower-case headers and body of one HTTP/1.1 response (Content-Length or chunked)."""
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines if line)}
    if "content-length" in headers:
        return int(status_line.split()[1]), headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")  # the empty trailer
    return int(status_line.split()[1]), headers, body


def burst(
    url: str, completions: int, healthz: int, on_answer: Callable[[str, Answer], None] = lambda kind, answer: None
) -> tuple[list[Answer], list[Answer]]:
    """That many completions and /healthz requests at once, each on its own connection, opened
    beforehand. The client is plain asyncio streams: every request is prepared as bytes and all are
    written in one loop, in shuffled order, before any answer is read, so they reach the service
    interleaved. (aiohttp wrote its GETs about 0.3 s before its POSTs in such a burst: the server
    then saw nearly all /healthz requests before the first completion.) `on_answer` sees each
    answer with its kind as it arrives."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port
    assert host is not None and port is not None
    request = {
        "completion": http_request(parts.netloc, "POST", "/v1/completions", PROMPT),
        "healthz": http_request(parts.netloc, "GET", "/healthz", None),
    }

    async def main() -> list[tuple[str, Answer]]:
        kinds = ["completion"] * completions + ["healthz"] * healthz
        random.shuffle(kinds)
        connections = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in kinds))

        async def answer(kind: str, reader: asyncio.StreamReader, sent: float) -> Answer:
            status, headers, body = await read_response(reader)
            result = Answer(status, headers, body, time.perf_counter() - sent)
            on_answer(kind, result)
            return result

        pending = []
        for kind, (reader, writer) in zip(kinds, connections, strict=True):
            writer.write(request[kind])  # no await in this loop: the writes go out back to back
            pending.append(answer(kind, reader, time.perf_counter()))
        answers = await asyncio.wait_for(asyncio.gather(*pending), 300)
        for _, writer in connections:
            writer.close()
        return list(zip(kinds, answers, strict=True))

    results = asyncio.run(main())
    return [a for k, a in results if k == "completion"], [a for k, a in results if k == "healthz"]


def test_three_times_capacity_beside_a_healthz_burst(service_url: str, tmp_path: Path) -> None:
    expected = httpx.post(f"{service_url}/v1/completions", json=PROMPT, timeout=60).json()["choices"][0]["text"]
    at_capacity, _ = burst(service_url, capacity(), 0)
    at_capacity = [a for a in at_capacity if a.status == 200]  # the router spreads by sampling: a few may be refused
    assert at_capacity and all(a.json()["choices"][0]["text"] == expected for a in at_capacity)
    # The engines hold their steps until at least all but capacity() completions are refused:
    # whatever the machine's speed, the ingress then holds capacity() requests and refuses the rest.
    release_file = tmp_path / "release"
    hold_next_step(TEST_CONFIG.generator, release_file)
    refusals = 0

    def release_when_all_but_capacity_refused(kind: str, answer: Answer) -> None:
        nonlocal refusals
        refusals += kind == "completion" and answer.status != 200
        if refusals >= 2 * capacity():
            release_file.touch()

    try:
        completions, health = burst(service_url, 3 * capacity(), 3 * capacity(), release_when_all_but_capacity_refused)
    finally:
        release_file.touch()
    refused = [a for a in completions if a.status != 200]
    accepted = [a for a in completions if a.status == 200]
    assert all(a.status == 200 for a in health)
    assert len(refused) >= 2 * capacity(), f"{3 * capacity()} simultaneous completions against room for {capacity()}"
    for answer in refused:
        assert answer.status in (429, 503), answer.body
        assert answer.headers.get("retry-after") == str(TEST_CONFIG.retry_after_seconds)
        assert answer.json()["error"]["type"] in ("rate_limit_error", "service_unavailable")
    assert accepted and all(a.json()["choices"][0]["text"] == expected for a in accepted)
    after = httpx.post(f"{service_url}/v1/completions", json=PROMPT, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
    refusal_p50 = sorted(a.seconds for a in refused)[len(refused) // 2]
    health_p50 = sorted(a.seconds for a in health)[len(health) // 2]
    print(
        f"{3 * capacity()} completions: {len(accepted)} accepted (answered once the hold was released), "
        f"{len(refused)} refused (p50 {refusal_p50:.3f} s; /healthz p50 {health_p50:.3f} s); "
        f"statuses {sorted(Counter(a.status for a in refused).items())}"
    )


def send_partial_body(url: str, headers: str, body: bytes) -> bytes:
    """Sends the request line, headers and only part of a body, then reads what the server says
    without sending the rest."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as connection:
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n{headers}\r\n".encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_ten_megabyte_bodies_get_413_before_they_are_read_whole(service_url: str) -> None:
    ten_mb = 10 * 1024 * 1024
    declared = send_partial_body(service_url, f"Content-Type: application/json\r\nContent-Length: {ten_mb}\r\n", b"")
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
    # No Content-Length: chunked, cut off after 1.5 MB of a 10 MB body; the 413 comes anyway.
    chunk = b"x" * (512 * 1024)
    chunked = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(3))
    streamed = send_partial_body(service_url, "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n", chunked)
    assert streamed.startswith(b"HTTP/1.1 413"), streamed[:200]
    assert httpx.get(f"{service_url}/healthz").status_code == 200
