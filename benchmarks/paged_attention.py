"""The CPU paged decode attention kernel against the plain path, side by side
(model/paged_attention_cpu.py against model/kv_cache.py's gather and SDPA).

    python -m benchmarks.paged_attention [--generator DIR] [--steps 15] [--threads 1] [--json] [--quick]

Two measurements, each system taking turns with the other on the same inputs (medians):
- one layer's decode attention alone, at SmolLM2-135M's heads (9 query, 3 key/value, 64 wide)
  and at the shipped generator's (4 and 4), over blocks of 16 scattered in the pool: (batch, keys)
  of (1, 256), (4, 576), (16, 256) and (16, 1024);
- the generator's whole decode step (default: the shipped one; a Hugging Face Llama-family or
  GPT-NeoX folder too, loaded as the engine loads it on the CPU: float32, oneDNN-packed products)
  at batch 1, 4 and 16 over 256 keys, with the pool's decodes through the kernel and through SDPA.
Prints a table; with --json the last line is one JSON object (kernel_vs_plain_*: the speed-ups).
--quick (small shapes, 2 steps) checks the script.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.provenance import commit
from loading.checkpoint import DEFAULT_GENERATOR, load_checkpoint
from model import paged_attention_cpu
from model.generator import Generator
from model.kv_cache import PagedKVCache, PagedLayer, RaggedStep, ragged_step
from model.packed_linear import pack_linear_layers, packing_available

BLOCK_SIZE = 16
HEADS = {"smollm2": (9, 3, 64), "shipped": (4, 4, 64)}  # query heads, key/value heads, head width
ATTENTION_SHAPES = [(1, 256), (4, 576), (16, 256), (16, 1024)]  # (batch, keys)
STEP_SHAPES = [(1, 256), (4, 256), (16, 256)]


def side_by_side(plain: Callable[[], object], kernel: Callable[[], object], steps: int) -> tuple[float, float]:
    """Median seconds of each, the two taking turns `steps` times after one warm-up call each."""
    plain(), kernel()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for spent, run in zip(times, (plain, kernel), strict=True):
            started = time.perf_counter()
            run()
            spent.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def scattered_step(batch: int, keys: int) -> tuple[int, RaggedStep]:
    """A pool's size in blocks and the decode step of `batch` sequences at position keys - 1, each
    holding blocks of that pool in a random order (never the null block 0)."""
    per_row = -(-keys // BLOCK_SIZE)
    order = (torch.randperm(batch * per_row) + 1).tolist()
    tables = [order[i * per_row : (i + 1) * per_row] for i in range(batch)]
    return batch * per_row + 1, ragged_step([1] * batch, [keys - 1] * batch, tables, BLOCK_SIZE, torch.device("cpu"))


def record(figures: dict[str, object], label: str, key: str, plain: float, fast: float, unit: str) -> None:
    """Prints a table row and adds {key}_plain_{unit}, {key}_kernel_{unit} and kernel_vs_plain_{key}."""
    scale, digits = {"us": (1e6, 1), "ms": (1e3, 2)}[unit]
    print(f"{label:<28} {scale * plain:>9.{digits - 1}f} {scale * fast:>10.{digits - 1}f} {plain / fast:>9.2f}")
    figures |= {f"{key}_plain_{unit}": round(scale * plain, digits), f"{key}_kernel_{unit}": round(scale * fast, digits)}
    figures[f"kernel_vs_plain_{key}"] = round(plain / fast, 3)


def attention_alone(heads: tuple[int, int, int], batch: int, keys: int, steps: int) -> tuple[float, float]:
    """One layer's decode attention of `batch` sequences over `keys` keys each, in scattered blocks."""
    H, Hkv, D = heads
    num_blocks, step = scattered_step(batch, keys)
    cache = PagedKVCache(1, num_blocks, BLOCK_SIZE, Hkv, D)
    cache.keys[0].normal_(), cache.values[0].normal_()
    q, k, v = torch.randn(1, H, batch, D), torch.randn(1, Hkv, batch, D), torch.randn(1, Hkv, batch, D)
    layers = [PagedLayer(cache.keys[0], cache.values[0], step, fast) for fast in (False, True)]
    return side_by_side(lambda: layers[0].attend(q, k, v), lambda: layers[1].attend(q, k, v), steps)


@torch.inference_mode()
def decode_step(model: Generator, batch: int, keys: int, steps: int) -> tuple[float, float]:
    """The model's decode step of `batch` sequences over `keys` keys each (their blocks scattered)."""
    c = model.config
    num_blocks, step = scattered_step(batch, keys)
    cache = PagedKVCache(c.n_layers, num_blocks, BLOCK_SIZE, c.kv_heads, c.head_dim)
    ids, positions, rows = torch.full((batch,), c.pad_id), torch.full((batch,), keys - 1), torch.arange(batch)

    def run(fast: bool) -> Callable[[], object]:
        def one_step() -> object:
            cache.decode_kernel = fast
            return model.forward_ragged(ids, positions, cache.layers(step), rows)

        return one_step

    return side_by_side(run(False), run(True), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generator", type=Path, default=DEFAULT_GENERATOR)
    parser.add_argument("--steps", type=int, default=15, help="timed calls per system and shape")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 steps")
    args = parser.parse_args()
    assert paged_attention_cpu.kernel() is not None, "the kernel did not build here (a C compiler?)"
    attention_shapes, step_shapes = ([(2, 40)], [(2, 40)]) if args.quick else (ATTENTION_SHAPES, STEP_SHAPES)
    steps = 2 if args.quick else args.steps
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    figures: dict[str, object] = {"commit": commit(), "model": str(args.generator), "threads": args.threads}
    print(f"{'one layer':<28} {'plain us':>9} {'kernel us':>10} {'speed-up':>9}")
    for name, heads in HEADS.items():
        for batch, keys in attention_shapes:
            plain, fast = attention_alone(heads, batch, keys, steps)
            record(figures, f"{name} b{batch} x {keys} keys", f"attention_{name}_b{batch}_k{keys}", plain, fast, "us")
    model, _ = load_checkpoint(args.generator)
    assert isinstance(model, Generator), f"{args.generator} is not a decoder-only model"
    if packing_available():
        pack_linear_layers(model)
    print(f"\n{'decode step':<28} {'plain ms':>9} {'kernel ms':>10} {'speed-up':>9}")
    for batch, keys in step_shapes:
        plain, fast = decode_step(model, batch, keys, steps)
        record(figures, f"b{batch} x {keys} keys", f"step_b{batch}_k{keys}", plain, fast, "ms")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
