"""Float32 linear layers for CPU inference with their weights laid out for the CPU's kernels.

A decode step multiplies a few rows (one per running sequence) by each weight: it reads every
weight once for little arithmetic, so its speed is the memory's. torch's CPU GEMMs reach about half
of it there on this project's AMD EPYC machine (MKL 7-18 GB/s at 1 row, oneDNN 8-15 GB/s at 2 to 16,
where a plain sum over the same bytes makes 21-22 GB/s). This project's C kernel
(model/csrc/panel_linear.c) reads the weight in panels of 32 output columns, (in, 32) contiguous,
at 19-23 GB/s for 1 to 8 rows, and takes up to max_panel_rows() rows a call. More rows are
many-row GEMMs: oneDNN multiplies them faster than MKL given the weight once in its own blocked
layout (1.1-1.5x at 17-256 rows, 1 thread: `python -m benchmarks.linear`), a prompt chunk of more
than MAX_PACKED_ROWS in pieces of that many. Where the kernel takes as many rows a call (AVX2's
half panels, 256), it takes every row count, in pieces: each is faster than oneDNN's. With
gradients torch multiplies the panels, one batched GEMM. So a layer keeps its weight twice, in
panels and packed for oneDNN, and picks by rows and threads.

The panel kernel is single-threaded: it runs where torch has one thread (a replica's default) and
the CPU kernels are built (model/cpu_kernels.py); elsewhere oneDNN takes its rows too. Inference
only: the copies are made once and never updated, so training keeps nn.Linear. The sums run in
different orders, so outputs differ from nn.Linear's by float32 rounding
(tests/model/test_packed_linear.py bounds it).
"""

import ctypes
import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import cpu_kernels
from model.generator import Generator
from model.layers import replace_linear_layers
from model.translator import Translator

PANEL = 32  # output columns per panel (model/csrc/panel_linear.c)
# oneDNN picks its blocked layout for this many rows: the engine's typical decode batch.
PACKED_FOR_ROWS = 64
# oneDNN keeps a compiled kernel, with memory of its own, for every number of rows it has seen
# (hundreds of MB for a replica that sees every count up to 256), so the packed path runs a few
# row counts only: inputs are padded up to the next of 2, 4, 8, 16, then multiples of 16, and
# more than MAX_PACKED_ROWS rows (a long prompt chunk) go in pieces of MAX_PACKED_ROWS.
MAX_PACKED_ROWS = 256


def padded_rows(n: int) -> int:
    """The row count the packed path runs for n rows: 19 counts in all up to MAX_PACKED_ROWS."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16


def packing_available() -> bool:
    """torch was built with oneDNN (x86 and ARM builds are) and can pack linear weights."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def panel_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C kernel panel_linear, or None (the CPU kernels are off: model/cpu_kernels.py)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return cpu_kernels.load_function("panel_linear", None, [pointer, pointer, pointer, pointer, size, size, size])


@functools.cache
def _kernel_max_rows() -> int:
    """The kernel's own limit (panel_linear_max_rows in panel_linear.c), 0 where it is not built:
    past 32 rows oneDNN pads the rows to a multiple of 16, and the panels were as fast or faster up
    to 128 rows (256 with AVX2's half panels), layer by layer (docs/performance.md)."""
    limit = cpu_kernels.load_function("panel_linear_max_rows", ctypes.c_int64, [])
    return 0 if limit is None else int(limit())


def _max_panel_rows() -> int:
    """The panel kernel's rows per call (where panels_apply())."""
    return _kernel_max_rows()


def _panel_rows_limit() -> int:
    """The most rows PackedLinear gives the panel kernel: every row count (in pieces) where a call
    takes as many as oneDNN's pieces (MAX_PACKED_ROWS, AVX2's half panels: there each piece is
    1.14-1.30x oneDNN's at 256 rows), else its rows per call; oneDNN takes more."""
    rows = _kernel_max_rows()
    return sys.maxsize if rows >= MAX_PACKED_ROWS else rows


# Constants to torch.compile's tracing, as panels_apply (dynamo traces into a functools.cache
# function instead of taking its result).
max_panel_rows: Callable[[], int] = torch.compiler.assume_constant_result(_max_panel_rows)
panel_rows_limit: Callable[[], int] = torch.compiler.assume_constant_result(_panel_rows_limit)


def to_panels(weight: Tensor) -> Tensor:
    """W (out, in) as panels (ceil(out / PANEL), in, PANEL): panel p, row k holds W[p PANEL + c, k]
    for c < PANEL, zeros past out."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL) * PANEL
    weight = F.pad(weight.detach(), (0, 0, 0, padded - out_features))  # (padded, in)
    return weight.view(padded // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """y = x W^T + b with W (out, in) kept twice: in panels (the C kernel up to max_panel_rows() rows; a
    batched GEMM with gradients) and packed for oneDNN (more rows, inference). Both are copies: the
    source weight is not kept."""

    panels: Tensor
    packed_weight: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("panels", to_panels(weight))  # (P, in, PANEL)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def weight(self) -> Tensor:
        """W (out, in), rebuilt from the panels (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def argmax(self, rows: Tensor) -> Tensor | None:
        """Each row's argmax (N,) of self(rows) for rows (N, in), the first of equal ones, by the panel
        kernel without writing the products (the same sums as forward's): a greedy step's output
        projection without its logits. None where it does not apply (the kernel off, torch on more
        than one thread, gradients on) or where a row's products hold a NaN or +inf."""
        kernel = _argmax_kernel()
        if kernel is None or torch.is_grad_enabled() or not _panels_apply():
            return None
        if rows.dim() != 2 or rows.dtype != torch.float32 or rows.shape[1] != self.in_features or rows.device.type != "cpu":
            raise ValueError(f"PackedLinear.argmax: rows (N, {self.in_features}) float32 on the CPU")
        rows = rows.contiguous()
        n = rows.shape[0]
        ids, poisoned = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = kernel(
            rows.data_ptr(), self.panels.data_ptr(), bias, ids.data_ptr(), poisoned.data_ptr(), n, self.in_features, self.out_features
        )
        if status != 0:
            raise MemoryError("panel_argmax: out of memory for its running maxima")
        return None if bool(poisoned.any()) else ids

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) float32. Returns (..., out)."""
        n = x.numel() // self.in_features
        rows = x.reshape(n, self.in_features)  # (N, in)
        if torch.is_grad_enabled():
            y = panel_matmul(rows, self.panels, self.bias, self.out_features)
        elif n <= panel_rows_limit() and panels_apply():
            y = panel_linear(rows, self.panels, self.bias, self.out_features)  # an operation under torch.compile
        else:
            y = packed_linear(rows, self.packed_weight, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


def _panels_apply() -> bool:
    """The panel kernel runs here: it is built and torch has one thread (it has no threads of its own)."""
    return torch.get_num_threads() == 1 and panel_kernel() is not None


# A constant to torch.compile's tracing: the compiled step is made for the threads it runs with.
panels_apply: Callable[[], bool] = torch.compiler.assume_constant_result(_panels_apply)


def panel_matmul(rows: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """rows (N, in) times the weight in panels (P, in, PANEL), plus bias, by torch: (N, out_features)."""
    y = torch.matmul(rows, panels)  # (P, N, PANEL)
    y = y.transpose(0, 1).reshape(rows.shape[0], -1)[:, :out_features]  # (N, out)
    return y if bias is None else y + bias


def panel_product(rows: Tensor, panels: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """rows (N, in) times the weight in panels (P, in, PANEL), plus bias, by the C kernel: (N, out_features),
    more than max_panel_rows() rows in pieces of that many, each written in place. Requires `panels_apply()`."""
    kernel = panel_kernel()
    assert kernel is not None, "panel_product without its kernel (check panels_apply())"
    if rows.dim() != 2 or rows.dtype != torch.float32:
        raise ValueError("panel_linear: rows (N, in) float32")
    if not (panels.dim() == 3 and panels.is_contiguous() and panels.dtype == torch.float32 and panels.shape[1] == rows.shape[1]) or not (
        panels.shape[2] == PANEL and 1 <= out_features <= panels.shape[0] * PANEL
    ):
        raise ValueError(f"panel_linear: panels (P, in, {PANEL}) contiguous float32, P * {PANEL} >= out_features >= 1")
    if bias is not None and not (bias.is_contiguous() and bias.dtype == torch.float32 and bias.numel() == out_features):
        raise ValueError("panel_linear: bias (out_features,) contiguous float32")
    rows = rows.contiguous()
    n, in_features = rows.shape
    y = rows.new_empty(n, out_features)
    bias_pointer = None if bias is None else bias.data_ptr()
    piece, size = _kernel_max_rows(), rows.element_size()
    for first in range(0, n, piece):
        x_pointer, y_pointer = rows.data_ptr() + first * in_features * size, y.data_ptr() + first * out_features * size
        kernel(x_pointer, panels.data_ptr(), bias_pointer, y_pointer, min(piece, n - first), in_features, out_features)
    return y


def _product_shape(rows: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return rows.new_empty(rows.shape[0], out_features)


panel_linear = cpu_kernels.register_operator("panel_linear", panel_product, _product_shape)


def packed_product(rows: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """rows (N, in) times a weight packed by oneDNN (PackedLinear.packed_weight), plus bias: (N, out_features).
    More than MAX_PACKED_ROWS rows go in pieces of that many, so oneDNN sees its few row counts only."""
    if rows.shape[0] > MAX_PACKED_ROWS:
        pieces = rows.split(MAX_PACKED_ROWS)
        return torch.cat([packed_product(piece, packed_weight, bias, out_features) for piece in pieces])  # (N, out)
    n = rows.shape[0]
    padded = padded_rows(n)
    if padded > n:
        rows = F.pad(rows, (0, 0, 0, padded - n))  # (P, in): zero rows, dropped below
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")[:n]  # (N, out)


packed_linear = cpu_kernels.register_operator("packed_linear", packed_product, _product_shape)


@functools.cache
def _argmax_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C kernel panel_argmax, or None (the CPU kernels are off)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return cpu_kernels.load_function("panel_argmax", ctypes.c_int, [pointer, pointer, pointer, pointer, pointer, size, size, size])


def pack_linear_layers(model: Translator | Generator) -> None:
    """Replaces, in place, every nn.Linear of a float32 CPU model in eval mode (an untied lm_head
    among them; layers of other kinds stay) by a PackedLinear, and gives a tied model without an
    output projection a packed one (copies of the
    embedding table: the two no longer share memory, so the packed model is for inference only)."""
    parameter = next(model.parameters())
    assert parameter.device.type == "cpu" and parameter.dtype == torch.float32, "packing is for float32 weights on the CPU"
    assert packing_available(), "this torch build has no oneDNN"
    replace_linear_layers(model, lambda linear: PackedLinear(linear.weight, linear.bias))
    if model.lm_head is None and model.output_projection is None:  # a GGUF file's may be in blocks already
        model.output_projection = PackedLinear(model.embed.weight, None)
    model.eval()
