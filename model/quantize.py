"""Weights quantized at load (`quantization:` in a model's entry, `--quantization`): every linear
layer of a float32 model, and the output projection, in one of two kinds:

    int8         CTranslate2's int8: int8 weights with one scale per output channel; each input row
                 quantized to int8 with its own scale at every call, products summed in int32
    q8_0         GGUF's block types (model/block_quant.py): 8-bit weights, a scale per 32 (8.5 bits)
    q4_0, q4_1   4-bit weights, a scale (and a min) per 32 (4.5 / 5 bits)

int8's sums are exact and every scale belongs to one row or one output channel, so a row's output
does not depend on the other rows of its batch, and the rows of a decode step (the C kernel
int8_linear, which quantizes them itself: the weights interleaved in groups of 8 output channels,
8 sums a vector, AVX-512 VNNI or AVX2 dot products; on AVX2 up to 256 rows) compute what the many
rows of a prompt or a beam batch compute (torch._int_mm where it is fast, on AVX-512; elsewhere
float32 GEMMs over int8 values, exact since every product and partial sum is an integer below
2^24). Whole-row integer sums make many rows fast, where the block types convert every 32 products
to float.

The block types' quantizers are the gguf package's (llama.cpp's reference rounding), so a model
quantized here holds what llama.cpp's converter would write. Activations (but int8's, and the
block types' with EngineConfig.activation_bits 8), embeddings, norms and attention stay float32; a
layer whose input width is not a multiple of 32 stays float32 under the block types. The outputs
differ from float32's by rounding, so the paths are held to quality bounds
(tests/model/test_quantize.py). On a GPU the weights are dequantized at each product: correct, not fast.
"""

import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from model import cpu_kernels
from model.block_quant import BLOCK, Q4_0, Q4_1, Q8_0, BlockLinear
from model.config import Quantization
from model.generator import Generator
from model.translator import Translator

GGML_TYPES: dict[str, int] = {"q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1}
WeightType = torch.dtype | Quantization  # a float dtype, or float32 with quantized linear layers
INT8_MAX = 127
# Float32 holds every integer up to 2^24 exactly; a sum of K int8 products is at most 127^2 K.
EXACT_FLOAT_K = 2**24 // INT8_MAX**2  # 1040
INT_MM_IS_FAST = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
# Up to this many rows a call go through the C kernel, past them the GEMMs: torch._int_mm's on
# AVX-512; on AVX2 the float32 GEMMs, which convert the weights at every call and which the
# kernel beat 1.8-7.9x on the shipped models' layers at 1-256 rows (`python -m benchmarks.linear`,
# int8_kernel_vs_gemms_<rows>; more rows not measured).
INT8_KERNEL_ROWS = 16 if INT_MM_IS_FAST else 256


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


@functools.cache
def _int8_kernel() -> Callable[..., int] | None:
    """The C kernel int8_linear, or None where it is not built (no x86 AVX2, or the kernels off)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    available = cpu_kernels.load_function("block_linear_q8_available", ctypes.c_int, [])
    if available is None or not available():
        return None
    return cpu_kernels.load_function("int8_linear", ctypes.c_int, [pointer] * 5 + [size] * 3)


def _int8_kernel_built() -> bool:
    return _int8_kernel() is not None


int8_kernel_built: Callable[[], bool] = torch.compiler.assume_constant_result(_int8_kernel_built)  # a constant to tracing


def interleave_int8(weight: Tensor) -> Tensor:
    """(out, in) int8, in a multiple of BLOCK -> (ceil(out / 8), in / BLOCK, 8, 8, 4): the C kernel's
    layout, groups of 8 rows (the last padded with zero rows), each block of a group as 8 granules of
    the 8 rows' 4 weights: [G, b, g, l, j] = weight[8G + l, BLOCK b + 4g + j]."""
    out, in_features = weight.shape
    padded = torch.cat([weight, weight.new_zeros(-out % 8, in_features)])  # (8 ceil(out / 8), in)
    return padded.view(-1, 8, in_features // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


def int8_rows_product(rows: Tensor, weight_x8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """(N, in) float32 rows, each quantized to int8 with its own scale as _quantized_rows does, times
    the int8 weight (out, in) laid out by interleave_int8 with its scales (1, out), plus bias:
    (N, out) float32 by the C kernel, equal to int8_matmul's path."""
    kernel = _int8_kernel()
    assert kernel is not None, "int8_rows_product without its kernel"
    n, in_features = rows.shape
    out = scale.numel()
    if rows.dtype != torch.float32:
        raise ValueError("int8_linear: rows (N, in) float32")
    if weight_x8.dtype != torch.int8 or weight_x8.shape != ((out + 7) // 8, in_features // BLOCK, 8, 8, 4) or in_features % BLOCK:
        raise ValueError(f"int8_linear: weight (out, {in_features}) int8 as interleave_int8 lays it out, in a multiple of {BLOCK}")
    if scale.dtype != torch.float32:
        raise ValueError("int8_linear: a float32 scale per output")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out):
        raise ValueError(f"int8_linear: bias ({out},) float32")
    y = torch.empty(n, out)
    # Each pointer's tensor held in a name until the kernel returns (a temporary's memory would be freed).
    x, weights, wscale = rows.contiguous(), weight_x8.contiguous(), scale.reshape(-1).contiguous()
    bias_values = None if bias is None else bias.contiguous()
    bias_pointer = None if bias_values is None else bias_values.data_ptr()
    status = kernel(x.data_ptr(), weights.data_ptr(), wscale.data_ptr(), bias_pointer, y.data_ptr(), n, in_features, out)
    if status == -2:
        raise MemoryError("int8_linear: no memory for the quantized rows")
    if status != 0:  # not an assert: under python -O it would hand back y unwritten
        raise RuntimeError(f"int8_linear: the kernel refused ({status}) what the checks above let through")
    return y


def _int8_shape(rows: Tensor, weight_x8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    return rows.new_empty(rows.shape[0], scale.numel())


int8_rows = cpu_kernels.register_operator("int8_linear", int8_rows_product, _int8_shape)


class Int8Linear(nn.Module):
    """y = x W^T + b with W (out, in) stored as int8 plus one float scale per output channel."""

    weight_x8: Tensor | None
    weight_t: Tensor
    scale: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        scale = _row_scales(weight.detach().float())  # (out, 1)
        quantized = torch.round(weight.detach().float() / scale).to(torch.int8)  # (out, in)
        self.in_features, self.out_features = quantized.shape[1], quantized.shape[0]
        kernel_layout = interleave_int8(quantized) if self.in_features % BLOCK == 0 else None  # None: the kernel does not apply
        self.register_buffer("weight_x8", kernel_layout)
        self.register_buffer("weight_t", quantized.T.contiguous())  # (in, out), the layout the GEMM reads
        self.register_buffer("scale", scale.T.contiguous())  # (1, out)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) float32. Returns (..., out) float32."""
        rows = x.reshape(-1, self.in_features)  # (N, in)
        kernel = self.weight_x8 is not None and rows.shape[0] <= INT8_KERNEL_ROWS and x.device.type == "cpu" and int8_kernel_built()
        y = self.by_kernel(rows) if kernel else self.by_gemms(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def by_kernel(self, rows: Tensor) -> Tensor:
        """rows (N, in) float32 -> (N, out) by the C kernel (an operation under torch.compile)."""
        assert self.weight_x8 is not None, "by_kernel where the kernel does not apply"
        return int8_rows(rows, self.weight_x8, self.scale, self.bias)  # the rows quantized in the kernel

    def by_gemms(self, rows: Tensor) -> Tensor:
        """rows (N, in) float32 -> (N, out) by int8_matmul: the same numbers as by_kernel."""
        quantized, row_scale = _quantized_rows(rows)
        y = int8_matmul(quantized, self.weight_t) * (row_scale * self.scale)  # (N, out): exact sums, rescaled
        return y if self.bias is None else y + self.bias


def _quantized_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows (N, K) float32 -> (N, K) int8 and (N, 1) float32 scales: each row by its own largest magnitude."""
    row_scale = _row_scales(rows)  # (N, 1)
    return torch.round(rows / row_scale).to(torch.int8), row_scale


def _quantized(linear: nn.Linear, quantization: Quantization) -> nn.Module:
    if quantization == "int8":
        return Int8Linear.from_linear(linear)
    if linear.in_features % BLOCK:
        return linear
    return BlockLinear.quantized(linear.weight, linear.bias, GGML_TYPES[quantization])


def quantize_weights(model: Translator | Generator, quantization: Quantization = "int8") -> None:
    """Replaces, in place, every nn.Linear of a float32 model (an untied lm_head among them) by a
    layer of the quantization's kind, and gives a tied model a quantized output projection (the
    embedding table itself stays float32). A logits bias stays float32."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                parent.register_module(name, _quantized(child, quantization))
    if model.lm_head is None:
        tied = nn.Linear(model.embed.weight.shape[1], model.embed.weight.shape[0], bias=False)
        tied.weight = model.embed.weight
        quantized = _quantized(tied, quantization)
        model.output_projection = None if quantized is tied else quantized
    model.eval()


def place(model: Translator | Generator, device: str | torch.device, weights: WeightType) -> None:
    """Moves a float32 model, in place, to device in eval mode with weights of the given type."""
    if isinstance(weights, torch.dtype):
        model.to(device=device, dtype=weights).eval()
        return
    model.to(dtype=torch.float32)
    quantize_weights(model, weights)
    model.to(device).eval()
