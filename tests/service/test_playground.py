"""The playground: attention through the API (checked against the model in this process) and
the page itself in headless Chromium (Debian's, driven by Playwright) against the real service."""

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import EOS_ID
from model.attention_maps import cross_attention, self_attention
from tests.helpers import TEST_CONFIG

SENTENCES = "A man in a red shirt is riding a bike. Two dogs are running behind him."
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs"


def assert_rows_sum_to_one(weights: torch.Tensor) -> None:
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1], dtype=weights.dtype), atol=1e-5)


def test_translation_attention_is_the_models_and_leaves_the_translation_unchanged(service_url: str) -> None:
    plain = httpx.post(f"{service_url}/v1/translate", json={"text": SENTENCES}, timeout=120).json()["translations"][0]
    answer = httpx.post(f"{service_url}/v1/translate", json={"text": SENTENCES, "return_attention": True}, timeout=120)
    assert answer.status_code == 200, answer.text
    translation = answer.json()["translations"][0]
    assert translation["text"] == plain["text"]  # asking for attention changes nothing else
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    for sentence in translation["sentences"]:
        attention = sentence["attention"]
        weights = torch.tensor(attention["weights"])  # (L, H, T, S)
        assert weights.shape[:2] == (attention["layers"], attention["heads"]) == (3, 4)
        assert weights.shape[2:] == (len(attention["target_tokens"]), len(attention["source_tokens"]))
        assert_rows_sum_to_one(weights)
        start, end = sentence["source"]
        source_ids = tokenizer.encode(SENTENCES[start:end]) + [EOS_ID]
        target_ids = tokenizer.encode(sentence["text"]) + [EOS_ID]
        assert torch.allclose(weights, cross_attention(model, source_ids, target_ids), atol=1e-5)
        assert attention["source_tokens"][-1] == attention["target_tokens"][-1] == "</s>"


def test_generator_self_attention_is_causal_and_the_models(service_url: str) -> None:
    text = "The animal didn't cross the street because it was too tired."
    answer = httpx.post(f"{service_url}/v1/attention", json={"text": text}, timeout=60)
    assert answer.status_code == 200, answer.text
    weights = torch.tensor(answer.json()["weights"])  # (L, H, T, T)
    assert_rows_sum_to_one(weights)
    assert torch.all(weights.triu(diagonal=1) == 0)  # nothing attends to a later token
    model, tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    assert "".join(answer.json()["tokens"]) == text
    assert torch.allclose(weights, self_attention(model, tokenizer.encode(text)), atol=1e-5)


def test_attention_requests_are_bounded(service_url: str) -> None:
    many = " ".join(["A dog runs."] * (TEST_CONFIG.max_attention_sentences + 1))
    too_many = httpx.post(f"{service_url}/v1/translate", json={"text": many, "return_attention": True})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "return_attention"
    streamed = httpx.post(f"{service_url}/v1/translate", json={"text": "A dog.", "return_attention": True, "stream": True})
    assert streamed.status_code == 400
    too_long = httpx.post(f"{service_url}/v1/attention", json={"text": "word " * 400}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "text"
    spec = httpx.get(f"{service_url}/openapi.json").json()
    assert "/v1/attention" in spec["paths"]
    assert "return_attention" in spec["components"]["schemas"]["TranslateRequest"]["properties"]


CHROMIUM = shutil.which("chromium")


@pytest.fixture
def page(service_url: str) -> Iterator[object]:
    sync_api = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (CI installs it)")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[*flags, "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield page
        browser.close()


def test_the_playground_translates_streams_and_shows_attention(service_url: str, page: object) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    console_errors: list[str] = []
    page.on("console", lambda message: console_errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: console_errors.append(str(error)))
    page.goto(service_url + "/")
    expect(page.locator("h1")).to_have_text("Transformer playground", timeout=60_000)

    page.click("#translate-button")
    expect(page.locator("#heatmap table")).to_be_visible(timeout=60_000)
    assert page.inner_text("#translation").strip()
    rows = page.locator("#heatmap tbody tr")
    assert rows.count() >= 2
    rows.nth(0).hover()  # the source tokens light up by this row's weights
    assert page.locator("#source-tokens .token[style*='background']").count() > 0
    page.select_option("#cross-layer", "0")
    page.select_option("#cross-head", "1")
    expect(page.locator("#heatmap table")).to_be_visible(timeout=60_000)
    page.locator("#translate-panel").screenshot(path=str(SCREENSHOTS / "playground_translate.png"))

    updates: list[str] = []
    page.expose_function("recordUpdate", lambda text: updates.append(text))
    # Each frame's text as the page set it (a record per assignment of the output's text): frames
    # read in one go still count one by one, so this holds however fast the model answers (the
    # server sends the first token at once, the rest after it).
    page.evaluate(
        "new MutationObserver((records) => records.forEach((r) => r.addedNodes.forEach((n) => window.recordUpdate(n.textContent))))"
        ".observe(document.getElementById('generated'), {childList: true})"
    )
    page.fill("#max-tokens", "60")
    page.click("#generate-button")
    expect(page.locator("#self-tokens .token").first).to_be_visible(timeout=60_000)
    assert len({u for u in updates if u}) > 1, "the generation should arrive in several updates"
    assert page.inner_text("#ttft") != "-" and page.inner_text("#tokens-per-s") != "-"
    page.locator("#self-tokens .token").nth(3).click()
    expect(page.locator("#self-tokens .token.selected")).to_have_count(1, timeout=60_000)
    page.locator("#generate-panel").screenshot(path=str(SCREENSHOTS / "playground_generate.png"))
    assert console_errors == []
