"""Kernels over rows of logits on the CPU (model/csrc/top_k.c, built and loaded by
model/cpu_kernels.py). Each row's k most likely tokens and its log-sum-exp: one pass over the logits
for what a greedy step (k = 1) and a beam step (k = 2 x beam size) take from them, where torch reads
the whole vocabulary once for its argmax, once for log_softmax and once for top-k. Each row's
sampled token: two passes (its largest logit, then its weights' sums), where torch's draw made
five (max, subtract, exp, sum, and the cumulative search). torch's operations stay where the
kernels are off, and for other devices and dtypes."""

import ctypes
import functools

import torch
from torch import Tensor

from model import cpu_kernels


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The loaded kernel, or None (the CPU kernels are off: model/cpu_kernels.py)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return cpu_kernels.load_function("row_top_k", ctypes.c_int, [pointer, pointer, size, size, size, pointer, pointer, pointer, pointer])


@functools.cache
def draw_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The loaded draw kernel, or None (the CPU kernels are off)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    return cpu_kernels.load_function("row_draw", ctypes.c_int, [pointer, size, size, pointer, pointer, pointer, pointer, pointer])


def _applies(logits: Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and kernel() is not None


def row_top_k(logits: Tensor, k: int, with_lse: bool = True, rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """logits (N, V) without NaN, k <= V; rows (R,): which rows, in that order (None: all, R = N),
    read where they lie (no copy of the logits). Returns each row's k largest logits (R, k), best
    first, their ids (R, k) and, with_lse, each row's log-sum-exp (R,) (None otherwise). Of equal
    logits the kernel lists the lower id first (torch's top-k, where the kernel is off, in no set order)."""
    values, ids, lse, _ = _row_top_k(logits, k, with_lse, rows)
    return values, ids, lse


def _row_top_k(logits: Tensor, k: int, with_lse: bool, rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """row_top_k, and whether a row read holds a NaN or +inf (the kernel's results are then not its
    top k; False where torch's path ran)."""
    if logits.dim() != 2:
        raise ValueError(f"row_top_k: logits (N, V), not of shape {tuple(logits.shape)}")
    V = logits.shape[1]
    if not 1 <= k <= V:
        raise ValueError(f"row_top_k: k = {k} of {V} logits")
    if not _applies(logits):
        chosen = logits if rows is None else logits.index_select(0, rows.to(logits.device))
        values, ids = chosen.topk(k, dim=-1)
        return values, ids, torch.logsumexp(chosen, dim=-1) if with_lse else None, False
    logits = logits.contiguous()
    index = None if rows is None else rows.to(torch.int64).contiguous()
    R = logits.shape[0] if index is None else index.shape[0]
    if index is not None and R and not (int(index.min()) >= 0 and int(index.max()) < logits.shape[0]):
        raise ValueError(f"row_top_k: rows outside the logits' {logits.shape[0]}")
    values, ids = torch.empty(R, k), torch.empty(R, k, dtype=torch.long)
    lse = torch.empty(R) if with_lse else None
    poisoned = ctypes.c_int64(0)
    function = kernel()
    assert function is not None
    status = function(
        logits.data_ptr(),
        None if index is None else index.data_ptr(),
        R,
        V,
        k,
        values.data_ptr(),
        ids.data_ptr(),
        None if lse is None else lse.data_ptr(),
        ctypes.addressof(poisoned),
    )
    if status == -1:
        raise ValueError(f"row_top_k: k = {k} of {V} logits")
    if status != 0:
        raise MemoryError("row_top_k: out of memory for its chunk maxima")
    return values, ids, lse, bool(poisoned.value)


def greedy_ids(logits: Tensor) -> Tensor:
    """Each row's most likely id (R,) of logits (R, V), NaN read as -inf and +inf as the largest
    float; the first of equal ones, as torch's argmax. The kernel's one pass also finds whether a
    row holds a NaN or +inf (then it reads a cleaned copy), where torch's path checks with a pass of
    its own."""
    if not _applies(logits):
        if logits.numel() and bool(logits.amax() < float("inf")):  # NaN and +inf fail it
            return logits.argmax(-1)
        return cleaned_logits(logits).argmax(-1)
    _, ids, _, poisoned = _row_top_k(logits, 1, False, None)
    if poisoned:
        _, ids, _, _ = _row_top_k(cleaned_logits(logits), 1, False, None)
    return ids[:, 0]


def cleaned_logits(logits: Tensor) -> Tensor:
    """A copy of logits with NaN at -inf and +inf at the largest float: what an argmax reads (and a draw, of a poisoned row)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)


def row_draw(logits: Tensor, temperature: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """Each row's draw from softmax(logits / temperature) (S, V), -inf logits never drawn: the first
    token whose cumulative weight passes uniform x the row's total weight, weights exp((logit - the
    row's largest) / temperature) (S,) > 0, uniform (S,) in [0, 1]. Returns the tokens (S,), their
    weights (0: rounding drew past the row's last likely token) and the totals (S,) (NaN for a row
    with a NaN or +inf logit, or of -inf only); None where the kernel does not apply (torch's draw
    then: decoding/sampling.py)."""
    function = draw_kernel()
    if function is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"row_draw: logits (S, V), V > 0, not of shape {tuple(logits.shape)}")
    S = logits.shape[0]
    temperature = temperature.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float32).contiguous()
    if temperature.shape != (S,) or uniform.shape != (S,):
        raise ValueError(f"row_draw: temperature and uniform (S,) for {S} rows")
    if S and not (bool((temperature > 0).all()) and bool(torch.isfinite(temperature).all())):
        raise ValueError("row_draw: temperatures above 0")
    if S and not (bool((uniform >= 0).all()) and bool((uniform <= 1).all())):
        raise ValueError("row_draw: uniforms in [0, 1]")
    logits = logits.contiguous()
    tokens, weights, totals = torch.empty(S, dtype=torch.long), torch.empty(S), torch.empty(S)
    status = function(
        logits.data_ptr(),
        S,
        logits.shape[1],
        temperature.data_ptr(),
        uniform.data_ptr(),
        tokens.data_ptr(),
        weights.data_ptr(),
        totals.data_ptr(),
    )
    if status != 0:
        raise MemoryError("row_draw: out of memory for its chunk sums")
    return tokens, weights, totals
