"""Scaled dot-product attention and multi-head attention (one module for self- and cross-attention).

Masks follow torch's convention: a boolean mask is True where a query may attend to a key;
a float mask is added to the scores (ALiBi biases, -inf for blocked keys).
"""

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.kv_cache import PagedLayer, SourceLayer
from model.positions import apply_rope


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout: float = 0.0
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d_k)) V, written out; returns (output, attention weights).

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D), each key/value head shared by H / Hkv consecutive
    query heads (grouped-query attention; Hkv = H: multi-head); mask broadcastable to (B, H, Tq, Tk).
    Returns (B, H, Tq, D) and (B, H, Tq, Tk).
    """
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, Tk, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(dim=-1)
    if dropout > 0.0:
        weights = F.dropout(weights, p=dropout)
    return weights @ v, weights


class Segments:
    """Sequences side by side in one row, (1, N) tokens, the i-th `lengths[i]` long: each attends
    over its own tokens only (bidirectionally). A block-diagonal mask, computed block by block, so
    that a batch of sources of different lengths is encoded without padding."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.bounds = list(itertools.pairwise(itertools.accumulate(lengths, initial=0)))  # [first, last) of each

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (1, H, N, D). Returns (1, H, N, D)."""
        if len(self.bounds) == 1:
            return F.scaled_dot_product_attention(q, k, v)
        out = torch.empty_like(q)
        for first, last in self.bounds:
            out[:, :, first:last] = F.scaled_dot_product_attention(q[:, :, first:last], k[:, :, first:last], v[:, :, first:last])
        return out


class MultiHeadAttention(nn.Module):
    """Multi-head attention: h heads of scaled dot-product attention over learned projections;
    grouped-query when n_kv_heads < n_heads (each key/value head serves n_heads / n_kv_heads queries)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        cross: bool = False,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        out_bias: bool | None = None,
    ) -> None:
        """cross: attends over another sequence (keys and values from `project_key_value`); else
        self-attention, whose queries, keys and values come from one product (`qkv_proj`, the three
        weights stacked as [q; k; v], as gpt-fast lays them out: (H + 2 Hkv) D rows).
        n_kv_heads defaults to n_heads, head_dim to d_model / n_heads; bias is the q/k/v
        projections', out_bias the output projection's (default: bias)."""
        super().__init__()
        assert head_dim is not None or d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        assert n_heads % self.n_kv_heads == 0 and not (cross and self.n_kv_heads != n_heads), "grouped-query self-attention only"
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.dropout = dropout
        self.cross = cross
        inner, kv_inner = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if cross:
            self.q_proj = nn.Linear(d_model, inner, bias=bias)
            self.k_proj = nn.Linear(d_model, inner, bias=bias)
            self.v_proj = nn.Linear(d_model, inner, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, inner + 2 * kv_inner, bias=bias)
            self.register_load_state_dict_pre_hook(_stack_separate_projections)
        self.out_proj = nn.Linear(inner, d_model, bias=bias if out_bias is None else out_bias)
        # The fused kernel (torch SDPA) serves; the explicit path returns weights and is the reference.
        self.use_sdpa = True

    def _split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def _project_self(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's queries (B, H, T, D), keys and values (B, Hkv, T, D) of x (B, T, d_model),
        the queries and keys rotated by rope ((cos, sin), (B, 1, T, R)) when given."""
        B, T, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)  # (B, H + 2Hkv, T, D): q, k, v heads
        qk, v = qkv[:, : H + Hkv], qkv[:, H + Hkv :]  # (B, H + Hkv, T, D), (B, Hkv, T, D)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # the queries and keys in one rotation
        return qk[:, :H], qk[:, H:], v

    def projection_weights(self) -> list[tuple[Tensor, Tensor | None]]:
        """The query, key and value projections' (weight (rows, d_model), bias (rows,)) each, rows
        H D for queries and Hkv D for keys and values, whichever layout holds them (for exports)."""
        if self.cross:
            return [(p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)]
        sizes = [self.n_heads * self.head_dim, *2 * [self.n_kv_heads * self.head_dim]]
        biases = self.qkv_proj.bias.split(sizes) if self.qkv_proj.bias is not None else (None, None, None)
        return list(zip(self.qkv_proj.weight.split(sizes), biases, strict=True))

    def project_key_value(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention's keys and values of the attended sequence, (B, H, S, D) each; computed
        once per source."""
        return self._split_heads(self.k_proj(source)), self._split_heads(self.v_proj(source))

    def forward(
        self,
        x: Tensor,
        key_value: tuple[Tensor, Tensor] | SourceLayer | None = None,
        mask: Tensor | Segments | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: PagedLayer | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, d_model) queries. key_value: projected keys/values for cross-attention
        (from `project_key_value`), or a SourceLayer (a paged translator step's: one query per row,
        read by the CPU decode kernel, no mask); None means self-attention over x (or over the cache).
        mask: as scaled_dot_product_attention's, or Segments (self-attention of sequences side by
        side in x, B = 1).
        rope: (cos, sin) at the query positions, (B, 1, T, R), applied to self-attention queries and keys.
        cache: a PagedLayer (a paged step's, model/kv_cache.py, Hkv heads) takes the keys
        and attends each sequence over its own: x's B x T tokens are the step's, row by row (a
        ragged step's (1, N, d_model), or one token per row (R, 1, d_model)).
        Returns (B, T, d_model) and the weights (B, H, T, S) when asked for.
        """
        B, T, _ = x.shape
        if isinstance(cache, PagedLayer):  # a paged step: its B x T tokens flattened (row by row), keys from the blocks
            q, k, v = (
                t.transpose(0, 1).reshape(1, t.shape[1], B * T, self.head_dim) for t in self._project_self(x, rope)
            )  # (1, heads, N, D)
            out = cache.attend(q, k, v)[0].view(self.n_heads, B, T, self.head_dim).permute(1, 2, 0, 3)  # (B, T, H, D)
            return self.out_proj(out.reshape(B, T, self.n_heads * self.head_dim)), None
        if isinstance(key_value, SourceLayer):
            assert T == 1 and mask is None, "a SourceLayer attends one query per row over its own source"
            out = key_value.attend(self.q_proj(x).view(B, self.n_heads, self.head_dim))  # (B, H, D)
            return self.out_proj(out.view(B, T, self.n_heads * self.head_dim)), None
        if key_value is None:
            q, k, v = self._project_self(x, rope)  # (B, H, T, D), (B, Hkv, T, D) twice
        else:
            q, (k, v) = self._split_heads(self.q_proj(x)), key_value  # (B, H, T, D)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if isinstance(mask, Segments):
            assert key_value is None and not self.training, "Segments: self-attention, for inference"
            out = mask.attend(q, k, v)
        elif self.use_sdpa and not need_weights:
            grouped = self.n_kv_heads != self.n_heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=grouped)  # (B, H, T, D)
        else:
            out, weights = scaled_dot_product_attention(q, k, v, mask, dropout)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H D)
        return self.out_proj(out), weights


def _stack_separate_projections(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, *_: object) -> None:
    """Reads a self-attention saved with separate q_proj, k_proj and v_proj (checkpoints written
    before qkv_proj) into qkv_proj: the three stacked, [q; k; v]."""
    for field in ("weight", "bias"):
        names = [f"{prefix}{p}_proj.{field}" for p in "qkv"]
        if all(name in state_dict for name in names):
            state_dict[f"{prefix}qkv_proj.{field}"] = torch.cat([state_dict.pop(name) for name in names])
