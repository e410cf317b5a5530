"""Real text through the real service: paragraphs, whitespace, HTML, language detection and the
LibreTranslate clients' ways of sending it."""

import json
import re
from typing import Any

import httpx
import pytest
import sacrebleu
from libretranslatepy import LibreTranslateAPI

from service.api.sentences import split_sentences
from tests.helpers import TEST_CONFIG, stream_data
from training.data import SHARED_DATA, read_lines

TEST_SOURCES = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")
TEST_REFERENCES = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.de.gz")
MAX_SENTENCE_CHARS = TEST_CONFIG.max_sentence_chars

# Test sentences that are one sentence each by themselves (many captions lack a final stop).
WHOLE = [
    i
    for i, s in enumerate(TEST_SOURCES)
    if re.fullmatch(r"[A-Z].*[.!?]", s) and len(split_sentences(s, MAX_SENTENCE_CHARS)) == 1 and "  " not in s
][:77]
PARAGRAPHS = []  # 11 paragraphs of 2, 3, ..., 12 sentences: (sentence indices, text)
_start = 0
for _size in range(2, 13):
    _chosen = WHOLE[_start : _start + _size]
    PARAGRAPHS.append((_chosen, " ".join(TEST_SOURCES[i] for i in _chosen)))
    _start += _size


@pytest.fixture(scope="module")
def one_by_one(service_url: str) -> dict[int, str]:
    """Each paragraph sentence translated alone (beam 4, the default), by test-set index."""
    indices = [i for chosen, _ in PARAGRAPHS for i in chosen]
    translations = {}
    for start in range(0, len(indices), TEST_CONFIG.max_batch_texts):
        chunk = indices[start : start + TEST_CONFIG.max_batch_texts]
        answer = httpx.post(f"{service_url}/v1/translate", json={"text": [TEST_SOURCES[i] for i in chunk]}, timeout=300).json()
        translations.update({i: t["text"] for i, t in zip(chunk, answer["translations"], strict=True)})
    return translations


def expected_paragraphs(one_by_one: dict[int, str]) -> list[str]:
    return [" ".join(one_by_one[i] for i in chosen) for chosen, _ in PARAGRAPHS]


def bleu(hypotheses: list[str]) -> float:
    references = [" ".join(TEST_REFERENCES[i] for i in chosen) for chosen, _ in PARAGRAPHS]
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


# Requests of at most max_translate_sentences (64): paragraphs of 2-9 sentences (44), then 10-12 (33).
# Each is more than the sentences_in_flight window and than the test translator's queue holds.
REQUESTS = [[text for _, text in PARAGRAPHS[:8]], [text for _, text in PARAGRAPHS[8:]]]


def test_paragraphs_keep_every_sentence_on_v1_translate(service_url: str, one_by_one: dict[int, str]) -> None:
    translations = []
    for texts in REQUESTS:
        translations += httpx.post(f"{service_url}/v1/translate", json={"text": texts}, timeout=300).json()["translations"]
    for (chosen, text), translation in zip(PARAGRAPHS, translations, strict=True):
        sentences = translation["sentences"]
        assert len(sentences) == len(chosen)  # as many translated sentences as the paragraph had
        assert [text[a:b] for a, b in (s["source"] for s in sentences)] == [TEST_SOURCES[i] for i in chosen]  # in order
        assert [s["text"] for s in sentences] == [one_by_one[i] for i in chosen]
        assert translation["finish_reason"] == "stop"
    hypotheses = [t["text"] for t in translations]
    assert hypotheses == expected_paragraphs(one_by_one)
    assert abs(bleu(hypotheses) - bleu(expected_paragraphs(one_by_one))) <= 1.0


@pytest.mark.parametrize("body", ["json", "form", "multipart"])
def test_paragraphs_keep_every_sentence_on_libretranslate(service_url: str, one_by_one: dict[int, str], body: str) -> None:
    hypotheses = []
    for texts in REQUESTS:
        if body == "json":
            response = httpx.post(f"{service_url}/translate", json={"q": texts, "source": "en", "target": "de"}, timeout=300)
        elif body == "form":
            response = httpx.post(f"{service_url}/translate", data={"q": texts, "source": "en", "target": "de"}, timeout=300)
        else:  # multipart/form-data, as browser forms and some clients send it
            files = [*(("q", (None, t)) for t in texts), ("source", (None, "en")), ("target", (None, "de"))]
            response = httpx.post(f"{service_url}/translate", files=files, timeout=300)
        assert response.status_code == 200, response.text
        hypotheses += response.json()["translatedText"]
    assert hypotheses == expected_paragraphs(one_by_one)
    assert abs(bleu(hypotheses) - bleu(expected_paragraphs(one_by_one))) <= 1.0


def test_libretranslatepy_client_translates_a_paragraph_and_detects(service_url: str, one_by_one: dict[int, str]) -> None:
    api = LibreTranslateAPI(f"{service_url}/")
    chosen, text = PARAGRAPHS[3]
    assert api.translate(text, "en", "de") == " ".join(one_by_one[i] for i in chosen)
    assert api.translate(text, "auto", "de") == " ".join(one_by_one[i] for i in chosen)
    assert api.detect("Ein Mann fährt mit dem Fahrrad die Straße entlang.")[0]["language"] == "de"
    assert {"code": "en", "name": "English", "targets": ["de"]} in api.languages()


def test_whitespace_line_breaks_and_blank_lines_survive(service_url: str, one_by_one: dict[int, str]) -> None:
    chosen = PARAGRAPHS[2][0]
    a, b, c, d = (TEST_SOURCES[i] for i in chosen[:4])
    text = f"  {a}\n{b}\n\n\t{c}  {d}\r\n\r\n"
    answer = httpx.post(f"{service_url}/v1/translate", json={"text": text}, timeout=120).json()["translations"][0]
    ta, tb, tc, td = (one_by_one[i] for i in chosen[:4])
    assert answer["text"] == f"  {ta}\n{tb}\n\n\t{tc}  {td}\r\n\r\n"


ADVERSARIAL = [
    "Dr. Smith and Mrs. Jones met at 5 p.m. on Main St. near the U.S. embassy. They talked, e.g. about dogs.",
    "The bike costs $1,234.56, about 3.5% more than in 2021. It weighs 12.5 kg.",
    'He said, "Stop. Go home." Then he left. "Why?" she asked.',
    "Wait... what happened? I don't know... Maybe nothing.",
    "Shopping list:\n- apples\n- two pears\n* a bag of rice\n\n1. Go home.\n2. Cook dinner",
    "A man rides a bike. Two dogs run behind him",
    " ".join(["a man in a red shirt rides a bike down the street while two dogs run behind him"] * 38),  # 3,000+ chars, no stop
]


def assert_maps_every_character(text: str, translation: dict[str, Any]) -> None:
    """Every input character is in exactly one translated sentence, or is whitespace kept as is
    between them; the output is exactly the sentences' translations joined by that whitespace."""
    spans = [tuple(s["source"]) for s in translation["sentences"]]
    rebuilt, position = "", 0
    for (start, end), sentence in zip(spans, translation["sentences"], strict=True):
        assert position <= start < end <= len(text)
        assert text[position:start].strip() == ""  # only whitespace is left out of sentences
        assert text[start:end].strip() == text[start:end]
        assert sentence["text"].strip() and sentence["finish_reason"] in ("stop", "length")
        rebuilt += text[position:start] + sentence["text"]
        position = end
    assert text[position:].strip() == ""
    assert translation["text"] == rebuilt + text[position:]
    # A piece the model could not finish within max_tokens is said so, for the whole text too.
    cut = any(s["finish_reason"] == "length" for s in translation["sentences"])
    assert translation["finish_reason"] == ("length" if cut else "stop")


@pytest.mark.parametrize(
    "text", ADVERSARIAL, ids=["abbreviations", "numbers", "quotes", "ellipses", "lists", "no-final-stop", "3000-chars"]
)
def test_adversarial_splitting_drops_and_duplicates_nothing(service_url: str, text: str) -> None:
    response = httpx.post(f"{service_url}/v1/translate", json={"text": text, "beam_size": 1}, timeout=300)
    assert response.status_code == 200, response.text
    translation = response.json()["translations"][0]
    assert_maps_every_character(text, translation)
    pieces = [text[a:b] for a, b in (s["source"] for s in translation["sentences"])]
    assert all(len(p) <= MAX_SENTENCE_CHARS for p in pieces)
    if len(text) > 3000:
        assert len(pieces) >= 3000 // MAX_SENTENCE_CHARS  # cut, never truncated


def test_translation_limits_name_what_was_exceeded(service_url: str) -> None:
    too_long = httpx.post(f"{service_url}/v1/translate", json={"text": ["A dog runs."] * 2 + ["x" * TEST_CONFIG.max_translate_chars]})
    assert too_long.status_code == 400 and f"limit is {TEST_CONFIG.max_translate_chars}" in too_long.json()["error"]["message"]
    sentences = " ".join(["A dog runs."] * (TEST_CONFIG.max_translate_sentences + 1))
    too_many = httpx.post(f"{service_url}/translate", json={"q": sentences, "source": "en", "target": "de"})
    assert too_many.status_code == 400
    limit = TEST_CONFIG.max_translate_sentences
    assert too_many.json() == {"error": f"q has {limit + 1} sentences; the limit is {limit} per request"}


def test_a_sentence_cut_by_max_tokens_says_so(service_url: str) -> None:
    text = f"{TEST_SOURCES[WHOLE[0]]} {TEST_SOURCES[WHOLE[1]]}"
    answer = httpx.post(f"{service_url}/v1/translate", json={"text": text, "max_tokens": 2}, timeout=60).json()
    assert answer["translations"][0]["finish_reason"] == "length"


def test_multi_sentence_stream_arrives_in_order(service_url: str, one_by_one: dict[int, str]) -> None:
    chosen, text = PARAGRAPHS[2]
    greedy = httpx.post(f"{service_url}/v1/translate", json={"text": text, "beam_size": 1}, timeout=120).json()["translations"][0]
    frames = stream_data(f"{service_url}/v1/translate", {"text": text, "stream": True}, timeout_s=120)
    assert frames[-1] == "[DONE]"
    parsed = [json.loads(f) for f in frames[:-1]]
    assert "".join(f["text"] for f in parsed) == greedy["text"]
    assert all(f["finish_reason"] is None for f in parsed[:-1]) and parsed[-1]["finish_reason"] == "stop"
    assert parsed[-1]["usage"]["prompt_tokens"] > 0
    assert len(parsed) > len(chosen)


HTML = """<!DOCTYPE html>
<html><head><title>Dogs</title><style>p > b { color: red; }</style>
<script>var note = "A man is riding a bike."; if (a < b && c) { run(); }</script></head>
<body><h1>Two dogs play in the park.</h1>
<p class="lead">A <b>man</b> in a <i>red <a href="/shirts?size=m&amp;color=red" title="A red shirt">shirt</a></i> rides a bike &amp; smiles.
A woman is reading a book.</p>
<pre>keep   this text
  as it is.</pre><p>Run <code>a dog runs.</code> now.</p><!-- A man is riding a bike. -->
<ul><li>A child plays.</li><li>Two men talk&nbsp;outside.</li></ul><p>&nbsp;</p></body></html>"""


def tags(document: str) -> list[str]:
    """The markup of a document in order: tags (with attributes), comments and declarations."""
    return re.findall(r"<[^>]*>", re.sub(r"<script>.*?</script>", "<script></script>", document, flags=re.S))


def test_html_keeps_markup_script_and_code_and_translates_the_text(service_url: str) -> None:
    response = httpx.post(f"{service_url}/translate", json={"q": HTML, "source": "en", "target": "de", "format": "html"}, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()["translatedText"]
    assert tags(out) == tags(HTML)  # same tags, attributes, nesting and order
    for untouched in (
        '<script>var note = "A man is riding a bike."; if (a < b && c) { run(); }</script>',
        "<style>p > b { color: red; }</style>",
        "<pre>keep   this text\n  as it is.</pre>",
        "<code>a dog runs.</code>",
        "<!-- A man is riding a bike. -->",
        'href="/shirts?size=m&amp;color=red"',
        "<p>&nbsp;</p>",
    ):
        assert untouched in out
    visible = re.sub(r"<(script|style|pre|code)>.*?</\1>|<[^>]*>", " ", out, flags=re.S)
    for english in ("dogs", "man", "woman", "book", "child", "outside"):
        assert not re.search(rf"\b{english}\b", visible), english
    assert not re.search(r"&(?!\w+;|#\d+;)", re.sub(r"<script>.*?</script>", "", out, flags=re.S))  # text escaped again
    v1 = httpx.post(f"{service_url}/v1/translate", json={"text": HTML, "format": "html"}, timeout=120).json()["translations"][0]
    assert v1["text"] == out


LANGUAGE_SAMPLES = {lang: read_lines(SHARED_DATA / "multi30k" / f"test_2016_flickr.{lang}.gz")[:20] for lang in ("en", "de", "fr", "cs")}


@pytest.mark.parametrize("language", ["en", "de", "fr", "cs"])
def test_detect_names_the_language_of_short_sentences(service_url: str, language: str) -> None:
    for sentence in LANGUAGE_SAMPLES[language]:
        response = httpx.post(f"{service_url}/detect", json={"q": sentence})
        assert response.status_code == 200
        best = response.json()[0]
        assert best["language"] == language, sentence
        assert 0 < best["confidence"] <= 100


def test_auto_source_refuses_french_naming_it(service_url: str) -> None:
    french = LANGUAGE_SAMPLES["fr"][0]
    response = httpx.post(f"{service_url}/translate", data={"q": french, "source": "auto", "target": "de"})
    assert response.status_code == 400 and "French" in response.json()["error"]
    v1 = httpx.post(f"{service_url}/v1/translate", json={"text": french, "source_lang": "auto"})
    assert v1.status_code == 400 and v1.json()["error"]["param"] == "source_lang" and "French" in v1.json()["error"]["message"]
    english = httpx.post(f"{service_url}/translate", json={"q": TEST_SOURCES[0], "source": "auto", "target": "de"}, timeout=60).json()
    assert english["detectedLanguage"]["language"] == "en"


def test_frontend_settings_and_completions_without_a_model(service_url: str) -> None:
    settings = httpx.get(f"{service_url}/frontend/settings").json()
    assert settings["charLimit"] == TEST_CONFIG.max_translate_chars
    assert settings["language"]["source"]["code"] == "en" and settings["language"]["target"]["code"] == "de"
    completion = httpx.post(f"{service_url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert completion.status_code == 200 and completion.json()["model"] == TEST_CONFIG.generator.name
