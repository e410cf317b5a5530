"""Locust traffic mix for the service: translation users and streaming generator users.

    .venv/bin/python -m locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000

What lands in the statistics (request type / name):

- `POST /v1/translate`, `POST /v1/translate [list]`, `POST /translate`: whole translation requests,
  failed when the status is not 200 or the body lacks one translation per sentence.
- `POST /v1/completions`: a streamed completion up to its response headers only (Locust's own timing).
- `SSE ttft /v1/completions`: request sent -> first frame carrying text.
- `SSE itl /v1/completions`: ONE EVENT PER GAP between consecutive text frames of a stream (not a
  per-stream mean), so its percentiles are over all gaps, as in vLLM's benchmarks.
- `SSE stream /v1/completions`: request sent -> `data: [DONE]`; its response_length is the
  stream's completion_tokens (from the usage frame), so the CSV's "Average Content Size" of this row
  is the mean tokens per stream. Failed when the stream ends without `[DONE]`, carries an error frame
  or a malformed frame, or has data after `[DONE]`.
- `rejected <route name>`: expected overload answers (429 with Retry-After, or Ray Serve's 503), as
  successes of their own request type: never failures, never mixed into the route's latencies.

`quitting` sets the exit code to 1 when the failure ratio over HTTP requests exceeds `--max-fail-ratio` (default 0.01)
or the p95 of `ttft` exceeds `--ttft-p95-ms` (default 5000; env LOCUST_TTFT_P95_MS).
"""

# Locust (gevent) must be imported before any network library (ssl, requests, httpx): only the
# standard library's non-network modules come first.
import json
import logging
import random
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from locust import HttpUser, events, task
from locust.clients import ResponseContextManager
from locust.env import Environment

DATA = json.loads((Path(__file__).parent / "data" / "prompts.json").read_text())
SENTENCES: list[str] = DATA["sentences"]
PROMPTS: list[str] = DATA["prompts"]
GENERATOR_MODEL = "transformer-shakespeare"
COMPLETIONS = "/v1/completions"
SSE = "SSE"
REJECTED = "rejected"
REJECT_STATUSES = (429, 503)
TTFT_NAME = f"ttft {COMPLETIONS}"
ITL_NAME = f"itl {COMPLETIONS}"
STREAM_NAME = f"stream {COMPLETIONS}"
TIMEOUT_S = 120.0


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    parser.add_argument("--ttft-p95-ms", type=float, default=5000.0, env_var="LOCUST_TTFT_P95_MS", help="Fail the run above this p95 TTFT")
    parser.add_argument(
        "--max-fail-ratio", type=float, default=0.01, env_var="LOCUST_MAX_FAIL_RATIO", help="Fail the run above this failure ratio"
    )
    parser.add_argument(
        "--think-max-seconds",
        type=float,
        default=1.0,
        env_var="LOCUST_THINK_MAX_SECONDS",
        help="Each user pauses uniformly up to this long (at least 0.2 s, if it allows) between requests; 0: back to back",
    )


def think_time(user: HttpUser) -> float:
    """The pause before a user's next request, from --think-max-seconds."""
    options = user.environment.parsed_options
    high = options.think_max_seconds if options is not None else 1.0
    return random.uniform(min(0.2, high), high)


def fire(environment: Environment, name: str, seconds: float, length: int = 0, exception: Exception | None = None) -> None:
    """Report one custom SSE event that took `seconds`."""
    environment.events.request.fire(
        request_type=SSE,
        name=name,
        response_time=seconds * 1000,
        response_length=length,
        exception=exception,
        context={},
    )


def rejected(response: ResponseContextManager) -> bool:
    """An expected overload answer: reported as a success of type `rejected`, named after the route."""
    if response.status_code not in REJECT_STATUSES:
        return False
    response.request_meta["request_type"] = REJECTED  # type: ignore[index]  # a dict at runtime; read when the with-block exits
    response.success()
    return True


def accepted(response: ResponseContextManager) -> bool:
    """True for a 200; a 429/503 is recorded as rejected and anything else as a failure."""
    if rejected(response):
        return False
    if response.status_code != 200:
        response.failure(f"status {response.status_code}")
        return False
    return True


class StreamError(Exception):
    """A stream that did not follow OpenAI's SSE format up to `data: [DONE]`."""


def sse_payloads(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The `data:` payloads of an SSE body, one per frame; raises StreamError on any other field."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data: "):
            data.append(line[len("data: ") :])
        elif not line.startswith(":"):  # comments are allowed
            raise StreamError(f"malformed SSE line: {line[:80]!r}")
    if data:
        raise StreamError("the stream ended inside a frame")


class TranslationUser(HttpUser):
    """Single sentences and small lists through /v1/translate, and LibreTranslate's /translate."""

    wait_time = think_time

    def post_translation(self, path: str, name: str, body: dict[str, Any], expected: int) -> None:
        with self.client.post(path, json=body, name=name, catch_response=True, timeout=TIMEOUT_S) as response:
            if not accepted(response):
                return
            try:
                answer = response.json()
                texts = answer["translatedText"] if path == "/translate" else [t["text"] for t in answer["translations"]]
                texts = texts if isinstance(texts, list) else [texts]
            except (ValueError, KeyError, TypeError):
                response.failure("malformed translation body")
                return
            if len(texts) != expected or not all(isinstance(t, str) and t for t in texts):
                response.failure(f"expected {expected} non-empty translations, got {len(texts)}")

    @task(3)
    def translate_one(self) -> None:
        self.post_translation("/v1/translate", "/v1/translate", {"text": random.choice(SENTENCES), "beam_size": 4}, 1)

    @task(1)
    def translate_list(self) -> None:
        texts = random.sample(SENTENCES, random.randint(2, 4))
        self.post_translation("/v1/translate", "/v1/translate [list]", {"text": texts, "beam_size": 2}, len(texts))

    @task(2)
    def libretranslate(self) -> None:
        body = {"q": random.choice(SENTENCES), "source": "en", "target": "de"}
        self.post_translation("/translate", "/translate", body, 1)


class StreamingGeneratorUser(HttpUser):
    """Streamed OpenAI completions (32-64 tokens) with TTFT, ITL and full-stream events."""

    wait_time = think_time

    @task
    def stream_completion(self) -> None:
        body = {
            "model": GENERATOR_MODEL,
            "prompt": random.choice(PROMPTS),
            "max_tokens": random.randint(32, 64),
            "temperature": 0.8,
            "top_p": 0.95,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        with self.client.post(COMPLETIONS, json=body, name=COMPLETIONS, stream=True, catch_response=True, timeout=TIMEOUT_S) as response:
            try:
                self.check_stream(response, start)
            finally:
                response.close()  # a stream left unread must not go back to the connection pool

    def check_stream(self, response: ResponseContextManager, start: float) -> None:
        """Classifies the response (rejected, failed, or streamed) and fires the stream's events."""
        if not accepted(response):
            return
        try:
            tokens = self.read_stream(response, start)
        except Exception as error:  # a broken connection counts like a malformed stream
            failure = error if isinstance(error, StreamError) else StreamError(repr(error))
            fire(self.environment, STREAM_NAME, time.perf_counter() - start, exception=failure)
        else:
            fire(self.environment, STREAM_NAME, time.perf_counter() - start, length=tokens)

    def read_stream(self, response: ResponseContextManager, start: float) -> int:
        """Fires the TTFT and ITL events while reading; returns the usage's completion_tokens."""
        last_text: float | None = None
        finished, done, tokens = False, False, None
        for payload in sse_payloads(response.iter_lines(chunk_size=None)):  # type: ignore[call-overload]  # each HTTP chunk as it arrives
            if done:
                raise StreamError("data after [DONE]")
            if payload == "[DONE]":
                done = True
                continue
            try:
                frame = json.loads(payload)
            except ValueError:
                raise StreamError(f"frame is not JSON: {payload[:80]!r}") from None
            if not isinstance(frame, dict) or "error" in frame:
                raise StreamError(f"error frame: {str(frame)[:120]}")
            if frame.get("usage") is not None and not frame.get("choices"):
                tokens = int(frame["usage"]["completion_tokens"])
                continue
            choices = frame.get("choices")
            if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0].get("text"), str):
                raise StreamError(f"malformed choices: {str(frame)[:120]}")
            if choices[0]["text"]:
                now = time.perf_counter()
                if last_text is None:
                    fire(self.environment, TTFT_NAME, now - start)
                else:
                    fire(self.environment, ITL_NAME, now - last_text)
                last_text = now
            finished = finished or choices[0].get("finish_reason") is not None
        if not done:
            raise StreamError("the stream ended without [DONE]")
        if not finished or tokens is None:
            raise StreamError("no finish_reason or no usage frame before [DONE]")
        return tokens


@events.quitting.add_listener
def check_thresholds(environment: Environment, **_: Any) -> None:
    """Sets the exit code: 1 when the failure ratio or the TTFT p95 breaks its threshold, else 0
    (so that failures within the allowed ratio do not trip Locust's --exit-code-on-error).

    The ratio is over HTTP requests (the POST rows): a stream's failure counts on its `stream`
    row, and the TTFT and ITL events are timings, not requests."""
    options = environment.parsed_options
    max_fail_ratio = options.max_fail_ratio if options else 0.01
    ttft_p95_ms = options.ttft_p95_ms if options else 5000.0
    entries = environment.stats.entries.values()
    requests = sum(e.num_requests for e in entries if e.method == "POST")
    failures = sum(e.num_failures for e in entries if e.method == "POST" or e.name == STREAM_NAME)
    environment.process_exit_code = 0
    if requests and failures / requests > max_fail_ratio:
        logging.error("failure ratio %.2f%% is above %.2f%%", 100 * failures / requests, 100 * max_fail_ratio)
        environment.process_exit_code = 1
    ttft = environment.stats.entries.get((TTFT_NAME, SSE))
    if ttft is not None and ttft.num_requests:
        p95 = ttft.get_response_time_percentile(0.95)
        if p95 > ttft_p95_ms:
            logging.error("TTFT p95 %.0f ms is above %.0f ms", p95, ttft_p95_ms)
            environment.process_exit_code = 1
