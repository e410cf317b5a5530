"""The boxes of the Transformer diagram: feed-forward (gated too: Llama's SwiGLU), encoder layer, decoder
layer, pre-/post-norm residuals (LayerNorm, or Llama's RMSNorm)."""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import MultiHeadAttention, Segments
from model.config import Activation, Norm
from model.kv_cache import PagedLayer, SourceLayer

ACTIVATIONS: dict[Activation, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # the erf form
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


class FeedForward(nn.Module):
    """FFN(x) = W2 act(W1 x + b1) + b2, applied to each position alike; gated (Shazeer, 2020):
    W2 (act(W1 x) * W_up x), SwiGLU with silu (Llama's gate_proj, up_proj, down_proj)."""

    def __init__(self, d_model: int, d_ff: int, activation: Activation, dropout: float, bias: bool = True, gated: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.up = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)
        self.activation = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation(self.fc1(x))  # (B, T, d_ff)
        return self.fc2(self.dropout(h if self.up is None else h * self.up(x)))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang and Sennrich, 2019): LayerNorm without the mean and
    the bias. Computed in float32 whatever the input's dtype, as Llama's."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(kind: Norm, d_model: int, eps: float) -> nn.Module:
    return RMSNorm(d_model, eps) if kind == "rmsnorm" else nn.LayerNorm(d_model, eps=eps)


class Residual(nn.Module):
    """x + Sublayer(x) with its norm: before the sublayer (pre-LN) or after the sum (post-LN, the paper)."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, norm_eps: float, norm: Norm = "layernorm") -> None:
        super().__init__()
        self.norm = make_norm(norm, d_model, norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def branch(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """The pre-LN branch, Sublayer(LayerNorm(x)), without the residual."""
        return self.dropout(sublayer(self.norm(x)))

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            return x + self.branch(x, sublayer)
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention over the source, then feed-forward."""

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int, dropout: float, activation: Activation, norm_first: bool, norm_eps: float
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.feed_forward = FeedForward(d_model, d_ff, activation, dropout)
        self.attn_residual = Residual(d_model, dropout, norm_first, norm_eps)
        self.ff_residual = Residual(d_model, dropout, norm_first, norm_eps)

    def forward(self, x: Tensor, mask: Tensor | Segments | None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """x: (B, S, d_model); mask: (B, 1, 1|S, S), or Segments (sources side by side, B = 1).
        Returns (B, S, d_model)."""
        x = self.attn_residual(x, lambda h: self.self_attn(h, mask=mask, rope=rope)[0])
        return self.ff_residual(x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output (encoder-decoder only), feed-forward.

    parallel_residual (pre-LN, decoder-only: GPT-NeoX): x + Attn(LN1(x)) + FFN(LN2(x)), both
    branches reading the same x; otherwise the sublayers run one after the other. A generator may
    bring its own self-attention (grouped-query, other head sizes or biases) and feed-forward
    (gated, without biases) modules, and RMSNorm."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        activation: Activation,
        norm_first: bool,
        cross_attention: bool,
        norm_eps: float,
        parallel_residual: bool = False,
        norm: Norm = "layernorm",
        self_attn: MultiHeadAttention | None = None,
        feed_forward: FeedForward | None = None,
    ) -> None:
        super().__init__()
        assert not parallel_residual or (norm_first and not cross_attention), "a parallel residual is pre-LN and decoder-only"
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout) if self_attn is None else self_attn
        self.attn_residual = Residual(d_model, dropout, norm_first, norm_eps, norm)
        self.src_attn = MultiHeadAttention(d_model, n_heads, dropout, cross=True) if cross_attention else None
        self.src_residual = Residual(d_model, dropout, norm_first, norm_eps, norm) if cross_attention else None
        self.feed_forward = FeedForward(d_model, d_ff, activation, dropout) if feed_forward is None else feed_forward
        self.ff_residual = Residual(d_model, dropout, norm_first, norm_eps, norm)
        self.parallel_residual = parallel_residual

    def forward(
        self,
        x: Tensor,
        self_mask: Tensor | None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: PagedLayer | None = None,
        memory_kv: tuple[Tensor, Tensor] | SourceLayer | None = None,
        memory_mask: Tensor | None = None,
        memory_group: int = 1,
    ) -> Tensor:
        """x: (B, T, d_model). memory_kv: this layer's cross-attention keys/values, (B / memory_group,
        H, S, D), and memory_mask (B / memory_group, 1, 1, S): each memory_group consecutive rows of x
        attend to one source (a sentence's beams), whose keys are then read once for all of them.
        Or a SourceLayer (a paged translator step's, model/kv_cache.py): each row's own source, no
        mask, memory_group 1.
        Returns (B, T, d_model)."""

        def self_attention(h: Tensor) -> Tensor:
            return self.self_attn(h, mask=self_mask, rope=rope, cache=cache)[0]

        if self.parallel_residual:
            return x + self.attn_residual.branch(x, self_attention) + self.ff_residual.branch(x, self.feed_forward)
        x = self.attn_residual(x, self_attention)
        if self.src_attn is not None and self.src_residual is not None:
            assert memory_kv is not None, "an encoder-decoder layer needs the encoder output"
            src_attn = self.src_attn

            def cross_attention(h: Tensor) -> Tensor:
                B, T, d = h.shape
                queries = h.reshape(B // memory_group, memory_group * T, d)  # a group's rows: one query sequence
                return src_attn(queries, key_value=memory_kv, mask=memory_mask)[0].reshape(B, T, d)

            x = self.src_residual(x, cross_attention)
        return self.ff_residual(x, self.feed_forward)


def project_logits(h: Tensor, embed: nn.Embedding, head: nn.Module | None, bias: Tensor | None = None) -> Tensor:
    """(B, T, d_model) -> (B, T, vocab): the embedding table transposed (tied output) or `head`
    (an untied model's lm_head, or the packed or int8 copy of the tied table that model.packed_linear
    or model.quantize set as output_projection), plus the logits bias if the model has one (Marian's)."""
    logits = head(h) if head is not None else h @ embed.weight.T
    return logits if bias is None else logits + bias


def replace_linear_layers(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replaces, in place, every nn.Linear inside model by make(linear)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
