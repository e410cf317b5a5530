"""Overload and oversized bodies against the real service: refusals are fast, always carry
Retry-After and the documented body, accepted work is unharmed, and the service serves normally
right after; bodies over the limit get 413 before they are read whole."""

import asyncio
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx

from tests.service.conftest import TEST_CONFIG

PROMPT = {"prompt": "ROMEO:\n", "max_tokens": 8, "temperature": 0}


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


def burst(url: str, completions: int, healthz: int) -> tuple[list[Answer], list[Answer]]:
    """That many completions and /healthz requests at once, each on its own connection. The client
    is aiohttp: httpx's per-request cost on these 2 cores made the client, not the service, the
    bottleneck of a 576-request burst."""

    async def timed(http: aiohttp.ClientSession, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        started = time.perf_counter()
        async with http.request(method, url + path, json=body) as response:
            content = await response.read()
            headers = {k.lower(): v for k, v in response.headers.items()}
            return Answer(response.status, headers, content, time.perf_counter() - started)

    async def main() -> tuple[list[Answer], list[Answer]]:
        connector = aiohttp.TCPConnector(limit=0)  # no client-side queue: every request connects at once
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
            # Every request has its own connection, opened beforehand (a burst then measures the
            # service, not the connection setup), and the two kinds go interleaved.
            await asyncio.gather(*(timed(http, "GET", "/healthz", None) for _ in range(completions + healthz)))
            kinds = ["completion"] * completions + ["healthz"] * healthz
            random.shuffle(kinds)
            request = {"completion": ("POST", "/v1/completions", PROMPT), "healthz": ("GET", "/healthz", None)}
            sent = (timed(http, *request[k]) for k in kinds)
            results = list(zip(kinds, await asyncio.gather(*sent), strict=True))
            return [a for k, a in results if k == "completion"], [a for k, a in results if k == "healthz"]

    return asyncio.run(main())


def p99(seconds: list[float]) -> float:
    return sorted(seconds)[int(0.99 * (len(seconds) - 1))]


def test_three_times_capacity_beside_a_healthz_burst(service_url: str) -> None:
    expected = httpx.post(f"{service_url}/v1/completions", json=PROMPT, timeout=60).json()["choices"][0]["text"]
    at_capacity, _ = burst(service_url, capacity(), 0)
    at_capacity = [a for a in at_capacity if a.status == 200]  # the router spreads by sampling: a few may be refused
    assert at_capacity
    completions, health = burst(service_url, 3 * capacity(), 3 * capacity())
    refused = [a for a in completions if a.status != 200]
    accepted = [a for a in completions if a.status == 200]
    assert all(a.status == 200 for a in health)
    assert refused, f"{3 * capacity()} simultaneous completions against room for {capacity()} must see refusals"
    for answer in refused:
        assert answer.status in (429, 503), answer.body
        assert answer.headers.get("retry-after") == str(TEST_CONFIG.retry_after_seconds)
        assert answer.json()["error"]["type"] in ("rate_limit_error", "service_unavailable")
    assert accepted and all(a.json()["choices"][0]["text"] == expected for a in accepted)
    # Reported, not asserted: the accepted requests' p99 against its value at capacity (README).
    p99_capacity, p99_overload = p99([a.seconds for a in at_capacity]), p99([a.seconds for a in accepted])
    after = httpx.post(f"{service_url}/v1/completions", json=PROMPT, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
    refusal_p50 = sorted(a.seconds for a in refused)[len(refused) // 2]
    health_p50 = sorted(a.seconds for a in health)[len(health) // 2]
    print(
        f"{3 * capacity()} completions: {len(accepted)} accepted (p99 {p99_overload:.2f} s; {p99_capacity:.2f} s at capacity), "
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
