"""`python -m service --model NAME=PATH ...` serves the user's own folders, as a user starts it: a
Hugging Face MarianMT (en -> fr) and GPT-NeoX built in the test, beside the shipped en -> de
translator. Its answers equal transformers' on the same folders, and two translators route by pair."""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from loadtests.cluster import free_port
from model.data import SHARED_DATA, read_lines
from model.paths import DEFAULT_TRANSLATOR
from model.translate import max_new_tokens_for
from tests.hf_folders import build_gpt_neox_folder, build_marian_folder

START_TIMEOUT_S = 300.0  # a bound on a broken start, not a speed limit
SENTENCES = 100


@dataclass(frozen=True)
class Served:
    url: str
    marian: Path
    neox: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folders = tmp_path_factory.mktemp("own-models")
    marian, neox = build_marian_folder(folders / "opus-mt-en-fr"), build_gpt_neox_folder(folders / "pythia-tiny")
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "service", "--port", str(port), "--metrics-port", str(metrics_port), "--device", "cpu"]
    command += [
        "--torch-threads",
        "1",
        "--model",
        f"opus-en-fr={marian}",
        "--model",
        str(neox),
        "--model",
        f"transformer-en-de={DEFAULT_TRANSLATOR}",
    ]
    environment = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as a user's command starts
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    assert process.stdout is not None
    url, lines = f"http://127.0.0.1:{port}", []
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for line in process.stdout:  # the command prints "Serving on" once every model is ready
            lines.append(line)
            if line.startswith("Serving on"):
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        assert process.poll() is None, "".join(lines[-30:])
        yield Served(url, marian, neox)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_models_lists_exactly_the_folders_given(served: Served) -> None:
    cards = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["kind"], c["source_lang"], c["target_lang"]) for c in cards] == [
        ("opus-en-fr", "translator", "en", "fr"),
        ("pythia-tiny", "generator", None, None),  # named after its folder
        ("transformer-en-de", "translator", "en", "de"),
    ]


def test_libretranslate_offers_and_routes_both_pairs(served: Served) -> None:
    languages = httpx.get(f"{served.url}/languages", timeout=30).json()
    assert {"code": "en", "name": "English", "targets": ["fr", "de"]} in languages
    french = httpx.post(f"{served.url}/translate", json={"q": "A dog runs.", "source": "en", "target": "fr"}, timeout=60)
    german = httpx.post(f"{served.url}/translate", json={"q": "A dog runs.", "source": "en", "target": "de"}, timeout=60)
    assert french.status_code == german.status_code == 200
    assert german.json()["translatedText"] == "Ein Hund rennt."  # the shipped model's answer
    marian_beam = translate(served.url, ["A dog runs."], "opus-en-fr", beam_size=4)
    assert french.json()["translatedText"] == marian_beam[0]  # LibreTranslate's default beam, by the folder's pair


def translate(url: str, sentences: list[str], model: str, beam_size: int) -> list[str]:
    texts = []
    for i in range(0, len(sentences), 32):
        body = {"model": model, "text": sentences[i : i + 32], "beam_size": beam_size}
        answer = httpx.post(f"{url}/v1/translate", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        texts += [t["text"] for t in answer.json()["translations"]]
    return texts


@torch.inference_mode()
def transformers_translate(folder: Path, sentences: list[str], beam_size: int) -> list[str]:
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    texts = []
    for sentence in sentences:
        ids = tokenizer(sentence, return_tensors="pt")["input_ids"]  # with </s>, as the service's source
        limit = max_new_tokens_for(ids.shape[1], model.config.max_position_embeddings)
        beam = {"num_beams": beam_size, "length_penalty": 1.0, "early_stopping": True} if beam_size > 1 else {}
        out = model.generate(input_ids=ids, max_new_tokens=limit, do_sample=False, **beam)
        texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return texts


def test_marian_greedy_and_beam_through_the_service_equal_transformers(served: Served) -> None:
    sentences = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")[:SENTENCES]
    assert translate(served.url, sentences, "opus-en-fr", 1) == transformers_translate(served.marian, sentences, 1)
    ours, theirs = translate(served.url, sentences, "opus-en-fr", 4), transformers_translate(served.marian, sentences, 4)
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    assert same >= 0.95 * len(sentences), [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b][:3]


@torch.inference_mode()
def test_gpt_neox_greedy_completions_equal_transformers(served: Served) -> None:
    tokenizer, model = AutoTokenizer.from_pretrained(served.neox), AutoModelForCausalLM.from_pretrained(served.neox).eval()
    for prompt in ["ROMEO:\n", "First Citizen:\nBefore we proceed", "Thou art café naïve"]:
        body = {"model": "pythia-tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert answer["choices"][0]["text"] == expected, prompt
