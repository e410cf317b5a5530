"""`python -m service --model NAME=PATH ...` serves the user's own folders, as a user starts it: a
Hugging Face MarianMT (en -> fr), a GPT-NeoX and a Llama (grouped-query attention, untied output,
rope_theta 500000, two eos ids, a chat template, a tokenizer trained in the test) built in the
test, beside the shipped en -> de translator. Its answers equal transformers' on the same folders
(completions and chats, through the official openai client too), and two translators route by pair."""

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from decoding.translate import max_new_tokens_for
from model.paths import DEFAULT_TRANSLATOR
from service.ports import free_port
from tests.helpers import EAGER
from tests.hf_folders import build_gpt_neox_folder, build_llama_folder, build_marian_folder
from training.data import SHARED_DATA, read_lines

START_TIMEOUT_S = 300.0  # a bound on a broken start, not a speed limit
SENTENCES = 100


@dataclass(frozen=True)
class Served:
    url: str
    marian: Path
    neox: Path
    llama: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folders = tmp_path_factory.mktemp("own-models")
    marian, neox = build_marian_folder(folders / "opus-mt-en-fr"), build_gpt_neox_folder(folders / "pythia-tiny")
    llama = build_llama_folder(folders / "llama-tiny")  # 4 query heads over 2 key/value heads, untied
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "service", "--port", str(port), "--metrics-port", str(metrics_port), "--device", "cpu"]
    command += [
        *EAGER,
        "--torch-threads",
        "1",
        "--model",
        f"opus-en-fr={marian}",
        "--model",
        str(neox),
        "--model",
        f"transformer-en-de={DEFAULT_TRANSLATOR}",
        "--model",
        str(llama),
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
        yield Served(url, marian, neox, llama)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_models_lists_exactly_the_folders_given(served: Served) -> None:
    cards = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["kind"], c["source_lang"], c["target_lang"]) for c in cards] == [
        ("opus-en-fr", "translator", "en", "fr"),
        ("pythia-tiny", "generator", None, None),  # named after its folder
        ("transformer-en-de", "translator", "en", "de"),
        ("llama-tiny", "generator", None, None),
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
    # The penalties reach the engine: transformers' repetition penalty, through the service.
    body = {"model": "pythia-tiny", "prompt": "ROMEO:\n", "max_tokens": 24, "temperature": 0, "repetition_penalty": 1.5}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    ids = tokenizer("ROMEO:\n", return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.5)
    assert answer["choices"][0]["text"] == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


CHATS = [
    [{"role": "user", "content": "What light through yonder window breaks?"}],
    [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Who is there?"}],
]


@torch.inference_mode()
def test_llama_greedy_completions_equal_transformers(served: Served) -> None:
    tokenizer, model = AutoTokenizer.from_pretrained(served.llama), AutoModelForCausalLM.from_pretrained(served.llama).eval()
    for prompt in ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak."]:
        body = {"model": "llama-tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # with the bos the tokenizer adds, as the service's
        out = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)  # stops at either eos of generation_config
        assert answer["choices"][0]["text"] == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), prompt


@torch.inference_mode()
def test_llama_chats_equal_transformers_generate_on_apply_chat_template_through_the_openai_client(served: Served) -> None:
    tokenizer, model = AutoTokenizer.from_pretrained(served.llama), AutoModelForCausalLM.from_pretrained(served.llama).eval()
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    for messages in CHATS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        tokenized = httpx.post(f"{served.url}/tokenize", json={"model": "llama-tiny", "messages": messages}, timeout=60).json()
        assert tokenized["tokens"] == ids[0].tolist()  # the template rendered as transformers renders it
        out = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        chat = client.chat.completions.create(model="llama-tiny", messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == expected
        assert chat.usage is not None and chat.usage.prompt_tokens == ids.shape[1]
        stream = client.chat.completions.create(
            model="llama-tiny",
            messages=messages,
            max_completion_tokens=20,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected  # the streamed chat is the same
        assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
        # Logprobs: those of transformers' logits at each generated token.
        scored = client.chat.completions.create(
            model="llama-tiny", messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2
        )  # type: ignore[arg-type]
        assert scored.choices[0].logprobs is not None and scored.choices[0].logprobs.content is not None
        entries = scored.choices[0].logprobs.content
        generated = out[0, ids.shape[1] :].tolist()
        logits = model(out[:, :-1]).logits[0, ids.shape[1] - 1 :]  # (new tokens, V): each generated token's
        answered = torch.tensor([e.logprob for e in entries])
        if generated[-1] in model.generation_config.eos_token_id:
            generated.pop()  # the eos that ended it is no token of the content
        # Each token's text as the content has it (a special token's is empty).
        assert [e.token for e in entries] == [tokenizer.decode([t], skip_special_tokens=True) for t in generated]
        expected = torch.log_softmax(logits[: len(generated)].float(), dim=-1).gather(1, torch.tensor(generated).unsqueeze(1))[:, 0]
        assert torch.allclose(answered, expected, atol=1e-4) and all(len(e.top_logprobs) == 2 for e in entries)


@torch.inference_mode()
def test_the_playground_chats_with_the_llama_folder(served: Served) -> None:
    """The page against this service: the Llama picked among the generators, Chat mode, greedy;
    the reply shown is transformers' generate on the template's ids."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (CI installs it)")
    tokenizer, model = AutoTokenizer.from_pretrained(served.llama), AutoModelForCausalLM.from_pretrained(served.llama).eval()
    messages = CHATS[0]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page()
        page.goto(f"{served.url}/")
        sync_api.expect(page.locator("#generate-model option[value='llama-tiny']")).to_have_count(1, timeout=60_000)
        page.select_option("#generate-model", "llama-tiny")
        page.check("#chat-mode")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "20")
        page.fill("#prompt", messages[0]["content"])
        page.click("#generate-button")
        sync_api.expect(page.locator("#generated")).to_have_text(f"user: {messages[0]['content']}\nassistant: {expected}", timeout=60_000)
        browser.close()


def test_tokenizer_info_gives_the_special_tokens_a_client_can_encode_back(served: Served) -> None:
    tokenizer = AutoTokenizer.from_pretrained(served.llama)
    info = httpx.get(f"{served.url}/tokenizer_info", params={"model": "llama-tiny"}, timeout=60).json()
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 128
    for token in ("eos_token", "bos_token"):  # what lm-eval's remote tokenizer does with them
        ids = httpx.post(f"{served.url}/tokenize", json={"model": "llama-tiny", "prompt": info[token], "add_special_tokens": False}).json()
        assert ids["tokens"] == [getattr(tokenizer, f"{token}_id")]


def test_a_model_without_a_chat_template_answers_400_naming_the_reason(served: Served) -> None:
    answer = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "pythia-tiny", "messages": CHATS[0]}, timeout=60)
    assert answer.status_code == 400 and "chat template" in answer.json()["error"]["message"], answer.text


def test_a_chat_template_that_refuses_the_messages_answers_400_with_its_message(served: Served) -> None:
    """The folder's template raises for a role it does not know (raise_exception, as Mistral's and
    Llama 2's do for roles that do not alternate): a 400 in OpenAI's envelope, on chat and /tokenize, as vLLM answers."""
    messages = [{"role": "developer", "content": "Answer in verse."}, {"role": "user", "content": "Who are you?"}]
    for route, body in (("/v1/chat/completions", {"max_tokens": 4}), ("/tokenize", {})):
        answer = httpx.post(f"{served.url}{route}", json={"model": "llama-tiny", "messages": messages, **body}, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "unknown role developer" in error["message"] and error["param"] == "messages", error
