"""Our engine against llama.cpp on the same GGUF files, one thread each, side by side in one run.

    python -m benchmarks.gguf [--folder DIR] [--types Q8_0,Q4_1,Q4_0] [--json [FILE]] [--repeats 3]

The files: --folder (default: benchmarks.vs_vllm's random-weight folder of SmolLM2-135M's shape,
built there when missing: 30 layers, width 576, 9 query and 3 KV heads, 49,152-token byte-level
BPE vocabulary, tied embeddings) written by exports.gguf in each type into runs/gguf/ (once).
llama.cpp is llama-cpp-python 0.3.36 (installed into this environment on first use: it builds
llama.cpp from source for this CPU, a few minutes), n_threads 1; ours is the Engine, stepped in
this process, over load_gguf's model with torch's 1 thread, 8-bit activations
(EngineConfig.activation_bits' default), speculative decoding off (llama.cpp has none by default;
random weights' repetitive answers would flatter it): eager steps ("ours"), and ("ours_compiled")
with the decode step at batch 1 compiled (EngineConfig.compiled_decode (1,), what `--compiled-decode
1` serves; compiled when its engine is made, before any timing: a minute or three per file the
first time, less from torch's caches).

Per file, the systems taking turns for --repeats rounds, each keeping its best:
- decode_tok_s: greedy decoding at batch 1, 128 tokens after a 16-token prompt, timed after the
  prompt (llama.cpp: its eval of one token at a time, the next picked by argmax of its logits;
  ours: one request, ignore_eos, its 128 steps after the prompt's; each system's engine and KV
  pool made once, before any timing, as llama.cpp's context);
- prompt_tok_s: a 512-token prompt's prefill (llama.cpp: one eval of n_batch 512; ours: a request
  for one token, its steps to the first token);
- top1_agreement: the share of a 256-token prompt's positions whose most likely next token is the
  same in ours' logits (one row a step, as decoding computes them) and llama.cpp's, with 8-bit
  activations as llama.cpp's and (_float_activations) float32 ones, and the largest logit difference;
  top1_agreement_llama_cpp_with_itself: the same share between llama.cpp's logits for the prompt
  evaluated at once and one token at a time (n_batch 1): how often the random weights' near-tied
  logits (median margin about 0.07) let a change of summation order alone change the top token;
- resident_weight_bytes: ours' model's tensors, against the file's size.

Prints a table; --json writes the figures (default benchmarks/results/gguf_llama_cpp.json), each
ratio ours / llama.cpp (<figure>_ratio; decode_tok_s_compiled_ratio for the compiled step), the CPU named.
"""

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.provenance import commit, machine
from benchmarks.vs_vllm import DEFAULT, build_folder
from decoding.sampling_params import GREEDY
from exports.gguf import export_gguf
from loading.gguf_load import load_gguf
from model import block_quant
from model.block_quant import set_activation_bits
from model.packed_linear import pack_linear_layers, packing_available
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from service.engine.runner import runner_for

ROOT = Path(__file__).resolve().parent.parent
FILES = ROOT / "runs" / "gguf"
RESULTS = ROOT / "benchmarks" / "results" / "gguf_llama_cpp.json"
LLAMA_CPP = "llama-cpp-python==0.3.36"
DECODE_TOKENS, DECODE_PROMPT, PROMPT_TOKENS, AGREEMENT_TOKENS = 128, 16, 512, 256


def ensure_llama_cpp() -> None:
    """Installs llama-cpp-python (built from source for this CPU, no OpenMP: one thread) when missing."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    print(f"installing {LLAMA_CPP} (builds llama.cpp: a few minutes)", flush=True)
    environment = {"CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF", "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    subprocess.run([sys.executable, "-m", "pip", "install", LLAMA_CPP], check=True, env={**os.environ, **environment})


def gguf_file(folder: Path, kind: str, stem: str | None = None) -> Path:
    """runs/gguf/<stem>-<kind>.gguf (stem: the folder's name), written from folder when missing."""
    path = FILES / f"{stem or folder.name}-{kind}.gguf"
    if not path.is_file():
        FILES.mkdir(parents=True, exist_ok=True)
        export_gguf(folder, path, kind)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    """n random ids of the tokenizer's few hundred (the folder's other embedding rows are zero)."""
    return torch.randint(3, 800, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class LlamaCpp:
    """llama.cpp over one file, one thread; kv_type: its KV cache's ggml type (1, F16: its default; 0, F32: ours')."""

    def __init__(self, path: Path, n_batch: int = PROMPT_TOKENS, kv_type: int = 1) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_threads=1,
            n_threads_batch=1,
            n_ctx=1024,
            n_batch=n_batch,
            logits_all=True,
            verbose=False,
            type_k=kv_type,
            type_v=kv_type,
        )

    def decode(self, prompt: list[int]) -> float:
        self.llm.reset()
        self.llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            self.llm.eval([int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))])
        return DECODE_TOKENS / (time.perf_counter() - start)

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - start)

    def logits(self, prompt: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(prompt)
        return np.array(self.llm.scores[: len(prompt)])


class Ours:
    def __init__(self, path: Path, activation_bits: int, compiled: bool = False) -> None:
        self.model, self.tokenizer = load_gguf(path)
        set_activation_bits(self.model, activation_bits)  # what Engine.from_checkpoint does (EngineConfig's)
        if packing_available():
            pack_linear_layers(self.model)  # and this: the float layers (norms stay)
        self.compiled = compiled
        self._requests = 0

    @functools.cached_property
    def engine(self) -> Engine:
        """Made at the first request (the warm-up's, before any timing): its KV pool, its step
        compiled. The float-activation system only gives logits and makes none."""
        compiled = (1,) if self.compiled else ()
        config = EngineConfig(n_slots=1, queue_timeout_s=None, request_timeout_s=None, num_speculative_tokens=0, compiled_decode=compiled)
        return Engine(runner_for(self.model, self.tokenizer, config), config)

    def _started(self, prompt: list[int], max_tokens: int) -> Engine:
        """The engine holding one more greedy request, not yet stepped."""
        self._requests += 1
        params = GenerationParams(max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)
        self.engine.add_request(Request(f"timed-{self._requests}", prompt, params))
        return self.engine

    def decode(self, prompt: list[int]) -> float:
        """The decode steps after the prompt's step, as llama.cpp's evals after its prompt's."""
        engine = self._started(prompt, DECODE_TOKENS + 1)
        while not any(d.token_ids for d in engine.step().deltas):  # the prompt's step: its first token
            pass
        start, made = time.perf_counter(), 0
        while engine.has_work:
            made += sum(len(d.token_ids) for d in engine.step().deltas)
        assert made == DECODE_TOKENS
        return made / (time.perf_counter() - start)

    def prefill(self, prompt: list[int]) -> float:
        """The prompt's steps, to its first token."""
        engine = self._started(prompt, 1)
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        return len(prompt) / (time.perf_counter() - start)

    def logits(self, prompt: list[int]) -> np.ndarray:
        """Each position's next-token logits with the activations of a decode step (8-bit ones
        through the kernel for every row: a row's products do not depend on the other rows)."""
        rows, block_quant.KERNEL_ROWS = block_quant.KERNEL_ROWS, len(prompt)
        try:
            with torch.no_grad():
                return self.model(torch.tensor([prompt]))[0].numpy()
        finally:
            block_quant.KERNEL_ROWS = rows

    def resident_bytes(self) -> int:
        held = {t.data_ptr(): t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()]}
        return sum(held.values())


def measure(path: Path, repeats: int) -> dict[str, Any]:
    llama, ours, ours_compiled, ours_float = LlamaCpp(path), Ours(path, 8), Ours(path, 8, compiled=True), Ours(path, 32)
    figures: dict[str, Any] = {"file": path.name, "file_bytes": path.stat().st_size}
    systems: list[tuple[str, LlamaCpp | Ours]] = [("llama_cpp", llama), ("ours", ours), ("ours_compiled", ours_compiled)]
    for _, system in systems:
        system.decode(prompt_ids(DECODE_PROMPT, 0))  # warm-up
        system.prefill(prompt_ids(PROMPT_TOKENS, 1))
    best: dict[str, float] = {}
    for turn in range(repeats):
        for name, system in systems:
            decode = system.decode(prompt_ids(DECODE_PROMPT, 10 + turn))
            best[f"decode_tok_s_{name}"] = max(best.get(f"decode_tok_s_{name}", 0.0), decode)
            if name != "ours_compiled":  # a prompt's steps are eager in both
                prefill = system.prefill(prompt_ids(PROMPT_TOKENS, 20 + turn))
                best[f"prompt_tok_s_{name}"] = max(best.get(f"prompt_tok_s_{name}", 0.0), prefill)
    figures |= {key: round(value, 1) for key, value in best.items()}
    for figure in ("decode_tok_s", "prompt_tok_s"):
        figures[f"{figure}_ratio"] = round(best[f"{figure}_ours"] / best[f"{figure}_llama_cpp"], 2)
    figures["decode_tok_s_compiled_ratio"] = round(best["decode_tok_s_ours_compiled"] / best["decode_tok_s_llama_cpp"], 2)
    prompt = prompt_ids(AGREEMENT_TOKENS, 99)
    theirs = llama.logits(prompt)
    for name, system in [("", ours), ("_float_activations", ours_float)]:
        mine = system.logits(prompt)
        figures[f"top1_agreement{name}"] = round(float((theirs.argmax(-1) == mine.argmax(-1)).mean()), 4)
        figures[f"max_logit_difference{name}"] = round(float(np.abs(theirs - mine).max()), 4)
    one_at_a_time = LlamaCpp(path, n_batch=1).logits(prompt)
    figures["top1_agreement_llama_cpp_with_itself"] = round(float((theirs.argmax(-1) == one_at_a_time.argmax(-1)).mean()), 4)
    figures["resident_weight_bytes"] = ours.resident_bytes()
    figures["resident_over_file"] = round(figures["resident_weight_bytes"] / figures["file_bytes"], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=None, help="a Llama-family folder (default: vs_vllm's SmolLM2-135M-shape folder)")
    parser.add_argument("--types", default="Q8_0,Q4_1,Q4_0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", nargs="?", const=RESULTS, default=None, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ensure_llama_cpp()
    folder = args.folder or build_folder(DEFAULT.folder, DEFAULT.shape, DEFAULT.model)
    results = [measure(gguf_file(folder, kind), args.repeats) for kind in args.types.split(",")]
    print(f"{'file':34} {'decode tok/s llama.cpp / ours / compiled':>48} {'prompt tok/s':>24} {'top-1':>7} {'resident/file':>14}")
    for r in results:
        decode = f"{r['decode_tok_s_llama_cpp']} / {r['decode_tok_s_ours']} ({r['decode_tok_s_ratio']}x)"
        decode += f" / {r['decode_tok_s_ours_compiled']} ({r['decode_tok_s_compiled_ratio']}x)"
        prompt = f"{r['prompt_tok_s_llama_cpp']} / {r['prompt_tok_s_ours']} ({r['prompt_tok_s_ratio']}x)"
        print(f"{r['file']:34} {decode:>48} {prompt:>24} {r['top1_agreement']:>7} {r['resident_over_file']:>14}")
    if args.json:
        document = {"commit": commit(), "machine": machine(), "llama_cpp": LLAMA_CPP, "threads": 1, "folder": str(folder), "files": results}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
