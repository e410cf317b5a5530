"""End to end: the real Serve application over HTTP, with the official openai client and httpx."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from httpx_sse import connect_sse

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import Tokenizer
from service.engine.offline import OfflineEngine
from tests.helpers import TEST_CONFIG, astream_data, held_until_open, leave_stream, replica_stats, stream_data, translations_while_held
from training.data import SHARED_DATA, read_lines

GENERATOR = TEST_CONFIG.generator.name
TEST_SOURCES = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_openai_client_completion_with_usage(service_url: str) -> None:
    prompt = "ROMEO:\n"
    result = client(service_url).completions.create(model=GENERATOR, prompt=prompt, max_tokens=24, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_tokens = len(Tokenizer.load(DEFAULT_GENERATOR / "tokenizer.model").encode(prompt))
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        prompt_tokens,
        24,
        prompt_tokens + 24,
    )
    assert result.object == "text_completion" and result.model == GENERATOR


def test_openai_client_streaming_matches_non_streaming(service_url: str) -> None:
    c = client(service_url)
    whole = c.completions.create(model=GENERATOR, prompt="KING:", max_tokens=30, temperature=0).choices[0].text
    chunks = list(
        c.completions.create(
            model=GENERATOR, prompt="KING:", max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    content = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in content) == whole
    assert [ch.choices[0].finish_reason for ch in content][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


def test_stop_strings_end_the_completion(service_url: str) -> None:
    result = client(service_url).completions.create(model=GENERATOR, prompt="ROMEO:\n", max_tokens=100, temperature=0, stop=["\n"])
    assert result.choices[0].finish_reason == "stop" and "\n" not in result.choices[0].text


def test_seeded_sampling_is_reproducible(service_url: str) -> None:
    c = client(service_url)
    texts = [
        c.completions.create(model=GENERATOR, prompt="JULIET:", max_tokens=30, temperature=0.9, seed=s).choices[0].text for s in (7, 7, 8)
    ]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_sse_wire_format(service_url: str) -> None:
    body = {"model": GENERATOR, "prompt": "To be", "max_tokens": 5, "stream": True}
    with httpx.Client(timeout=60) as http, connect_sse(http, "POST", f"{service_url}/v1/completions", json=body) as source:
        assert source.response.status_code == 200 and source.response.headers["content-type"].startswith("text/event-stream")
        events = list(source.iter_sse())
    assert events[-1].data == "[DONE]"
    for event in events[:-1]:
        assert event.event == "message"  # data-only events
        assert {"id", "object", "created", "model", "choices"} <= event.json().keys()


def test_translate_matches_the_evaluation_cli(service_url: str, tmp_path: Path) -> None:
    sentences = TEST_SOURCES[:12]
    source_file = tmp_path / "src.en"
    source_file.write_text("\n".join(sentences) + "\n")
    output = tmp_path / "out.de"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "training.evaluate",
            "translate",
            "--src",
            str(source_file),
            "--ref",
            str(source_file),
            "--beam-size",
            "4",
            "--output",
            str(output),
        ],
        check=True,
        capture_output=True,
    )
    cli_beam4 = output.read_text().splitlines()
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    greedy = [c.text for c in OfflineEngine(model, tokenizer).generate(sentences)]  # the engine in-process, as training.evaluate runs it

    v1 = httpx.post(f"{service_url}/v1/translate", json={"text": sentences, "beam_size": 1}, timeout=120).json()
    assert [t["text"] for t in v1["translations"]] == greedy
    assert v1["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(s)) + 1 for s in sentences)
    lt = httpx.post(f"{service_url}/translate", json={"q": sentences, "source": "en", "target": "de"}, timeout=120).json()
    assert lt["translatedText"] == cli_beam4


def test_libretranslate_form_body_alternatives_and_languages(service_url: str) -> None:
    form = httpx.post(
        f"{service_url}/translate", data={"q": "A dog runs.", "source": "auto", "target": "de", "alternatives": "2"}, timeout=60
    )
    assert form.status_code == 200
    answer = form.json()
    assert isinstance(answer["translatedText"], str) and answer["translatedText"]
    assert len(answer["alternatives"]) == 2 and answer["translatedText"] not in answer["alternatives"]
    assert answer["detectedLanguage"]["language"] == "en"
    assert httpx.get(f"{service_url}/languages").json()[0] == {"code": "en", "name": "English", "targets": ["de"]}
    assert httpx.get(f"{service_url}/health").json() == {"status": "ok"}
    unsupported = httpx.post(f"{service_url}/translate", json={"q": "Hallo", "source": "de", "target": "en"})
    assert unsupported.status_code == 400 and "error" in unsupported.json()


def test_translation_streams_greedy_text(service_url: str) -> None:
    sentence = TEST_SOURCES[20]
    expected = httpx.post(f"{service_url}/v1/translate", json={"text": sentence, "beam_size": 1}, timeout=60).json()["translations"][0][
        "text"
    ]
    frames = stream_data(f"{service_url}/v1/translate", {"text": sentence, "stream": True})
    assert frames[-1] == "[DONE]"
    events = [json.loads(f) for f in frames[:-1]]
    assert "".join(e["text"] for e in events) == expected and events[-1]["finish_reason"] == "stop"


async def _stream_completion(http: httpx.AsyncClient, i: int) -> tuple[str, str | None, bool]:
    body = {"model": GENERATOR, "prompt": f"Scene {i}:\n", "max_tokens": 40, "stream": True, "temperature": 0}
    frames = await astream_data(http, "/v1/completions", body)
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    reason = next((c["finish_reason"] for c in reversed(chunks) if c["finish_reason"]), None)
    return "".join(c["text"] for c in chunks), reason, frames[-1] == "[DONE]"


def test_32_concurrent_streams_batch_together_on_two_replicas(service_url: str, tmp_path: Path) -> None:
    async def main() -> list[tuple[str, str | None, bool]]:
        async with httpx.AsyncClient(base_url=service_url, timeout=300, limits=httpx.Limits(max_connections=32)) as http:
            return await asyncio.gather(*(_stream_completion(http, i) for i in range(32)))

    before = replica_stats(TEST_CONFIG.generator.name, replicas=2)
    with held_until_open(TEST_CONFIG.generator, tmp_path / "release", 32):  # all 32 in the engines before they step
        results = asyncio.run(main())
    assert all(done and reason == "length" and text for text, reason, done in results)
    after = replica_stats(TEST_CONFIG.generator.name, replicas=2)
    assert len(before) == len(after) == 2, "both generator replicas answer"
    steps = {r: after[r]["steps"] - before[r]["steps"] for r in after}
    sequences = {r: after[r]["batch_size_sum"] - before[r]["batch_size_sum"] for r in after}
    assert all(n > 0 for n in steps.values()), "requests landed on both replicas"
    assert sum(sequences.values()) / sum(steps.values()) > 1  # these streams were batched


def test_disconnecting_a_stream_frees_its_slot(service_url: str) -> None:
    before = sum(s["finished"].get("abort", 0) for s in replica_stats(TEST_CONFIG.generator.name, replicas=2).values())
    body = {"model": GENERATOR, "prompt": "HAMLET:", "max_tokens": 200, "stream": True}
    leave_stream(f"{service_url}/v1/completions", body, after_events=2)
    # The connection is closed; the engine drops the sequence within a step or so.
    deadline = time.monotonic() + 120  # a bound on a broken engine, not a speed limit
    while True:
        stats = replica_stats(TEST_CONFIG.generator.name, replicas=2)
        aborted = sum(s["finished"].get("abort", 0) for s in stats.values())
        idle = all(s["running"] == 0 and s["free_slots"] == TEST_CONFIG.generator.engine.n_slots for s in stats.values())
        if aborted == before + 1 and idle:
            break
        assert time.monotonic() < deadline, f"slot not freed: {stats}"
        time.sleep(0.2)


def test_full_queue_answers_429_with_retry_after(service_url: str, tmp_path: Path) -> None:
    """64 beam-8 requests at once while the translator's next step is held: the ingress passes on
    what its replica holds (32) and refuses the rest; the engine, with 16 slots (2 such requests)
    and 16 waiting places, takes in the 32 once released and refuses all but 18 of them itself."""
    body = {"text": "A man in a blue shirt is walking his dog.", "beam_size": 8}
    responses = translations_while_held(service_url, body, 64, tmp_path / "release")
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}
    refused = [r for r in responses if r.status_code == 429]
    engine = TEST_CONFIG.translator.engine
    assert len(refused) >= 64 - (engine.n_slots // 8 + engine.max_waiting)
    assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in refused)
    assert statuses.count(200) >= 2


ECHO = "ECHO-ME-" * 20
BAD_REQUESTS = [
    ("/v1/completions", {"model": GENERATOR, "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"model": GENERATOR, "prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": GENERATOR, "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"model": GENERATOR, "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": GENERATOR, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": GENERATOR, "prompt": ECHO, "n": 9}, "n"),
    ("/v1/completions", {"model": GENERATOR, "prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"model": GENERATOR, "prompt": "x", "stop": ["a"] * 10}, "stop"),
    ("/v1/completions", {"model": GENERATOR, "prompt": ECHO, "surprise": 1}, "surprise"),
    ("/v1/completions", {"prompt": "x", "model": 5}, "model"),
    ("/v1/translate", {"text": ""}, "text"),
    ("/v1/translate", {"text": ["a"] * 33}, "text"),
    ("/v1/translate", {"text": "a", "target_lang": "fr"}, "target_lang"),
    ("/v1/translate", {"text": "a", "beam_size": 0}, "beam_size"),
    ("/v1/translate", {"text": "a", "stream": True, "beam_size": 4}, "stream"),
    ("/v1/translate", {"text": "x" * 5001}, "text"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_malformed_input_is_a_400_naming_the_parameter(service_url: str, path: str, body: dict[str, object], param: str) -> None:
    response = httpx.post(f"{service_url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert ECHO not in response.text
    assert len(response.headers.get_list("x-request-id")) == 1  # one id, not Ray's proxy's and ours


def test_a_client_request_id_comes_back_once(service_url: str) -> None:
    response = httpx.get(f"{service_url}/v1/models", headers={"X-Request-Id": "client-42"}, timeout=30)
    assert response.headers.get_list("x-request-id") == ["client-42"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "transformer-shakespeare", "prompt": "x", "temperature": NaN}',
        b'{"model": "transformer-shakespeare", "prompt": "\\ud800"}',
        b'{"model": "transformer-shakespeare", "prompt": ',
        b"\xff\xfe not json",
        b"[" * 5000 + b"]" * 5000,
    ],
)
def test_unparseable_or_poisoned_bodies_are_4xx(service_url: str, raw: bytes) -> None:
    response = httpx.post(f"{service_url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    assert "error" in response.json()


def test_unknown_model_is_404_and_oversized_body_is_413(service_url: str) -> None:
    unknown = httpx.post(f"{service_url}/v1/completions", json={"model": "gpt-5", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    huge = httpx.post(f"{service_url}/v1/completions", content=b"{" + b" " * (2 << 20) + b"}", headers={"content-type": "application/json"})
    assert huge.status_code == 413

    def chunks() -> object:
        for _ in range(40):
            yield b" " * 65536

    chunked = httpx.post(f"{service_url}/translate", content=chunks(), headers={"content-type": "application/json"})  # type: ignore[arg-type]
    assert chunked.status_code == 413 and "error" in chunked.json()


def test_health_readiness_models_and_openapi(service_url: str) -> None:
    with httpx.Client(base_url=service_url, timeout=60) as http:  # what they answer, not how fast (the machine is shared)
        assert http.get("/healthz").status_code == 200
        assert http.get("/readyz").json() == {"status": "ready"}
        models = http.get("/v1/models").json()
        spec = http.get("/openapi.json").json()
    assert {m["id"] for m in models["data"]} == {TEST_CONFIG.generator.name, TEST_CONFIG.translator.name}
    for path in ("/v1/completions", "/v1/models", "/v1/translate", "/translate", "/languages", "/health", "/healthz", "/readyz"):
        assert path in spec["paths"], path
    assert {"400", "404", "429"} <= spec["paths"]["/v1/completions"]["post"]["responses"].keys()
    assert "application/x-www-form-urlencoded" in spec["paths"]["/translate"]["post"]["requestBody"]["content"]
