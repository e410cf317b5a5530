"""The linear layers of a decode step: plain (torch's default CPU GEMM, MKL), oneDNN with pre-packed
weights, and the C panel kernel (model/packed_linear.py picks between the last two by rows), side
by side at each batch size.

    python -m benchmarks.linear [--shapes generator|smollm2] [--threads 1] [--json] [--quick]

--shapes generator (the default): the shipped generator's 36 linear layers (6 layers x q, k, v,
out, fc1, fc2: d_model 256, d_ff 1024; 9 MB, in the L3 cache) and the translator's output
projection (8000 x 256). --shapes smollm2: SmolLM2-135M's 120 layer products (30 layers x
queries-keys-values 576 -> 960, out 576 -> 576, gate-up 576 -> 3072, down 1536 -> 576; 425 MB, read
from memory at every pass, as a decode step reads them) and its output projection (49152 x 576).
The paths take turns on the same inputs, best of 3; prints milliseconds per pass of the layers and
the speed-ups. With --json the last line is one object: packed_speedup_<rows> and
projection_speedup_<rows> (PackedLinear, as the engine runs it, over plain) and
panel_vs_onednn_<rows> (the panel kernel over oneDNN, the layers; where the kernel is built and
--threads is 1); the same layers quantized to int8 (model/quantize.py Int8Linear, the output
projection included): int8_kernel_vs_gemms_<rows> (its C kernel over its GEMMs, the two paths
INT8_KERNEL_ROWS chooses between; where the kernel is built) and int8_vs_packed_<rows> (int8 as
the engine runs it over float32 PackedLinear). --quick (rows 1 and 16, 2 passes, best of 1)
checks the script.
"""

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from model.packed_linear import PackedLinear, packed_product, panel_product, panel_rows_limit, panels_apply
from model.quantize import Int8Linear, int8_kernel_built

ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
QUICK_ROWS = (1, 16)
# (out, in) of each layer's products, the number of layers, and the output projection (vocab, d_model).
SHAPES = {
    "generator": ([(256, 256)] * 4 + [(1024, 256), (256, 1024)], 6, (8000, 256)),
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
}


def best_ms(run: Callable[[], object], passes: int, repeats: int) -> float:
    """The best of repeats timings of passes runs, in milliseconds per run, after 2 untimed runs."""
    for _ in range(2):
        run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(passes):
            run()
        best = min(best, (time.perf_counter() - started) / passes * 1000)
    return best


def by_onednn(layer: PackedLinear, x: Tensor) -> Tensor:
    """The layer's product by oneDNN, whatever the rows."""
    return packed_product(x, layer.packed_weight, None, layer.out_features)


def by_panels(layer: PackedLinear, x: Tensor) -> Tensor:
    """The layer's product by the C panel kernel, whatever the rows."""
    return panel_product(x, layer.panels, None, layer.out_features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="generator")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="rows 1 and 16, 2 passes, best of 1: to check the script")
    args = parser.parse_args()
    layer_shapes, n_layers, (vocab, d_model) = SHAPES[args.shapes]
    rows_run, repeats = (QUICK_ROWS, 1) if args.quick else (ROWS, 3)
    passes = 2 if args.quick else (50 if args.shapes == "generator" else 5)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = layer_shapes * n_layers
    plain = [nn.Linear(n_in, n_out, bias=False) for n_out, n_in in shapes]
    packed = [PackedLinear(layer.weight, None) for layer in plain]
    embedding = torch.randn(vocab, d_model) * 0.02
    projection = PackedLinear(embedding, None)
    int8 = [Int8Linear(layer.weight, None) for layer in plain] + [Int8Linear(embedding, None)]
    with_panels, with_int8_kernel = panels_apply(), int8_kernel_built()
    results: dict[str, object] = {"threads": args.threads, "shapes": args.shapes, "panel_kernel": with_panels}
    print(
        f"{'rows':>5} {'plain ms':>9} {'oneDNN ms':>10} {'panels ms':>10} {'packed speed-up':>16} {'projection speed-up':>20}"
        f" {'int8 kernel/GEMMs':>18} {'int8/packed':>12}"
    )
    with torch.inference_mode():
        for rows in rows_run:
            inputs = {n_in: torch.randn(rows, n_in) for _, n_in in layer_shapes}

            def run_all(multiply: Callable[[Any, Tensor], object], layers: Sequence[nn.Module]) -> None:
                for layer, (_, n_in) in zip(layers, shapes, strict=True):
                    multiply(layer, inputs[n_in])  # noqa: B023

            plain_ms = best_ms(lambda: run_all(lambda layer, x: layer(x), plain), passes, repeats)
            onednn_ms = best_ms(lambda: run_all(by_onednn, packed), passes, repeats)
            packed_ms = onednn_ms  # what PackedLinear runs: the panels where they apply
            panels = "-"
            if with_panels and rows <= panel_rows_limit():
                packed_ms = best_ms(lambda: run_all(by_panels, packed), passes, repeats)
                results[f"panel_vs_onednn_{rows}"] = round(onednn_ms / packed_ms, 2)
                panels = f"{packed_ms:.3f}"
            h = inputs[d_model]
            tied_ms = best_ms(lambda: h @ embedding.T, passes, repeats)  # noqa: B023
            projection_ms = best_ms(lambda: projection(h), passes, repeats)  # noqa: B023
            results[f"packed_speedup_{rows}"] = round(plain_ms / packed_ms, 2)
            results[f"projection_speedup_{rows}"] = round(tied_ms / projection_ms, 2)
            int8_inputs = [inputs[n_in] for _, n_in in shapes] + [h]
            int8_ms = best_ms(lambda: [layer(x) for layer, x in zip(int8, int8_inputs, strict=True)], passes, repeats)  # noqa: B023
            results[f"int8_vs_packed_{rows}"] = round((packed_ms + projection_ms) / int8_ms, 2)
            by_kernel = "-"
            if with_int8_kernel:
                gemms_ms = best_ms(lambda: [layer.by_gemms(x) for layer, x in zip(int8, int8_inputs, strict=True)], passes, repeats)  # noqa: B023
                kernel_ms = best_ms(lambda: [layer.by_kernel(x) for layer, x in zip(int8, int8_inputs, strict=True)], passes, repeats)  # noqa: B023
                results[f"int8_kernel_vs_gemms_{rows}"] = round(gemms_ms / kernel_ms, 2)
                by_kernel = f"{gemms_ms / kernel_ms:.2f}"
            print(
                f"{rows:>5} {plain_ms:>9.3f} {onednn_ms:>10.3f} {panels:>10} {plain_ms / packed_ms:>16.2f} {tied_ms / projection_ms:>20.2f}"
                f" {by_kernel:>18} {(packed_ms + projection_ms) / int8_ms:>12.2f}"
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
