"""A list of models behind one HTTP API: every route reaches the model a request names, a
translator by its languages, or the first of the route's kind; what is listed comes from the list."""

from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from model.paths import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.api.app import create_api
from service.api.backend import Backends
from service.config import ModelServingConfig, ServiceConfig
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest


def translator(name: str, source: str, target: str) -> ModelServingConfig:
    return ModelServingConfig(name=name, checkpoint=Path("/nowhere"), kind="translator", source_lang=source, target_lang=target)


CONFIG = ServiceConfig(
    models=(
        translator("opus-en-de", "en", "de"),
        ModelServingConfig(name="poet", checkpoint=DEFAULT_GENERATOR),  # kind read from the folder
        translator("opus-en-fr", "en", "fr"),
        translator("opus-de-en", "de", "en"),
        ModelServingConfig(name="bard", checkpoint=DEFAULT_GENERATOR),
    )
)


class NamedBackend:
    """Answers every request with its model's name and the text, so a response shows who answered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[str] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk, None]:
        self.requests.append(request.text)
        yield Chunk(f"<{self.name}>{request.text}", "stop", prompt_tokens=1, completion_tokens=1)

    async def attention(self, request: AttentionRequest) -> AttentionMap:
        return AttentionMap(("a",), (), [[[[1.0]]]])

    async def ready(self) -> bool:
        return True


@pytest.fixture
def http() -> TestClient:
    return TestClient(create_api(CONFIG, Backends({m.name: NamedBackend(m.name) for m in CONFIG.models})))


def test_the_kind_and_languages_come_from_the_folder_unless_the_entry_sets_them() -> None:
    shipped = ModelServingConfig(name="t", checkpoint=DEFAULT_TRANSLATOR)
    assert (shipped.kind, shipped.source_lang, shipped.target_lang) == ("translator", "en", "de")
    assert CONFIG.model_named("poet") is not None and CONFIG.model_named("poet").kind == "generator"  # type: ignore[union-attr]
    overridden = ModelServingConfig(name="t", checkpoint=DEFAULT_TRANSLATOR, target_lang="fr")
    assert (overridden.source_lang, overridden.target_lang) == ("en", "fr")


def test_names_are_distinct() -> None:
    with pytest.raises(ValueError, match="distinct: poet"):
        ServiceConfig(models=(CONFIG.models[1], CONFIG.models[1]))


def test_models_lists_every_model_with_its_kind_and_languages(http: TestClient) -> None:
    cards = http.get("/v1/models").json()["data"]
    assert [(c["id"], c["kind"], c["source_lang"], c["target_lang"]) for c in cards] == [
        ("opus-en-de", "translator", "en", "de"),
        ("poet", "generator", None, None),
        ("opus-en-fr", "translator", "en", "fr"),
        ("opus-de-en", "translator", "de", "en"),
        ("bard", "generator", None, None),
    ]


def test_completions_go_to_the_model_named_or_the_first_generator(http: TestClient) -> None:
    def answered(body: dict[str, object]) -> tuple[str, str]:
        answer = http.post("/v1/completions", json={"prompt": "x", **body}).json()
        return answer["model"], answer["choices"][0]["text"]

    assert answered({"model": "bard"}) == ("bard", "<bard>x")
    assert answered({}) == ("poet", "<poet>x")
    unknown = http.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert unknown.status_code == 404 and "served generators: poet, bard" in unknown.json()["error"]["message"]
    wrong_kind = http.post("/v1/completions", json={"prompt": "x", "model": "opus-en-fr"})
    assert wrong_kind.status_code == 404 and "/v1/translate" in wrong_kind.json()["error"]["message"]
    assert http.post("/v1/attention", json={"text": "x", "model": "bard"}).json()["model"] == "bard"


def test_translate_routes_by_model_or_by_pair(http: TestClient) -> None:
    def translated(body: dict[str, object]) -> tuple[str, str]:
        answer = http.post("/v1/translate", json={"text": "A dog.", **body}).json()
        return answer["model"], answer["translations"][0]["text"]

    assert translated({}) == ("opus-en-de", "<opus-en-de>A dog.")
    assert translated({"target_lang": "fr"}) == ("opus-en-fr", "<opus-en-fr>A dog.")
    assert translated({"source_lang": "de", "target_lang": "en"}) == ("opus-de-en", "<opus-de-en>A dog.")
    assert translated({"source_lang": "de"})[0] == "opus-de-en"
    assert translated({"model": "opus-en-fr"})[0] == "opus-en-fr"
    assert translated({"model": "opus-en-fr", "target_lang": "fr"})[0] == "opus-en-fr"
    mismatch = http.post("/v1/translate", json={"text": "A dog.", "model": "opus-en-fr", "target_lang": "de"})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "target_lang"
    unserved = http.post("/v1/translate", json={"text": "A dog.", "source_lang": "fr", "target_lang": "de"})
    assert unserved.status_code == 400
    assert "en -> de, en -> fr, de -> en" in unserved.json()["error"]["message"]


def test_auto_detects_among_the_sources_served(http: TestClient) -> None:
    german = "Ein Mann fährt mit dem Fahrrad durch die Stadt."
    answer = http.post("/v1/translate", json={"text": german, "source_lang": "auto"}).json()
    assert answer["model"] == "opus-de-en"
    answer = http.post("/v1/translate", json={"text": "A man rides a bike through the city.", "source_lang": "auto"}).json()
    assert answer["model"] == "opus-en-de"
    french = http.post("/v1/translate", json={"text": "Un homme fait du vélo dans la ville.", "source_lang": "auto"})
    assert french.status_code == 400 and "looks French" in french.json()["error"]["message"]


def test_libretranslate_routes_by_source_and_target_and_lists_the_pairs(http: TestClient) -> None:
    def answer(body: dict[str, object]) -> dict[str, object]:
        result: dict[str, object] = http.post("/translate", json={"q": "Hallo Welt, wie geht es dir heute?", **body}).json()
        return result

    assert answer({"source": "en", "target": "fr"})["translatedText"] == "<opus-en-fr>Hallo Welt, wie geht es dir heute?"
    detected = answer({"source": "auto", "target": "en"})
    assert detected["translatedText"] == "<opus-de-en>Hallo Welt, wie geht es dir heute?"
    assert detected["detectedLanguage"]["language"] == "de"  # type: ignore[index]
    refused = http.post("/translate", json={"q": "x", "source": "en", "target": "cs"})
    assert refused.status_code == 400 and "en -> cs is not supported" in refused.json()["error"]
    assert http.get("/languages").json() == [
        {"code": "en", "name": "English", "targets": ["de", "fr"]},
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "fr", "name": "French", "targets": []},
    ]
    language = http.get("/frontend/settings").json()["language"]
    assert language == {"source": {"code": "en", "name": "English"}, "target": {"code": "de", "name": "German"}}


def test_ready_only_when_every_model_is(http: TestClient) -> None:
    assert http.get("/readyz").status_code == 200
    backends: Backends = http.app.state.backends  # type: ignore[attr-defined]

    async def not_ready() -> bool:
        return False

    backends.models["bard"].ready = not_ready  # type: ignore[method-assign]
    assert http.get("/readyz").status_code == 503
