"""The linear layers of a decode step, plain (torch's default CPU GEMM) against PackedLinear
(model/packed_linear.py: MKL on the transposed weight for a single row, oneDNN with pre-packed
weights above), side by side at each batch size.

    python -m benchmarks.linear [--threads 1] [--json] [--quick]

Runs the generator's 36 linear layers (6 layers x q, k, v, out, fc1, fc2: d_model 256, d_ff 1024)
and the translator's output projection (8000 x 256) for 1 to 256 rows, the two paths taking turns
on the same inputs, best of 3; prints milliseconds per pass and the speedup (plain / packed).
With --json the last line is one object: packed_speedup_<rows>, projection_speedup_<rows>.
--quick (rows 1 and 16, 10 passes, best of 1) checks the script.
"""

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from model.packed_linear import PackedLinear

ROWS = (1, 2, 4, 16, 64, 256)
QUICK_ROWS = (1, 16)
LAYER_SHAPES = [(256, 256)] * 4 + [(1024, 256), (256, 1024)]  # (out, in): q, k, v, out, fc1, fc2


def best_ms(run: Callable[[], object], passes: int, repeats: int) -> float:
    """The best of repeats timings of passes runs, in milliseconds per run, after 5 untimed runs."""
    for _ in range(5):
        run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(passes):
            run()
        best = min(best, (time.perf_counter() - started) / passes * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="rows 1 and 16, 10 passes, best of 1: to check the script")
    args = parser.parse_args()
    rows_run, passes, repeats = (QUICK_ROWS, 10, 1) if args.quick else (ROWS, 50, 3)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = [nn.Linear(n_in, n_out) for _ in range(6) for n_out, n_in in LAYER_SHAPES]
    packed = [PackedLinear(layer.weight, layer.bias) for layer in plain]
    embedding = torch.randn(8000, 256) * 0.02
    projection = PackedLinear(embedding, None)
    results: dict[str, float] = {"threads": float(args.threads)}
    print(f"{'rows':>5} {'plain ms':>9} {'packed ms':>10} {'speedup':>8} {'projection speedup':>19}")
    with torch.inference_mode():
        for rows in rows_run:
            inputs = {n: torch.randn(rows, n) for n in (256, 1024)}

            def run_all(layers: Sequence[nn.Module], inputs: dict[int, torch.Tensor] = inputs) -> None:
                for layer, (_, n_in) in zip(layers, LAYER_SHAPES * 6, strict=True):
                    layer(inputs[n_in])

            plain_ms = best_ms(lambda: run_all(plain), passes, repeats)
            packed_ms = best_ms(lambda: run_all(packed), passes, repeats)
            h = inputs[256]
            tied_ms = best_ms(lambda: h @ embedding.T, passes, repeats)  # noqa: B023
            projection_ms = best_ms(lambda: projection(h), passes, repeats)  # noqa: B023
            results[f"packed_speedup_{rows}"] = round(plain_ms / packed_ms, 2)
            results[f"projection_speedup_{rows}"] = round(tied_ms / projection_ms, 2)
            print(f"{rows:>5} {plain_ms:>9.3f} {packed_ms:>10.3f} {plain_ms / packed_ms:>8.2f} {tied_ms / projection_ms:>19.2f}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
