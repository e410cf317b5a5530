"""Int8 weights for CPU replicas, as CTranslate2's int8: every linear layer and the tied output
projection keep int8 weights with one scale per output channel; each input row (token) is
quantised to int8 with its own scale at every call, and the products accumulate in int32.

Integer accumulation is exact and every scale belongs to one row or one output channel, so a
row's output does not depend on the other rows of its batch: the batched engine computes what the
same int8 model computes for one sequence alone. Embeddings, LayerNorms and attention stay float32.
The weights are four times smaller; the outputs differ from float32's by rounding, so the path is
held to quality bounds (tests/model/test_quantize.py).

torch's int8 GEMM (`torch._int_mm`) is fast on CPUs with AVX-512; on AVX2-only CPUs it falls back
to a loop 12-25x slower than a float32 GEMM. There the same int32 sums are computed by a float32
GEMM over int8 values, which is exact: every product and partial sum is an integer below 2^24.
"""

from typing import Literal

import torch
from torch import Tensor, nn

from model.generator import Generator
from model.layers import replace_linear_layers
from model.translator import Translator

INT8_MAX = 127
WeightType = torch.dtype | Literal["int8"]  # "int8": float32 quantised for the CPU (below)
# Float32 holds every integer up to 2^24 exactly; a sum of K int8 products is at most 127^2 K.
EXACT_FLOAT_K = 2**24 // INT8_MAX**2  # 1040
INT_MM_IS_FAST = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def int8_matmul(a: Tensor, b: Tensor, use_int_mm: bool = INT_MM_IS_FAST) -> Tensor:
    """(N, K) int8 @ (K, M) int8, entries in [-127, 127] as this module rounds them -> (N, M)
    float32: the exact int32 sums as float32, by torch._int_mm, or by float32 GEMMs (over slices
    of at most EXACT_FLOAT_K of K, summed in int32, where K is longer): the same numbers."""
    if use_int_mm:
        return torch._int_mm(a, b).float()
    if a.shape[1] <= EXACT_FLOAT_K:
        return a.float() @ b.float()  # integers below 2^24: exact
    sums = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)  # (N, M)
    for k in range(0, a.shape[1], EXACT_FLOAT_K):
        sums += (a[:, k : k + EXACT_FLOAT_K].float() @ b[k : k + EXACT_FLOAT_K].float()).to(torch.int32)
    return sums.float()


def _row_scales(x: Tensor) -> Tensor:
    """(..., K) -> (..., 1): the scale that maps each row's largest magnitude to 127."""
    return x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX


class Int8Linear(nn.Module):
    """y = x W^T + b with W (out, in) stored as int8 plus one float scale per output channel."""

    weight_t: Tensor
    scale: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        scale = _row_scales(weight.detach().float())  # (out, 1)
        quantized = torch.round(weight.detach().float() / scale).to(torch.int8)  # (out, in)
        self.register_buffer("weight_t", quantized.T.contiguous())  # (in, out), the layout the GEMM reads
        self.register_buffer("scale", scale.T.contiguous())  # (1, out)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = quantized.shape[1], quantized.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) float32. Returns (..., out) float32."""
        rows = x.reshape(-1, self.in_features)  # (N, in)
        row_scale = _row_scales(rows)  # (N, 1)
        quantized = torch.round(rows / row_scale).to(torch.int8)  # (N, in)
        y = int8_matmul(quantized, self.weight_t) * (row_scale * self.scale)  # (N, out): exact sums, rescaled
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def quantize_int8(model: Translator | Generator) -> None:
    """Replaces, in place, every nn.Linear of a float32 CPU model (an untied lm_head among them) by
    an Int8Linear, and gives a tied model an int8 output projection (until now the embedding table
    read transposed; the embedding itself stays float32). A logits bias stays float32."""
    assert next(model.parameters()).device.type == "cpu", "int8 weights run on the CPU only"
    replace_linear_layers(model, Int8Linear.from_linear)
    if model.lm_head is None:
        model.output_projection = Int8Linear(model.embed.weight, None)
    model.eval()


def place(model: Translator | Generator, device: str | torch.device, weights: WeightType) -> None:
    """Moves a float32 model, in place, to device in eval mode with weights of the given type."""
    model.to(device=device, dtype=torch.float32 if weights == "int8" else weights).eval()
    if weights == "int8":
        quantize_int8(model)
