"""Weights kept in GGUF's quantized blocks (llama.cpp's Q8_0, Q4_0, Q4_1): 32 weights of a row
share one fp16 scale (and, Q4_1, an fp16 min), stored with them as in the file:

    Q8_0  34 bytes: d, 32 x int8 q        w = d q             8.5 bits a weight
    Q4_0  18 bytes: d, 16 bytes of q      w = d (q - 8)       4.5
    Q4_1  20 bytes: d, m, 16 bytes of q   w = d q + m         5

and the k-quants of Q4_K_M-style files (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights whose 32s
or 16s have scales of their own, 4.5 / 5.5 / 6.6 bits a weight; multiplied with float32 activations).
(a 4-bit block's byte j holds weight j in its low half, weight j + 16 in its high half). A weight
(out, in) is a uint8 tensor (out, in / 32 * block bytes): the file's bytes, read as they are; or,
with 8-bit activations on a CPU with AVX2 or AVX-512 VNNI (set_activation_bits), the same bytes interleaved
by groups of 8 rows (Q8_0_X8, Q4_0_X8, Q4_1_X8: `interleave`), as llama.cpp repacks its Q4_0, so
that one vector instruction multiplies a block of 8 rows at once and a decode step reads its weights
at about the memory's speed.

A decode step's few rows go through the C kernel (model/csrc/block_linear.c), which dequantizes each
block in registers and multiplies it into up to 8 rows at once, float32 activations and sums; more
rows (a prompt) dequantize a slab of weight rows at a time into float32 and multiply it by torch's
GEMM. Interleaved blocks take every row count through their 8-bit kernel (faster than the slabs at
128 rows too). Without the kernels (the GPU, no C compiler) torch dequantizes the weight and
multiplies: correct, not fast. The kernel's sums run in another order than torch's, so the paths
differ by float32 rounding (tests/model/test_gguf.py bounds it).
"""

import ctypes
import functools
import mmap
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import cpu_kernels

BLOCK = 32  # weights a block (a k-quant's super-block holds 8)
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14  # ggml's type ids (gguf.GGMLQuantizationType)
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q4_K: 144, Q5_K: 176, Q6_K: 210}  # a block's, a k-quant's super-block's
K_QUANTS = frozenset({Q4_K, Q5_K, Q6_K})  # super-blocks of 256 weights
# Ours (block_linear.c's): a type's blocks of 8 weight rows interleaved; the file's type of each.
Q8_0_X8, Q4_0_X8, Q4_1_X8 = 108, 102, 103
FILE_TYPE = {Q8_0_X8: Q8_0, Q4_0_X8: Q4_0, Q4_1_X8: Q4_1}
INTERLEAVED = {file_type: ours for ours, file_type in FILE_TYPE.items()}
GROUP_ROWS = 8  # the weight rows an interleaved group holds
BLOCK_BYTES |= {ours: BLOCK_BYTES[file_type] for ours, file_type in FILE_TYPE.items()}
TYPE_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
TYPE_NAMES |= {ours: TYPE_NAMES[file_type] + "x8" for ours, file_type in FILE_TYPE.items()}
# Up to this many rows a call go through the kernel; more dequantize slabs of weight rows for torch's
# GEMM (on the AMD EPYC, 49,152 x 576 Q8_0: the kernel 6.1 ms at 8 rows, 17.2 at 16, the slabs 15.7 at 16).
KERNEL_ROWS = 8
SLAB_FLOATS = 1 << 18  # the weights a slab dequantizes at once (1 MB: an L2 cache's worth)


def block_weights(ggml_type: int) -> int:
    """The weights one block of ggml_type holds: 32, a k-quant's super-block 256."""
    return 256 if ggml_type in K_QUANTS else BLOCK


def row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one weight row of in_features (a multiple of block_weights) in blocks of ggml_type."""
    return in_features // block_weights(ggml_type) * BLOCK_BYTES[ggml_type]


def _halves(blocks: Tensor, start: int, dtype: torch.dtype) -> Tensor:
    """(..., bytes) blocks -> (..., 1): the fp16 at byte `start` of each block, in dtype."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).to(dtype)


def _granules(ggml_type: int) -> tuple[int, int]:
    """A block's bytes before its weights (scale, min) and its weights' granules of 4 bytes."""
    return (4 if ggml_type == Q4_1 else 2), (8 if ggml_type == Q8_0 else 4)


def interleave(blocks: Tensor, ggml_type: int) -> Tensor:
    """(out, row_bytes) blocks of Q8_0, Q4_0 or Q4_1 (out a multiple of 8) -> the same bytes as
    INTERLEAVED[ggml_type]'s (out, row_bytes): each group of 8 rows as its blocks in order, block b
    its 8 rows' weight granules (4 bytes) as (granule, row), then their 8 scales, then (Q4_1) their
    8 mins (block_linear.c's layout)."""
    out, size = blocks.shape[0], BLOCK_BYTES[ggml_type]
    head, granules = _granules(ggml_type)
    groups = blocks.view(out // GROUP_ROWS, GROUP_ROWS, -1, size)  # (G, 8 rows, blocks, bytes)
    weights = groups[..., head:].unflatten(-1, (granules, 4)).permute(0, 2, 3, 1, 4)  # (G, blocks, granule, row, 4)
    halves = [groups[..., i : i + 2].transpose(1, 2) for i in range(0, head, 2)]  # (G, blocks, row, 2): scales, mins
    parts = [weights.flatten(2), *(h.flatten(2) for h in halves)]
    return torch.cat(parts, dim=-1).view(out, -1)


def deinterleave(blocks: Tensor, ggml_type: int) -> Tensor:
    """`interleave`'s inverse: blocks of FILE_TYPE[ggml_type] as the file lays them out."""
    file_type = FILE_TYPE[ggml_type]
    out, size = blocks.shape[0], BLOCK_BYTES[file_type]
    head, granules = _granules(file_type)
    groups = blocks.view(out // GROUP_ROWS, -1, GROUP_ROWS * size)  # (G, blocks, 8 block's bytes)
    weights = groups[..., : 4 * GROUP_ROWS * granules].unflatten(-1, (granules, GROUP_ROWS, 4)).permute(0, 3, 1, 2, 4)
    start = 4 * GROUP_ROWS * granules
    halves = [groups[..., start + 16 * i : start + 16 * (i + 1)].unflatten(-1, (GROUP_ROWS, 2)).transpose(1, 2) for i in range(head // 2)]
    return torch.cat([*halves, weights.flatten(3)], dim=-1).reshape(out, -1)


def dequantize(blocks: Tensor, ggml_type: int, in_features: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """(out, row_bytes) uint8 blocks -> (out, in_features) weights in dtype, by torch (any device; the
    k-quants by the gguf package's numpy dequantizer, on the CPU)."""
    if ggml_type in FILE_TYPE:
        blocks, ggml_type = deinterleave(blocks, ggml_type), FILE_TYPE[ggml_type]
    out = blocks.shape[0]
    if ggml_type in K_QUANTS:
        import gguf.quants

        values = gguf.quants.dequantize(blocks.cpu().numpy(), gguf.GGMLQuantizationType(ggml_type))  # (out, in)
        return torch.from_numpy(values.astype(np.float32)).to(blocks.device, dtype)
    b = blocks.view(out, in_features // BLOCK, BLOCK_BYTES[ggml_type])  # (out, blocks, bytes)
    d = _halves(b, 0, dtype)  # (out, blocks, 1)
    if ggml_type == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).to(dtype)  # (out, blocks, 32)
        return (q * d).view(out, in_features)
    nibbles = b[..., 4:] if ggml_type == Q4_1 else b[..., 2:]  # (out, blocks, 16)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).to(dtype)  # (out, blocks, 32)
    w = q * d + _halves(b, 2, dtype) if ggml_type == Q4_1 else (q - 8) * d
    return w.view(out, in_features)


def quantize(weight: Tensor, ggml_type: int) -> Tensor:
    """(out, in) float weights -> (out, row_bytes) uint8 blocks, by the gguf package's quantizers
    (llama.cpp's reference rounding). in must be a multiple of BLOCK."""
    import gguf.quants  # the GGUF package: only where weights are quantized

    if weight.shape[-1] % BLOCK:
        raise ValueError(f"{weight.shape[-1]} input features: not a multiple of {BLOCK}")
    array = weight.detach().to("cpu", torch.float32).numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(array, gguf.GGMLQuantizationType(ggml_type))))


@functools.cache
def _kernels() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """The C kernels block_linear and block_rows, or None (model/cpu_kernels.py)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    linear = cpu_kernels.load_function("block_linear", ctypes.c_int, [pointer, pointer, pointer, pointer, size, size, size, size])
    rows = cpu_kernels.load_function("block_rows", ctypes.c_int, [pointer, pointer, size, size, size, pointer])
    return None if linear is None or rows is None else (linear, rows)


@functools.cache
def _q8_kernels() -> tuple[Callable[..., None], Callable[..., int], Callable[[int], int]] | None:
    """The C kernels quantize_rows_q8 and block_linear_q8 (8-bit activations) and
    block_linear_q8_reads (whether the second multiplies a type in this build), or None where they
    are not built here (no x86 AVX2, or the kernels off)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    available = cpu_kernels.load_function("block_linear_q8_available", ctypes.c_int, [])
    if available is None or not available():
        return None
    quantize_rows = cpu_kernels.load_function("quantize_rows_q8", None, [pointer, size, size, pointer, pointer, pointer, size])
    linear = cpu_kernels.load_function("block_linear_q8", ctypes.c_int, [pointer] * 6 + [size] * 4)
    reads = cpu_kernels.load_function("block_linear_q8_reads", ctypes.c_int, [size])
    assert quantize_rows is not None and linear is not None and reads is not None
    return quantize_rows, linear, reads


def _kernels_built() -> bool:
    return _kernels() is not None


# A constant to torch.compile's tracing (it would trace into the functools.cache function).
kernels_built: Callable[[], bool] = torch.compiler.assume_constant_result(_kernels_built)


def _kernel_applies(x: Tensor, blocks: Tensor) -> bool:
    return kernels_built() and x.device.type == "cpu" and x.dtype == torch.float32 and blocks.device.type == "cpu"


def _check(blocks: Tensor, ggml_type: int, in_features: int) -> None:
    if ggml_type not in BLOCK_BYTES or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError(f"blocks: (out, row_bytes) contiguous uint8 of {', '.join(TYPE_NAMES.values())}")
    if in_features % block_weights(ggml_type) or blocks.shape[1] != row_bytes(ggml_type, in_features):
        raise ValueError(f"blocks: {blocks.shape[1]} bytes a row, {in_features} input features of {TYPE_NAMES[ggml_type]}")
    if ggml_type in FILE_TYPE and blocks.shape[0] % GROUP_ROWS:
        raise ValueError(f"blocks: {blocks.shape[0]} rows of {TYPE_NAMES[ggml_type]}, in groups of {GROUP_ROWS}")


def _check_ids(ids: Tensor, rows: int) -> Tensor:
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < rows):
        raise IndexError(f"an id out of [0, {rows})")
    return ids


def dequantize_rows(blocks: Tensor, ggml_type: int, in_features: int, ids: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """The weight rows ids (all, where None) as float32 (n, in_features), written into `out` when
    given (contiguous, that shape): the C kernel on the CPU, else torch. IndexError for an id
    outside [0, rows)."""
    _check(blocks, ggml_type, in_features)
    kernels = _kernels()
    if ids is not None:
        ids = _check_ids(ids, blocks.shape[0])
    if kernels is None or blocks.device.type != "cpu":
        return dequantize(blocks if ids is None else blocks[ids.to(blocks.device)], ggml_type, in_features)
    n = blocks.shape[0] if ids is None else ids.numel()
    dst = torch.empty(n, in_features) if out is None else out
    if dst.shape != (n, in_features) or dst.dtype != torch.float32 or not dst.is_contiguous():
        raise ValueError(f"dequantize_rows: out ({n}, {in_features}) contiguous float32")
    failed = kernels[1](blocks.data_ptr(), None if ids is None else ids.data_ptr(), n, in_features, ggml_type, dst.data_ptr())
    assert not failed, f"block_rows refused type {ggml_type} that _check accepts"
    return dst


def embedding_rows(blocks: Tensor, ids: Tensor, in_features: int, ggml_type: int) -> Tensor:
    """The embedding rows of ids (N,) as float32 (N, in_features): dequantize_rows as an operator."""
    return dequantize_rows(blocks, ggml_type, in_features, ids)


def _rows_shape(blocks: Tensor, ids: Tensor, in_features: int, ggml_type: int) -> Tensor:
    return blocks.new_empty(ids.shape[0], in_features, dtype=torch.float32)


block_embedding = cpu_kernels.register_operator("block_embedding", embedding_rows, _rows_shape)


def block_product(
    rows: Tensor,
    blocks: Tensor,
    bias: Tensor | None,
    out_features: int,
    ggml_type: int,
    activation_bits: int = 32,
    kernel_rows: int = KERNEL_ROWS,
) -> Tensor:
    """rows (N, in) float32 times the weight in blocks (out_features, row_bytes), plus bias: (N, out_features).
    activation_bits 32: up to kernel_rows rows by the C kernel, more (and an interleaved type's rows)
    through slabs of dequantized rows and torch's GEMM. 8 (where q8_available() and its kernel reads
    the type here): the rows quantized to 8 bits in blocks of 32, every row by integer dot products
    (llama.cpp's way); elsewhere as 32.
    operators.cpp's block_linear kernel equals this."""
    n, in_features = rows.shape
    _check(blocks, ggml_type, in_features)
    if blocks.shape[0] != out_features or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features)):
        raise ValueError(f"block_linear: blocks ({out_features}, row_bytes) and bias ({out_features},) float32")
    kernels = _kernels()
    assert kernels is not None, "block_product without its kernel"
    rows = rows.contiguous()
    bias = None if bias is None else bias.contiguous()
    bias_pointer = None if bias is None else bias.data_ptr()
    q8 = _q8_kernels() if activation_bits == 8 else None
    if q8 is not None and q8[2](ggml_type):
        quantized = torch.empty(n, in_features, dtype=torch.int8)
        scales = torch.empty(2, n, in_features // BLOCK)  # each block's scale, and scale x sum of its values
        q8[0](rows.data_ptr(), n, in_features, quantized.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr(), ggml_type)
        y = rows.new_empty(n, out_features)
        failed = q8[1](
            quantized.data_ptr(),
            scales[0].data_ptr(),
            scales[1].data_ptr(),
            blocks.data_ptr(),
            bias_pointer,
            y.data_ptr(),
            n,
            in_features,
            out_features,
            ggml_type,
        )
        assert not failed, f"block_linear_q8 refused type {ggml_type} that block_linear_q8_reads accepts"
        return y
    if n > kernel_rows or ggml_type in FILE_TYPE:
        slab = max(GROUP_ROWS, SLAB_FLOATS // in_features // GROUP_ROWS * GROUP_ROWS)  # whole groups
        weights = rows.new_empty(slab, in_features)  # one buffer for every slab: a fresh one would fault its pages in each time
        pieces = []
        for o in range(0, out_features, slab):
            k = min(slab, out_features - o)
            pieces.append(rows @ dequantize_rows(blocks[o : o + k], ggml_type, in_features, out=weights[:k]).T)  # (N, k)
        y = torch.cat(pieces, dim=1)  # (N, out)
        return y if bias is None else y + bias
    y = rows.new_empty(n, out_features)
    failed = kernels[0](rows.data_ptr(), blocks.data_ptr(), bias_pointer, y.data_ptr(), n, in_features, out_features, ggml_type)
    assert not failed, f"block_linear refused type {ggml_type} that _check accepts"
    return y


def _product_shape(
    rows: Tensor,
    blocks: Tensor,
    bias: Tensor | None,
    out_features: int,
    ggml_type: int,
    activation_bits: int = 32,
    kernel_rows: int = KERNEL_ROWS,
) -> Tensor:
    return rows.new_empty(rows.shape[0], out_features)


block_linear = cpu_kernels.register_operator("block_linear", block_product, _product_shape)


class BlockLinear(nn.Module):
    """y = x W^T + b with W (out, in) kept in blocks of a GGUF type (Q8_0, Q4_0, Q4_1). Inference only."""

    blocks: Tensor
    bias: Tensor | None

    def __init__(self, blocks: Tensor, ggml_type: int, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        _check(blocks, ggml_type, in_features)
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, blocks.shape[0]
        self.activation_bits = 32  # 8: a few rows' activations quantized to 8 bits (set_activation_bits)

    @classmethod
    def quantized(cls, weight: Tensor, bias: Tensor | None, ggml_type: int) -> "BlockLinear":
        """A float layer's weight (out, in) quantized to ggml_type."""
        return cls(quantize(weight, ggml_type), ggml_type, weight.shape[1], bias)

    @property
    def weight(self) -> Tensor:
        """W (out, in) float32, dequantized (a copy)."""
        return dequantize_rows(self.blocks, self.ggml_type, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in). Returns (..., out) in x's dtype."""
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if _kernel_applies(rows, self.blocks):
            # A prompt's many rows: the slabs, faster there than the file layout's 8-bit kernel; the
            # interleaved layout's is faster at every count (on the AMD EPYC, 1536 x 576 Q4_1 at 128
            # rows: 1.2 ms, the slabs 2.6).
            interleaved = self.ggml_type in FILE_TYPE
            bits = self.activation_bits if rows.shape[0] <= KERNEL_ROWS or interleaved else 32
            y = block_linear(rows, self.blocks, self.bias, self.out_features, self.ggml_type, bits, KERNEL_ROWS)
        else:
            weight = dequantize(self.blocks, self.ggml_type, self.in_features, x.dtype)  # (out, in)
            y = F.linear(rows, weight, None if self.bias is None else self.bias.to(x.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, type={TYPE_NAMES[self.ggml_type]}, activation_bits={self.activation_bits}"


def q8_available() -> bool:
    """The 8-bit activation kernels are built here (x86 with AVX2)."""
    return _q8_kernels() is not None


@functools.cache
def interleaved_available() -> bool:
    """The interleaved types' kernels are built here (x86 with AVX2, or AVX-512 with VNNI)."""
    available = cpu_kernels.load_function("block_linear_x8_available", ctypes.c_int, [])
    return available is not None and bool(available())


def _layout_for(blocks: Tensor, ggml_type: int, bits: int) -> int:
    """The type a layer's blocks take at `bits`: interleaved at 8 where the kernels read it (on the
    CPU, whole groups of rows), the file's otherwise."""
    file_type = FILE_TYPE.get(ggml_type, ggml_type)
    wanted = bits == 8 and file_type in INTERLEAVED and blocks.device.type == "cpu" and blocks.shape[0] % GROUP_ROWS == 0
    return INTERLEAVED[file_type] if wanted and interleaved_available() else file_type


MADV_DONTNEED = 4  # Linux's madvise advice


def release_file_pages(tensor: Tensor) -> bool:
    """Drops from this process's resident set the whole pages of `tensor` where it lies in a private
    file mapping (a GGUF file's tensors, mapped copy-on-write and only read): a page read again
    comes back from the file, so this is safe whoever still reads them. Returns whether it did;
    False for any other memory (Linux only)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in maps:
        fields = line.split(maxsplit=5)  # range, permissions, offset, device, inode, path
        low, high = (int(a, 16) for a in fields[0].split("-"))
        if low <= start and end <= high:
            if len(fields) < 6 or fields[1][3] != "p" or not fields[5].startswith("/"):
                return False
            first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            return last > first and libc.madvise(first, last - first, MADV_DONTNEED) == 0
    return False


def set_activation_bits(model: nn.Module, bits: int) -> int:
    """Sets, in place, the activations of every BlockLinear in model: 8 (quantized to 8 bits in blocks
    of 32 for a decode step's rows, as llama.cpp does: faster, differs from float32 by rounding) or
    32 (float32: what dequantizing the file computes), and lays out each layer's blocks (and a tied
    embedding's, the same tensor) for that: interleaved at 8 where `interleaved_available()`, as the
    file at 32; the pages of a file's tensor laid out anew leave the resident set
    (release_file_pages). Returns how many layers it set."""
    if bits not in (8, 32):
        raise ValueError(f"activation bits {bits}: 8 or 32")
    laid_out: dict[int, Tensor] = {}  # a converted tensor by its old data_ptr: shared blocks stay shared
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    for module in model.modules():
        if not isinstance(module, BlockLinear | BlockEmbedding):
            continue
        ggml_type = _layout_for(module.blocks, module.ggml_type, bits)
        if ggml_type != module.ggml_type:
            blocks = module.blocks
            if blocks.data_ptr() not in laid_out:
                changed = interleave(blocks, module.ggml_type) if ggml_type in FILE_TYPE else deinterleave(blocks, module.ggml_type)
                laid_out[blocks.data_ptr()] = changed
                release_file_pages(blocks)  # its bytes are in `changed` now
            module.blocks, module.ggml_type = laid_out[blocks.data_ptr()], ggml_type
        if isinstance(module, BlockLinear):
            module.activation_bits = bits
    return len(layers)


class BlockEmbedding(nn.Module):
    """An embedding table (vocab, d) kept in blocks of a GGUF type: a lookup dequantizes its rows."""

    blocks: Tensor

    def __init__(self, blocks: Tensor, ggml_type: int, embedding_dim: int) -> None:
        super().__init__()
        _check(blocks, ggml_type, embedding_dim)
        self.register_buffer("blocks", blocks)
        self.ggml_type, self.embedding_dim, self.num_embeddings = ggml_type, embedding_dim, blocks.shape[0]

    def forward(self, ids: Tensor) -> Tensor:
        """ids (...) -> (..., embedding_dim) float32."""
        rows = ids.reshape(-1)  # (N,)
        if kernels_built() and self.blocks.device.type == "cpu":
            found = block_embedding(self.blocks, rows, self.embedding_dim, self.ggml_type)  # an operation under torch.compile
        else:
            found = dequantize_rows(self.blocks, self.ggml_type, self.embedding_dim, rows)
        return found.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> BlockLinear:
        """The tied output projection: the same blocks (no copy) as a BlockLinear (vocab outputs)."""
        return BlockLinear(self.blocks, self.ggml_type, self.embedding_dim)


class ConcatenatedLinear(nn.Module):
    """Several linear layers over the same input whose outputs are concatenated, for a stacked
    projection (q, k and v) whose parts a file keeps in different types."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
