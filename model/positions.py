"""Positional information: sinusoidal tables (Vaswani et al.), RoPE (Su et al.), ALiBi (Press et al.)."""

import math

import torch
from torch import Tensor, nn

from model.config import RopeScaling, SinusoidLayout
from model.masks import causal_mask


def sinusoidal_table(max_len: int, d_model: int, layout: SinusoidLayout = "interleaved") -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)). Shape (max_len, d_model).

    layout "halves" (Marian) puts the same sines in dims 0..d/2-1 and the cosines in d/2..d-1."""
    assert d_model % 2 == 0, "d_model must be even"
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    sines, cosines = (
        (slice(0, d_model // 2), slice(d_model // 2, d_model)) if layout == "halves" else (slice(0, None, 2), slice(1, None, 2))
    )
    table[:, sines] = torch.sin(position * inv_freq)
    table[:, cosines] = torch.cos(position * inv_freq)
    return table.float()


def rope_inv_freq(
    rotary_dim: int,
    base: float = 10000.0,
    scaling: RopeScaling = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_len: int = 8192,
) -> Tensor:
    """RoPE's frequencies base^(-2i/R), (R/2,) float64, rescaled as transformers' rope types:
    linear divides them all by factor; llama3 (Llama 3.1) divides the low frequencies (wavelengths
    above original_max_len / low_freq_factor) by factor, keeps the high ones (below
    original_max_len / high_freq_factor) and interpolates between."""
    assert rotary_dim % 2 == 0, "the rotated dims must be even"
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))  # (R/2,)
    if scaling == "linear":
        return inv_freq / factor
    if scaling == "llama3":
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original_max_len / low_freq_factor, inv_freq / factor, inv_freq)
        smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original_max_len / high_freq_factor) & (wavelen <= original_max_len / low_freq_factor)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(max_len: int, head_dim: int, base: float = 10000.0, inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin tables for rotary embeddings in the rotate-half layout (GPT-NeoX, Llama), from
    inv_freq (D/2,) when given (scaled: rope_inv_freq), else base^(-2i/D).

    Returns two tensors of shape (max_len, head_dim).
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, base)  # (D/2,)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (L, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (L, D)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates each (x_i, x_{i+R/2}) pair of x's first R dims by its position's angle; the other
    D - R dims pass through (partial rotary, GPT-NeoX's rotary_pct).

    x: (B, H, T, D) (any number of heads: queries and keys may come together); cos, sin:
    (B, 1, T, R), R <= D, already gathered at the tokens' positions.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)  # (B, H, T, D)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (B, H, T, D)
    return x * cos + rotated * sin


def alibi_slopes(n_heads: int) -> Tensor:
    """Head-specific slopes 2^(-8h/n) of ALiBi; for n not a power of two, the paper's interleaving."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two_slopes(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two_slopes(closest) + extra)


def alibi_bias(slopes: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor:
    """Linear distance penalty -slope * (q - k), added to attention scores.

    slopes: (H,); query_positions: (B, Tq); key_positions: (B, Tk). Returns (B, H, Tq, Tk).
    """
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).abs()  # (B, Tq, Tk)
    return -slopes[None, :, None, None] * distance[:, None, :, :].to(slopes.dtype)


class PositionEncoder(nn.Module):
    """Applies the configured kind of positional information; the other two hooks are no-ops.

    sinusoidal: added to the token embeddings (in sinusoid_layout); rope: rotates the first
    rotary_fraction of each head's dims of queries and keys, with base rope_base, or at
    rope_frequencies (R/2,) when given (scaled RoPE, a head_dim other than d_model / n_heads);
    alibi: biases scores.
    """

    def __init__(
        self,
        kind: str,
        max_len: int,
        d_model: int,
        n_heads: int,
        sinusoid_layout: SinusoidLayout = "interleaved",
        rotary_fraction: float = 1.0,
        rope_base: float = 10000.0,
        rope_frequencies: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.table: Tensor
        self.cos: Tensor
        self.sin: Tensor
        self.slopes: Tensor
        if kind == "sinusoidal":
            self.register_buffer("table", sinusoidal_table(max_len, d_model, sinusoid_layout), persistent=False)
        elif kind == "rope":
            rotary_dim = int(d_model // n_heads * rotary_fraction) if rope_frequencies is None else 2 * len(rope_frequencies)
            cos, sin = rope_tables(max_len, rotary_dim, rope_base, rope_frequencies)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif kind == "alibi":
            self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)
        else:
            raise ValueError(f"unknown positional encoding {kind!r}")

    @property
    def alibi_slopes(self) -> Tensor | None:
        """(H,) ALiBi's slopes when this encoder applies ALiBi (for paged steps' masks), else None."""
        return self.slopes if self.kind == "alibi" else None

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, T, d_model) token embeddings; positions: (B, T)."""
        return x + self.table[positions] if self.kind == "sinusoidal" else x

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """(cos, sin) at positions (B, T), each (B, 1, T, R): R the rotated dims of a head."""
        if self.kind != "rope":
            return None
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def causal_self_attention(self, ids: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """(positions, mask, rope) for causal self-attention over ids (B, T) at positions 0..T-1."""
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        return positions, self.bias(causal_mask(T, ids.device), positions, positions), self.rope(positions)

    def bias(self, mask: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """Folds ALiBi's distance penalty into a boolean mask; returns the mask unchanged otherwise."""
        if self.kind != "alibi":
            return mask
        bias = alibi_bias(self.slopes, query_positions, key_positions)  # (B, H, Tq, Tk)
        return bias.masked_fill(~mask, float("-inf"))
