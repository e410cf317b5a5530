"""Logprobs through the real service equal the shipped generator's log-softmax computed offline:
the prompt's (echo, from the prefill) and the generated tokens' (from the step's logits), and
their sum is what `python -m training.evaluate lm` scores for the text."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F

from loading.checkpoint import load_native_checkpoint
from model.paths import DEFAULT_GENERATOR
from tests.helpers import TEST_CONFIG
from training.data import SHARED_DATA, split_shakespeare

GENERATOR = TEST_CONFIG.generator.name

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # float32 on both sides; the service's packed linear layers add rounding only


def unseen_text() -> str:
    """The first 600 characters of the held-out plays (under the generator's 256-token context)."""
    _, validation = split_shakespeare((SHARED_DATA / "tinyshakespeare" / "train.txt").read_text(encoding="utf-8"))
    return validation[:600]


def offline_logprobs(ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, by the model loaded here: (len(ids) - 1,)."""
    model, _ = load_native_checkpoint(DEFAULT_GENERATOR)
    with torch.no_grad():
        log_probs = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), dim=-1)[0]  # (T - 1, V)
    return log_probs.gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0]


def test_echo_logprobs_equal_the_offline_log_softmax_and_sum_to_model_evaluate_lm(service_url: str, tmp_path: Path) -> None:
    text = unseen_text()
    body = {"model": GENERATOR, "prompt": text, "echo": True, "max_tokens": 0, "logprobs": 1}
    answer = httpx.post(f"{service_url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    _, tokenizer = load_native_checkpoint(DEFAULT_GENERATOR)
    ids = tokenizer.encode(text)
    assert 100 < len(ids) <= 256 and len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    served = torch.tensor(logprobs["token_logprobs"][1:])
    expected = offline_logprobs(ids)
    assert (served - expected).abs().max() <= TOLERANCE, (served - expected).abs().max()
    # The top alternative is the most likely token: never below the token's own logprob.
    assert all(max(top.values()) >= lp - TOLERANCE for top, lp in zip(logprobs["top_logprobs"][1:], served.tolist(), strict=True))

    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    command = [sys.executable, "-m", "training.evaluate", "lm", "--text", str(tmp_path / "text.txt"), "--device", "cpu"]
    printed = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300).stdout
    scores = json.loads(printed.splitlines()[-1])
    assert scores["tokens"] == len(ids) - 1
    assert abs(-float(served.sum()) - scores["nll"]) <= TOLERANCE * len(ids), (float(served.sum()), scores["nll"])


def test_a_greedy_completions_logprobs_are_those_of_the_logits_it_was_sampled_from(service_url: str) -> None:
    prompt = "ROMEO:\nWhat light"
    body = {"model": GENERATOR, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    answer = httpx.post(f"{service_url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    logprobs = choice["logprobs"]
    # Greedy decoding offline, token by token (the generator suppresses no ids, and 12 tokens of
    # this prompt never reach eos: the answer ends by length).
    model, tokenizer = load_native_checkpoint(DEFAULT_GENERATOR)
    ids, expected = tokenizer.encode(prompt), []
    with torch.no_grad():
        for _ in range(12):
            log_probs = F.log_softmax(model(torch.tensor([ids])).float()[0, -1], dim=-1)  # (V,)
            ids.append(int(log_probs.argmax()))
            expected.append(float(log_probs[ids[-1]]))
    generated = ids[-12:]
    assert choice["finish_reason"] == "length"
    assert logprobs["tokens"] == [tokenizer.piece_bytes(i).decode("utf-8", errors="replace") for i in generated]
    assert "".join(logprobs["tokens"]) == choice["text"]
    served = torch.tensor(logprobs["token_logprobs"])
    assert (served - torch.tensor(expected)).abs().max() <= TOLERANCE, (served, expected)
    for top, token, lp in zip(logprobs["top_logprobs"], logprobs["tokens"], served.tolist(), strict=True):
        assert len(top) == 3 and top[token] == lp and max(top.values()) == lp  # greedy: the token is the most likely
