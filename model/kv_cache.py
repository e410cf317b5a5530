"""Preallocated key/value caches with fixed shapes, written in place at given positions.

Every decode step sees tensors of the same shape (slots x heads x max_len x head_dim per
layer), so memory is bounded by configuration and the GPU path can capture the step.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def cache_rows(slots: Sequence[int] | Tensor, device: torch.device) -> tuple[Tensor, Tensor | slice]:
    """Slots as an index tensor (for writes) and as a reader: a slice when a list of slots is
    ascending at a fixed stride (consecutive, or every k-th), so that reading the rows is a view
    instead of a gathered copy."""
    if isinstance(slots, Tensor):
        return slots, slots
    index = torch.tensor(slots, device=device)
    first, stride = slots[0], (slots[1] - slots[0] if len(slots) > 1 else 1)
    evenly_spaced = stride > 0 and list(slots) == list(range(first, first + stride * len(slots), stride))
    return index, slice(first, first + stride * len(slots), stride) if evenly_spaced else index


def read_rows(cache: Tensor, rows: Tensor | slice, length: int) -> Tensor:
    """cache (N, H, L, D) -> (B, H, length, D): a view for a slice of rows, else a gathered copy
    (index_select: several times faster on the CPU than indexing with the tensor)."""
    if isinstance(rows, slice):
        return cache[rows, :, :length]
    return cache[:, :, :length].index_select(0, rows)


@dataclass
class CacheView:
    """One layer's cache, bound to the rows (slots) and positions of the current step."""

    keys: Tensor  # (N, H, L, D) the layer's whole cache
    values: Tensor
    slots: Tensor  # (B,) cache rows of the batch
    rows: Tensor | slice  # the same rows for reading: a slice (a view, no copy) when they are consecutive
    positions: Tensor  # (B, T) positions of the new tokens
    length: int  # keys [0, length) are returned to attend over

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v: (B, H, T, D) for the new tokens. Returns (B, H, length, D) each."""
        rows = self.slots[:, None]  # (B, 1) broadcast against positions (B, T)
        self.keys[rows, :, self.positions] = k.transpose(1, 2).to(self.keys.dtype)  # indexed as (B, T, H, D)
        self.values[rows, :, self.positions] = v.transpose(1, 2).to(self.values.dtype)
        return read_rows(self.keys, self.rows, self.length), read_rows(self.values, self.rows, self.length)


class LayerCaches:
    """Keys and values for n_slots rows of `length` positions, every layer, preallocated:
    (n_slots, H, length, D) each."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_heads: int,
        length: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (n_slots, n_heads, length, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.n_slots, self.length = n_slots, length

    def copy_slots(self, src: Tensor, dst: Tensor, length: int | None = None) -> None:
        """Row dst[i] becomes a copy of row src[i] (beam search reordering), positions [0, length)
        only (default: all); sources are read first."""
        for cache in self.keys + self.values:
            prefix = cache if length is None else cache[:, :, :length]  # a view: the copy writes the cache
            prefix.index_copy_(0, dst, prefix.index_select(0, src))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class KVCache(LayerCaches):
    """Self-attention keys/values for n_slots sequences of up to max_len (= length) tokens."""

    @property
    def max_len(self) -> int:
        return self.length

    def views(self, slots: Sequence[int] | Tensor, positions: Tensor, length: int) -> list[CacheView]:
        """Per-layer views for a step writing `positions` (B, T) of rows `slots` (B,).

        Evenly spaced ascending slots given as a list are read through a slice, without gathering.
        """
        assert length <= self.max_len, "keys beyond the cache"  # positions are checked by the caller (no device sync here)
        index, rows = cache_rows(slots, self.keys[0].device)
        return [CacheView(k, v, index, rows, positions, length) for k, v in zip(self.keys, self.values, strict=True)]


class CrossAttentionCache(LayerCaches):
    """The translator's cross-attention keys/values per slot for sources of up to `length`
    tokens, computed once from the encoder output, and which source positions are real tokens.
    Built with LayerCaches' arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.src_valid = torch.zeros(self.n_slots, self.length, dtype=torch.bool, device=self.keys[0].device)

    def write(self, slots: Tensor, memory_kv: list[tuple[Tensor, Tensor]], src_valid: Tensor) -> None:
        """memory_kv: per layer (B, H, S, D); src_valid: (B, S) True at real source tokens."""
        S = src_valid.shape[1]
        assert self.length >= S, "source longer than the cross-attention cache"
        for (k, v), keys, values in zip(memory_kv, self.keys, self.values, strict=True):
            keys[slots, :, :S] = k.to(keys.dtype)
            values[slots, :, :S] = v.to(values.dtype)
        self.src_valid[slots] = False
        self.src_valid[slots, :S] = src_valid

    def read(self, slots: Sequence[int] | Tensor, length: int) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """Keys/values (B, H, length, D) per layer and the source mask (B, 1, 1, length)."""
        _, rows = cache_rows(slots, self.src_valid.device)
        kv = [(read_rows(k, rows, length), read_rows(v, rows, length)) for k, v in zip(self.keys, self.values, strict=True)]
        valid = self.src_valid[rows, :length] if isinstance(rows, slice) else self.src_valid[:, :length].index_select(0, rows)
        return kv, valid[:, None, None, :]

    def copy_slots(self, src: Tensor, dst: Tensor, length: int | None = None) -> None:
        super().copy_slots(src, dst, length)
        self.src_valid[dst] = self.src_valid[src]
