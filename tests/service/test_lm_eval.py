"""lm-evaluation-harness against the running service: its local-completions client, unchanged,
scores evals/shakespeare_next_line through POST /v1/completions (token id prompts, echo, logprobs),
and every loglikelihood it logs is our model's, computed offline."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from exports.export import export_hf
from loading.checkpoint import DEFAULT_GENERATOR, load_native_checkpoint
from loading.tokenizer import Tokenizer
from model.generator import Generator
from tests.helpers import ROOT

TASK = "shakespeare_next_line"
TASK_DIR = ROOT / "evals" / TASK
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def task_documents() -> list[dict[str, Any]]:
    """The task's documents, from the module lm-eval loads (evals is no package)."""
    spec = importlib.util.spec_from_file_location("next_lines", TASK_DIR / "next_lines.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.next_line_documents()["test"])


def offline_loglikelihood(model: Generator, tokenizer: Tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context), the pair split into tokens as lm-eval's TemplateLM._encode_pair
    splits it: the context's trailing whitespace moves to the continuation, and the continuation's
    tokens are those of the whole text after as many as the context alone has."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = torch.tensor(tokenizer.encode(context + continuation))
    n = len(tokenizer.encode(context))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(whole[None])[0].float(), dim=-1)
    return logprobs[n - 1 : -1].gather(1, whole[n:, None]).double().sum().item()


def run_lm_eval(url: str, tokenizer: dict[str, object], output: Path) -> None:
    """lm-eval's CLI from this environment, on the task, one request at a time, with `tokenizer`'s
    model arguments; fails with its output."""
    model_args = {
        "model": "transformer-shakespeare",
        "base_url": f"{url}/v1/completions",
        **tokenizer,
        "tokenized_requests": True,
        "max_length": 256,  # the generator's window
        "num_concurrent": 1,
        "max_retries": 1,
        "timeout": 60,
    }
    command = [
        str(Path(sys.executable).parent / "lm_eval"),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        ",".join(f"{k}={v}" for k, v in model_args.items()),
        "--tasks",
        TASK,
        "--include_path",
        str(ROOT / "evals"),
        "--batch_size",
        "1",
        "--log_samples",
        "--output_path",
        str(output),
    ]
    done = subprocess.run(command, env=os.environ | OFFLINE, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_loglikelihoods_are_the_models(service_url: str, tmp_path: Path, backend: str) -> None:
    """backend: lm-eval's tokenizer, a folder of the model's (exported) or the service's own
    (vLLM's /tokenize, /detokenize and /tokenizer_info)."""
    tokenizer: dict[str, object] = {"tokenizer_backend": backend}
    if backend == "huggingface":
        export_hf(DEFAULT_GENERATOR, tmp_path / "hf-generator")
        tokenizer["tokenizer"] = tmp_path / "hf-generator"
    run_lm_eval(service_url, tokenizer, tmp_path / "results")

    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    scores = results["results"][TASK]
    assert 0 <= scores["acc,none"] <= 1 and 0 <= scores["acc_norm,none"] <= 1, scores
    lines = next((tmp_path / "results").rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()
    samples = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == task_documents()

    model, tokenizer = load_native_checkpoint(DEFAULT_GENERATOR)
    assert isinstance(model, Generator)
    differences = []
    for sample in samples:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        # Logged as {"gen_args_<i>": {"arg_0": context, "arg_1": continuation}} and [["<loglikelihood>", "<is greedy>"]].
        for pair, (served, _) in zip(sample["arguments"].values(), sample["filtered_resps"], strict=True):
            offline = offline_loglikelihood(model, tokenizer, pair["arg_0"], pair["arg_1"])
            differences.append(abs(float(served) - offline))
    print(f"\n{TASK}: {len(differences)} loglikelihoods, max |served - offline| {max(differences):.2e}, scores {scores}")
    assert max(differences) <= 1e-4
