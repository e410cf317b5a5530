"""The engine's own cost per sequence: Engine.step in-process (no Ray, no HTTP) on the tiny Llama of
`benchmarks.vs_vllm --tiny`, where the model's arithmetic is small, at several numbers of running
sequences, greedy and sampled; each setting beside the same engine sampling all its rows at once
(GeneratorRunner.block_rows: the plain path) and, sampled, beside it drawing by torch's operations
instead of the C kernel (decoding/top_k_cpu.py row_draw), taking turns.

    python -m benchmarks.step_cost [--sequences 16,64,256] [--steps 20] [--rounds 3] [--json [FILE]]

Each setting admits N requests of 128 random prompt tokens (128 out, ignore_eos), computes their
prompts, then times `steps` decode steps, `rounds` times, alternating the two block sizes; the
median round is kept. Prints ms per step, µs per sequence, blocks / whole and, sampled, kernel draw /
torch draw (both in blocks). One torch thread.
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
    settings = [("blocks", blocks, True), ("whole", 1 << 30, True)] + ([("torch_draw", blocks, False)] if sampled else [])
    times: dict[str, list[float]] = {name: [] for name, _, _ in settings}
    kernel = top_k_cpu.draw_kernel
    try:
        for _ in range(rounds):
            for name, rows, draw_kernel in settings:
                runner.block_rows = rows
                top_k_cpu.draw_kernel = kernel if draw_kernel else lambda: None  # type: ignore[assignment]
                timed_steps(engine, 2)  # the other setting's caches out of the way
                times[name].append(timed_steps(engine, steps))
    finally:
        top_k_cpu.draw_kernel = kernel
    step = {name: statistics.median(values) for name, values in times.items()}
    return {
        "sequences": sequences,
        "sampling": "sampled" if sampled else "greedy",
        "block_rows": blocks,
        "ms_per_step": {name: round(value * 1e3, 2) for name, value in step.items()},
        "us_per_sequence": {name: round(value * 1e6 / sequences, 1) for name, value in step.items()},
        "blocks_over_whole": round(step["blocks"] / step["whole"], 3),
        "kernel_draw_over_torch_draw": round(step["blocks"] / step["torch_draw"], 3) if sampled else None,
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
    print(
        f"{'sequences':>9} {'sampling':>8} {'ms/step blocks':>15} {'whole':>8} {'torch draw':>11} {'µs/seq blocks':>14} {'whole':>8} "
        f"{'blocks/whole':>13} {'kernel/torch draw':>18}"
    )
    for r in rows:
        ms, us, torch_draw = r["ms_per_step"], r["us_per_sequence"], r["ms_per_step"].get("torch_draw", "-")
        print(
            f"{r['sequences']:>9} {r['sampling']:>8} {ms['blocks']:>15} {ms['whole']:>8} {torch_draw:>11} {us['blocks']:>14} "
            f"{us['whole']:>8} {r['blocks_over_whole']:>13} {r['kernel_draw_over_torch_draw'] or '-':>18}"
        )
    if args.json:
        args.json.write_text(json.dumps({"commit": commit(), "machine": machine(), "model": TINY.model, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
