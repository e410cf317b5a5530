"""Float32 linear layers for CPU inference with their weights pre-packed for oneDNN.

torch's default CPU GEMM (MKL) takes a plain (out, in) weight and, on this project's AMD EPYC
machine, runs a generic code path; oneDNN, given the weight once in its own blocked layout,
multiplies the many-row batches of a decode step faster: 1.1-1.5x for the layers and 1.3-2.9x for
the 8000-word output projection, at 4 to 256 rows, 1 thread (`python -m benchmarks.linear`).
A single row (a step of one sequence: one user's latency) reads every weight once for little
arithmetic; there MKL is fastest given the weight transposed, (in, out) contiguous: generation at
batch 1 runs 1.08-1.14x faster than with the (out, in) layout, and at 2 rows it makes no
difference. So a layer keeps its weight twice, transposed for MKL and packed for oneDNN, and
picks by rows.

Inference only: the packed copy is made once and never updated, so training and anything that
needs gradients takes the MKL path. The GEMMs sum in different orders, so outputs differ from
nn.Linear's by float32 rounding (tests/model/test_packed_linear.py bounds it).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.generator import Generator
from model.layers import replace_linear_layers
from model.translator import Translator

# oneDNN picks its blocked layout for this many rows: the engine's typical decode batch.
PACKED_FOR_ROWS = 64
# Up to this many rows MKL on the transposed weight is faster than oneDNN's packed path.
MAX_MKL_ROWS = 1
# oneDNN keeps a compiled kernel, with memory of its own, for every number of rows it has seen
# (hundreds of MB for a replica that sees every count up to 256), so the packed path runs a few
# row counts only: inputs are padded up to the next of 2, 4, 8, 16, then multiples of 16, and
# more than MAX_PACKED_ROWS rows (a long prefill) take the plain path.
MAX_PACKED_ROWS = 256


def padded_rows(n: int) -> int:
    """The row count the packed path runs for n rows: 19 counts in all up to MAX_PACKED_ROWS."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16


def packing_available() -> bool:
    """torch was built with oneDNN (x86 and ARM builds are) and can pack linear weights."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x W^T + b with W (out, in) kept twice: transposed, (in, out) contiguous, for MKL (up to
    MAX_MKL_ROWS rows, more than MAX_PACKED_ROWS, or gradients), and packed for oneDNN (the rows
    between, inference). Both are copies: the source weight is not kept."""

    weight_t: Tensor
    packed_weight: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight_t", weight.detach().t().contiguous())  # (in, out)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def weight(self) -> Tensor:
        """W (out, in), a view of the transposed copy."""
        return self.weight_t.t()

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) float32. Returns (..., out)."""
        n = x.numel() // self.in_features
        rows = x.reshape(n, self.in_features)  # (N, in)
        if n <= MAX_MKL_ROWS or n > MAX_PACKED_ROWS or torch.is_grad_enabled():
            y = rows @ self.weight_t if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)  # (N, out)
            return y.view(*x.shape[:-1], self.out_features)
        # Under torch.compile the packed product is one opaque operation (inductor cannot lower it).
        product = torch.ops.transformer_serving.packed_linear if torch.compiler.is_compiling() else packed_product
        return product(rows, self.packed_weight, self.bias, self.out_features).view(*x.shape[:-1], self.out_features)


def packed_product(rows: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """rows (N, in) times a weight packed by oneDNN (PackedLinear.packed_weight), plus bias: (N, out_features)."""
    n = rows.shape[0]
    padded = padded_rows(n)
    if padded > n:
        rows = F.pad(rows, (0, 0, 0, padded - n))  # (P, in): zero rows, dropped below
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")[:n]  # (N, out)


_packed_op = torch.library.custom_op("transformer_serving::packed_linear", packed_product, mutates_args=())


@_packed_op.register_fake
def _(rows: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return rows.new_empty(rows.shape[0], out_features)


def pack_linear_layers(model: Translator | Generator) -> None:
    """Replaces, in place, every nn.Linear of a float32 CPU model in eval mode (an untied lm_head
    among them) by a PackedLinear, and gives a tied model a packed output projection (copies of the
    embedding table: the two no longer share memory, so the packed model is for inference only)."""
    parameter = next(model.parameters())
    assert parameter.device.type == "cpu" and parameter.dtype == torch.float32, "packing is for float32 weights on the CPU"
    assert packing_available(), "this torch build has no oneDNN"
    replace_linear_layers(model, lambda linear: PackedLinear(linear.weight, linear.bias))
    if model.lm_head is None:
        model.output_projection = PackedLinear(model.embed.weight, None)
    model.eval()
