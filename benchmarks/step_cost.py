"""The engine's own cost per sequence: Engine.step in-process (no Ray, no HTTP) on the tiny Llama of
`benchmarks.vs_vllm --tiny`, where the model's arithmetic is small, at several numbers of running
sequences, greedy and sampled, each in three settings, taking turns:

- default: the engine as it serves. Greedy rows take their argmax from the panel kernel without
  the logits (GeneratorRunner._take_argmax); sampled rows get their logits a block of rows at a
  time (GeneratorRunner.block_rows) and the C kernel draws (decoding/top_k_cpu.py row_draw).
- plain: the path those kernels replaced. Greedy: the logits a block at a time, then the top-k
  kernel's argmax; sampled: the blocks drawn by torch's operations.
- whole: the logits of all rows at once (greedy: argmax kernel off; sampled: the C kernel's draw).

    python -m benchmarks.step_cost [--sequences 16,64,256] [--steps 20] [--rounds 3] [--json [FILE]]

Each setting admits N requests of 128 random prompt tokens (128 out, ignore_eos), computes their
prompts, then times `steps` decode steps, `rounds` times, the settings in turn; the median round is
kept. Prints ms per step, µs per sequence, default / plain and default / whole. One torch thread.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import commit, machine
from benchmarks.vs_vllm import TINY, build_folder
from decoding import top_k_cpu
from decoding.sampling_params import GREEDY, SamplingParams
from model.generator import Generator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner

RESULTS = Path("benchmarks/results/step_cost.json")
PROMPT_TOKENS = 128


def running_engine(folder: Path, sequences: int, sampling: SamplingParams) -> Engine:
    """An engine with `sequences` requests admitted and their prompts computed: every later step decodes them all."""
    engine = Engine.from_checkpoint(folder, EngineConfig(n_slots=sequences, max_waiting=sequences))
    rng = random.Random(0)
    vocab = engine.runner.tokenizer.vocab_size
    for i in range(sequences):
        prompt = [rng.randrange(4, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(Request(str(i), prompt, GenerationParams(max_tokens=1024, sampling=sampling, ignore_eos=True)))
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_ids) for r in engine.scheduler.running.values()):
        engine.step()
    return engine


def timed_steps(engine: Engine, steps: int) -> float:
    """Seconds per step over `steps` steps."""
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps


def measure(folder: Path, sequences: int, sampled: bool, steps: int, rounds: int) -> dict[str, Any]:
    sampling = SamplingParams(temperature=1.0, seed=0) if sampled else GREEDY
    engine = running_engine(folder, sequences, sampling)
    runner = engine.runner
    assert isinstance(runner, GeneratorRunner)
    blocks = runner.block_rows
    # name: (rows a block, whether the kernel of this kind of row runs)
    settings = {"default": (blocks, True), "plain": (blocks, False), "whole": (1 << 30, sampled)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    draw_kernel, greedy_ids = top_k_cpu.draw_kernel, Generator.greedy_ids
    try:
        for _ in range(rounds):
            for name, (rows, kernel) in settings.items():
                runner.block_rows = rows
                top_k_cpu.draw_kernel = draw_kernel if kernel or not sampled else lambda: None  # type: ignore[assignment]
                Generator.greedy_ids = greedy_ids if kernel or sampled else lambda self, hidden: None  # type: ignore[method-assign]
                timed_steps(engine, 2)  # the other setting's caches out of the way
                times[name].append(timed_steps(engine, steps))
    finally:
        top_k_cpu.draw_kernel, Generator.greedy_ids = draw_kernel, greedy_ids  # type: ignore[method-assign]
    step = {name: statistics.median(values) for name, values in times.items()}
    return {
        "sequences": sequences,
        "sampling": "sampled" if sampled else "greedy",
        "block_rows": blocks,
        "ms_per_step": {name: round(value * 1e3, 2) for name, value in step.items()},
        "us_per_sequence": {name: round(value * 1e6 / sequences, 1) for name, value in step.items()},
        "default_over_plain": round(step["default"] / step["plain"], 3),
        "default_over_whole": round(step["default"] / step["whole"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", default="16,64,256", help="comma-separated numbers of running sequences")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", nargs="?", type=Path, const=RESULTS, metavar="FILE", help=f"write the figures to FILE ({RESULTS})")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = build_folder(TINY.folder, TINY.shape, TINY.model)
    rows = [measure(folder, int(n), sampled, args.steps, args.rounds) for n in args.sequences.split(",") for sampled in (False, True)]
    header = f"{'sequences':>9} {'sampling':>8} {'ms/step default':>16} {'plain':>8} {'whole':>8} {'µs/seq':>8}"
    print(f"{header} {'default/plain':>14} {'default/whole':>14}")
    for r in rows:
        ms, us = r["ms_per_step"], r["us_per_sequence"]["default"]
        print(
            f"{r['sequences']:>9} {r['sampling']:>8} {ms['default']:>16} {ms['plain']:>8} {ms['whole']:>8} {us:>8} "
            f"{r['default_over_plain']:>14} {r['default_over_whole']:>14}"
        )
    if args.json:
        args.json.write_text(json.dumps({"commit": commit(), "machine": machine(), "model": TINY.model, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
