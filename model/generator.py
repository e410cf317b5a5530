"""Decoder-only Transformer language model, laid out as GPT-NeoX (sequential residual, rotary positions).

A Hugging Face GPT-NeoX folder (Pythia; loading/hf/gpt_neox.py) may use the parallel residual, rotate
part of each head, and untie the output projection (lm_head). A Llama-style folder (Llama, Qwen2,
Mistral) brings RMSNorm, SwiGLU, grouped-query attention, its own head size and biases, and scaled RoPE."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from model.attention import MultiHeadAttention
from model.config import GeneratorConfig
from model.kv_cache import PagedLayer
from model.layers import DecoderLayer, FeedForward, make_norm, project_logits
from model.positions import PositionEncoder, rope_inv_freq


def _decoder_layer(c: GeneratorConfig) -> DecoderLayer:
    attention = MultiHeadAttention(
        c.d_model, c.n_heads, c.dropout, bias=c.qkv_bias, n_kv_heads=c.kv_heads, head_dim=c.head_dim, out_bias=c.out_bias
    )
    feed_forward = FeedForward(c.d_model, c.d_ff, c.activation, c.dropout, c.ff_bias, gated=c.feed_forward == "gated")
    return DecoderLayer(
        c.d_model,
        c.n_heads,
        c.d_ff,
        c.dropout,
        c.activation,
        c.norm_first,
        cross_attention=False,
        norm_eps=c.norm_eps,
        parallel_residual=c.parallel_residual,
        norm=c.norm,
        self_attn=attention,
        feed_forward=feed_forward,
    )


class Generator(nn.Module):
    def __init__(self, config: GeneratorConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        frequencies = rope_inv_freq(
            int(c.head_dim * c.rotary_fraction),
            c.rope_base,
            c.rope_scaling,
            c.rope_factor,
            c.rope_low_freq_factor,
            c.rope_high_freq_factor,
            c.rope_original_max_len,
        )  # (R/2,)
        if c.rope_freq_factors:
            frequencies = frequencies / torch.tensor(c.rope_freq_factors, dtype=torch.float64)
        self.positions = PositionEncoder(c.positions, c.max_len, c.d_model, c.n_heads, rope_frequencies=frequencies)
        self.dropout = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(_decoder_layer(c) for _ in range(c.n_layers))
        self.final_norm = make_norm(c.norm, c.d_model, c.norm_eps) if c.norm_first else nn.Identity()
        self.lm_head: nn.Module | None = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.output_projection: nn.Module | None = None  # tied only: set by model.packed_linear or model.quantize
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: Tensor) -> Tensor:
        """Next-token logits (B, T, vocab) for every position of ids (B, T), the whole (right-padded)
        sequences from position 0: training, scoring and the plain reference decoder. Serving
        decodes through `forward_ragged` over the paged cache."""
        positions, mask, rope = self.positions.causal_self_attention(ids)
        x = self.dropout(self.positions.embed(self.embed(ids), positions))  # (B, T, d)
        for layer in self.layers:
            x = layer(x, mask, rope)
        head = self.output_projection if self.output_projection is not None else self.lm_head
        return project_logits(self.final_norm(x), self.embed, head)

    def forward_ragged(self, ids: Tensor, positions: Tensor, layers: Sequence[PagedLayer], logit_rows: Tensor) -> Tensor:
        """Next-token logits (R, vocab) at logit_rows (R,) of one ragged step: ids and positions (N,)
        are the step's new tokens of every sequence, flattened (model/kv_cache.py ragged_step).
        Only the rows asked for go through the output projection. Inference only (no dropout)."""
        return self.logits(self.hidden_ragged(ids, positions, layers, logit_rows))

    def hidden_ragged(self, ids: Tensor, positions: Tensor, layers: Sequence[PagedLayer], rows: Tensor) -> Tensor:
        """forward_ragged's final hidden states (R, d) at rows (R,), before the output projection."""
        ids, positions = ids[None], positions[None]  # (1, N)
        rope = self.positions.rope(positions)
        x = self.positions.embed(self.embed(ids), positions)  # (1, N, d)
        for layer, cache in zip(self.layers, layers, strict=True):
            x = layer(x, None, rope, cache)
        return self.final_norm(x[0].index_select(0, rows))  # (R, d)

    def logits(self, hidden: Tensor) -> Tensor:
        """(R, d) final hidden states -> (R, vocab) next-token logits."""
        head = self.output_projection if self.output_projection is not None else self.lm_head
        return project_logits(hidden[None], self.embed, head)[0]

    def greedy_ids(self, hidden: Tensor) -> Tensor | None:
        """(R, d) final hidden states -> (R,) each row's most likely next token (argmax of `logits`,
        the first of equal ones) without computing the logits, where the output projection is the
        panel kernel's (model/packed_linear.py PackedLinear.argmax); None elsewhere, or where a row's
        logits hold a NaN or +inf."""
        head = self.output_projection if self.output_projection is not None else self.lm_head
        argmax = getattr(head, "argmax", None)
        return argmax(hidden) if argmax is not None else None
