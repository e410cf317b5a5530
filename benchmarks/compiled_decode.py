"""The compiled decode step against the eager one, side by side (service/engine/compiled_decode.py).

    python -m benchmarks.compiled_decode [--generator DIR] [--batches 1,2,4,8,16] [--keys 256]
                                         [--steps 15] [--threads 1] [--json] [--quick]

Loads the generator (default: the shipped one; a Hugging Face Llama-family or GPT-NeoX folder too)
as the engine does on the CPU (float32, oneDNN-packed products), starts a runner whose decode
step is compiled at every batch size named (EngineConfig.compiled_decode: the replica's warm-up),
then times the eager and the compiled step of each batch size taking turns (--steps each,
medians), every row attending over --keys keys. Prints
a table; with --json the last line is one JSON object (compiled_vs_eager_b<batch>: the speed-up).
The engine's own warm-up takes the same measurement, shorter, to choose per batch size. --quick
(batches 1 and 2, 64 keys, 2 steps) checks the script.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.provenance import commit
from loading.checkpoint import DEFAULT_GENERATOR, load_checkpoint
from model.generator import Generator
from model.packed_linear import pack_linear_layers, packing_available
from service.engine.config import EngineConfig
from service.engine.runner import GeneratorRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generator", type=Path, default=DEFAULT_GENERATOR)
    parser.add_argument("--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    parser.add_argument("--keys", type=int, default=256, help="keys each row attends over")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per system and batch size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 2, 64 keys, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.keys, args.steps = "1,2", 64, 2
    torch.set_num_threads(args.threads)
    batches = sorted({int(b) for b in args.batches.split(",")})
    model, tokenizer = load_checkpoint(args.generator)
    assert isinstance(model, Generator), f"{args.generator} is not a decoder-only model"
    if packing_available():
        pack_linear_layers(model)
    context = min(model.config.max_len, max(2 * args.keys, 512))
    started = time.perf_counter()
    runner = GeneratorRunner(model, tokenizer, EngineConfig(n_slots=max(batches), max_context=context, compiled_decode=tuple(batches)))
    compile_seconds = round(time.perf_counter() - started, 1)
    assert runner.compiled is not None
    figures: dict[str, object] = {"commit": commit(), "model": str(args.generator), "compile_seconds": compile_seconds}
    print(f"{'batch':>5} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9}")
    for batch in batches:
        eager, fast = runner.compiled.time_step(batch, args.keys, args.steps)
        print(f"{batch:>5} {1e3 * eager:>9.1f} {1e3 * fast:>12.1f} {eager / fast:>9.2f}")
        figures |= {f"eager_ms_b{batch}": round(1e3 * eager, 2), f"compiled_ms_b{batch}": round(1e3 * fast, 2)}
        figures[f"compiled_vs_eager_b{batch}"] = round(eager / fast, 3)
    print(f"the runner's start (compiling and the warm-up's timings) took {compile_seconds} s")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
