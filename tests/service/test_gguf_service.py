"""`python -m service --model NAME=FILE.gguf --model NAME=FOLDER --quantization q4_0`, as a user
starts it: a Llama folder built in the test served once as a Q4_1 GGUF file (written by
exports.gguf) and once quantized to Q4_0 at load. Through the official openai client, their
greedy completions and chats are what the offline engine computes on the same file and folder
with the service's defaults (the blocks, 8-bit activations); the chat template comes from the file."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from decoding.sampling_params import GREEDY
from exports.gguf import export_gguf
from loading.checkpoint import load_checkpoint
from loading.gguf_load import load_gguf
from model.block_quant import BlockLinear, set_activation_bits
from service.engine.config import EngineConfig
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from tests.helpers import python_m_service
from tests.hf_folders import build_llama_folder

PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak."]
CHAT = [{"role": "user", "content": "What light through yonder window breaks?"}]


@dataclass(frozen=True)
class Served:
    url: str
    gguf: Path
    folder: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("gguf-service")
    folder = build_llama_folder(root / "llama-tiny")
    gguf = export_gguf(folder, root / "llama-tiny-Q4_1.gguf", "Q4_1")
    with python_m_service({"from-gguf": gguf, "quantized": folder}, ("--quantization", "q4_0")) as url:
        yield Served(url, gguf, folder)


def offline(served: Served, name: str) -> OfflineEngine:
    """The offline engine on what the service serves under `name`, with the service's activations."""
    model, tokenizer = load_gguf(served.gguf) if name == "from-gguf" else load_checkpoint(served.folder, "cpu", "q4_0")
    assert any(isinstance(m, BlockLinear) for m in model.modules())
    set_activation_bits(model, EngineConfig().activation_bits)
    return OfflineEngine(model, tokenizer, n_slots=2)


def test_both_models_are_listed(served: Served) -> None:
    cards = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["kind"]) for c in cards] == [("from-gguf", "generator"), ("quantized", "generator")]


@pytest.mark.parametrize("name", ["from-gguf", "quantized"])
def test_completions_and_chats_are_the_offline_engines(served: Served, name: str) -> None:
    engine = offline(served, name)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        answer = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0)
        [expected] = engine.generate([prompt], GenerationParams(max_tokens=24, sampling=GREEDY))
        assert answer.choices[0].text == expected.text and answer.usage is not None
        assert answer.usage.completion_tokens == len(expected.token_ids) > 0
    chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    rendered = engine.tokenizer.render_chat(CHAT)  # type: ignore[arg-type]  # the file's template, or the folder's
    [expected] = engine.generate([engine.tokenizer.encode(rendered)], GenerationParams(max_tokens=16, sampling=GREEDY))
    assert chat.choices[0].message.content == expected.text
