"""The CPU's paged decode attention, a C kernel (model/csrc/paged_attention.c) compiled for this
machine's CPU on first use and loaded with ctypes: a decode step's attention reads each sequence's
keys and values in place in the block pool, once for all the query heads that share them, where
the plain path (model/kv_cache.py) first copies them out of their blocks and SDPA then reads each
key head once per query head. The plain path stays where the CPU kernels are off (model/cpu_kernels.py:
no C compiler, as in the GPU image), for other dtypes and devices, and for ALiBi's biased masks."""

import ctypes
import functools

import torch
from torch import Tensor

from model import cpu_kernels


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The loaded kernel, or None (the CPU kernels are off: model/cpu_kernels.py)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    argtypes = [pointer, pointer, pointer, pointer, size, pointer, pointer, size, size, size, size, size, size, ctypes.c_float]
    return cpu_kernels.load_function("paged_decode_attention", ctypes.c_int, argtypes)


def applies(pool: Tensor) -> bool:
    """Whether the kernel can attend over this pool (num_blocks, block_size, Hkv, D): float32 on the
    CPU, and the kernel built. (Masks with ALiBi's bias are the caller's to keep from it.)"""
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and kernel() is not None


def paged_decode_attention(queries: Tensor, keys: Tensor, values: Tensor, key_blocks: Tensor, lengths: Tensor) -> Tensor:
    """Attention (B, H, D) of queries (B, H, D), each row b over the first lengths[b] keys and values
    of its blocks key_blocks[b] (B, nb) in the pools keys, values (num_blocks, block_size, Hkv, D),
    scaled by 1/sqrt(D); query head h reads key head h // (H / Hkv). Requires `applies`. Under
    torch.compile the kernel is one opaque operation that reads the pools (it writes nothing), so a
    compiled step keeps its own writes of the new keys in the graph, done in place."""
    return _attend(queries, keys, values, key_blocks, lengths)


def _kernel_attention(queries: Tensor, keys: Tensor, values: Tensor, key_blocks: Tensor, lengths: Tensor) -> Tensor:
    """`paged_decode_attention` by the C kernel."""
    function = kernel()
    assert function is not None, "paged_decode_attention without its kernel (check applies())"
    _check_inputs(queries, keys, values, key_blocks, lengths)
    B, H, D = queries.shape
    num_blocks, block_size, Hkv, _ = keys.shape
    queries = queries.contiguous()
    key_blocks, lengths = key_blocks.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty(B, H, D)
    status = function(
        queries.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        key_blocks.data_ptr(),
        key_blocks.shape[1],
        lengths.data_ptr(),
        out.data_ptr(),
        B,
        H,
        Hkv,
        D,
        block_size,
        num_blocks,
        D**-0.5,
    )
    if status == -2:
        raise ValueError(f"paged_decode_attention: lengths past the rows' {key_blocks.shape[1]} blocks of {block_size}")
    if status == -3:
        raise ValueError("paged_decode_attention: a length below 1")
    if status == -4:
        raise ValueError(f"paged_decode_attention: a block id outside the pools' {num_blocks} blocks")
    if status != 0:
        raise MemoryError("paged_decode_attention: out of memory for its scores")
    return out


def _check_inputs(queries: Tensor, keys: Tensor, values: Tensor, key_blocks: Tensor, lengths: Tensor) -> None:
    """ValueError unless the shapes and dtypes are the kernel's (the C kernel checks lengths and block ids itself)."""
    if queries.dim() != 3 or queries.dtype != torch.float32:
        raise ValueError("paged_decode_attention: queries (B, H, D) float32")
    if (
        keys.dim() != 4
        or not (keys.is_contiguous() and values.is_contiguous())
        or {keys.dtype, values.dtype} != {torch.float32}
        or values.shape != keys.shape
    ):
        raise ValueError("paged_decode_attention: pools (num_blocks, block_size, Hkv, D) contiguous float32")
    B, H, D = queries.shape
    if keys.shape[2] < 1 or H % keys.shape[2] or keys.shape[3] != D:
        raise ValueError("paged_decode_attention: query heads a multiple of key heads, one head size")
    if key_blocks.dim() != 2 or key_blocks.shape[0] != B or lengths.dim() != 1 or lengths.shape[0] != B:
        raise ValueError("paged_decode_attention: block tables (B, nb) and lengths (B,) for the B queries")


def _attention_shape(queries: Tensor, keys: Tensor, values: Tensor, key_blocks: Tensor, lengths: Tensor) -> Tensor:
    return queries.new_empty(queries.shape)


_attend = cpu_kernels.register_operator("paged_decode_attention", _kernel_attention, _attention_shape)
