"""Encoder-decoder Transformer for translation (Vaswani et al. 2017), laid out as MarianMT.

Post-LN layers, sinusoidal positions, one embedding table shared by source, target and the
output projection, embeddings scaled by sqrt(d_model). A Hugging Face Marian folder (loading/hf/marian.py)
may untie the output projection (lm_head), add a bias to the logits (its final_logits_bias) and lay
the sinusoids out in halves.
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from model.attention import MultiHeadAttention, Segments
from model.config import TranslatorConfig
from model.kv_cache import PagedLayer, SourceLayer
from model.layers import DecoderLayer, EncoderLayer, project_logits
from model.masks import padding_mask
from model.positions import PositionEncoder


class Translator(nn.Module):
    def __init__(self, config: TranslatorConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_id)
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        self.positions = PositionEncoder(c.positions, c.max_len, c.d_model, c.n_heads, c.sinusoid_layout)
        self.dropout = nn.Dropout(c.dropout)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.activation, c.norm_first, c.norm_eps) for _ in range(c.n_encoder_layers)
        )
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.activation, c.norm_first, cross_attention=True, norm_eps=c.norm_eps)
            for _ in range(c.n_decoder_layers)
        )
        # Pre-LN stacks end with a LayerNorm; post-LN ones are already normalised.
        self.encoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps) if c.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps) if c.norm_first else nn.Identity()
        self.lm_head: nn.Module | None = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.logits_bias: Tensor | None
        self.register_buffer("logits_bias", torch.zeros(c.vocab_size) if c.logits_bias else None)  # (V,)
        self.output_projection: nn.Module | None = None  # tied only: set by model.packed_linear or model.quantize
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            # N(0, d^-1/2): scaled by sqrt(d) the inputs have unit variance and tied logits start small.
            nn.init.normal_(module.weight, std=self.config.d_model**-0.5)
            nn.init.zeros_(module.weight[self.config.pad_id])
        elif isinstance(module, MultiHeadAttention) and not module.cross:
            for weight in module.qkv_proj.weight.data.chunk(3):  # each of q, k, v as its own (d, d) matrix
                nn.init.xavier_uniform_(weight)

    def _embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        return self.dropout(self.positions.embed(self.embed(ids) * self.embed_scale, positions))  # (B, T, d)

    def encode(self, src_ids: Tensor) -> Tensor:
        """src_ids: (B, S), right-padded with pad_id. Returns the encoder output (B, S, d_model)."""
        B, S = src_ids.shape
        positions = torch.arange(S, device=src_ids.device).expand(B, S)
        mask = self.positions.bias(padding_mask(src_ids, self.config.pad_id), positions, positions)
        rope = self.positions.rope(positions)
        x = self._embed(src_ids, positions)
        for layer in self.encoder_layers:
            x = layer(x, mask, rope)
        return self.encoder_norm(x)

    def encode_ragged(self, ids: Tensor, lengths: Sequence[int]) -> Tensor:
        """The encoder output (1, N, d_model) of sources side by side: ids (N,), the sources one
        after another, lengths[i] tokens each, none of them padding (each attends over its own).
        Equal to `encode` of the sources padded, at their real tokens. Not with ALiBi positions."""
        assert self.positions.alibi_slopes is None, "ALiBi's biases take the padded encode"
        positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])[None]  # (1, N)
        segments, rope = Segments(lengths), self.positions.rope(positions)
        x = self._embed(ids[None], positions)
        for layer in self.encoder_layers:
            x = layer(x, segments, rope)
        return self.encoder_norm(x)

    def cross_key_values(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each decoder layer's cross-attention keys/values, (B, H, S, D): computed once per source."""
        kv = []
        for layer in self.decoder_layers:
            assert isinstance(layer, DecoderLayer) and layer.src_attn is not None
            kv.append(layer.src_attn.project_key_value(memory))
        return kv

    def decode(
        self,
        tgt_ids: Tensor,
        memory_kv: Sequence[tuple[Tensor, Tensor]] | Sequence[SourceLayer],
        src_mask: Tensor | None,
        positions: Tensor | None = None,
        caches: Sequence[PagedLayer] | None = None,
        cache_length: int = 0,
        memory_group: int = 1,
    ) -> Tensor:
        """Next-token logits for every target position, (B, T, vocab).

        tgt_ids: (B, T) starting with bos. memory_kv from `cross_key_values`; src_mask (B, 1, 1, S);
        or, in a paged step, the cross-attention cache's SourceLayers and no mask.
        Without caches the whole prefix is given (training, the plain reference decoder); with a
        paged step's PagedLayers, tgt_ids are the new tokens at `positions` (B, T), and the layers
        know their keys (cache_length is ignored). With memory_group k, every k consecutive rows
        share one source: memory_kv and src_mask then hold B / k rows, one per group (a sentence's beams).
        """
        if caches is not None:  # paged: the layers' own masks
            assert positions is not None, "a paged step gives its positions"
            self_mask, rope = None, self.positions.rope(positions)
        else:
            positions, self_mask, rope = self.positions.causal_self_attention(tgt_ids)
        x = self._embed(tgt_ids, positions)
        for i, layer in enumerate(self.decoder_layers):
            cache = caches[i] if caches is not None else None
            x = layer(x, self_mask, rope, cache, memory_kv[i], src_mask, memory_group)
        head = self.output_projection if self.output_projection is not None else self.lm_head
        return project_logits(self.decoder_norm(x), self.embed, head, self.logits_bias)

    def forward(self, src_ids: Tensor, tgt_ids: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, vocab) for target inputs tgt_ids given source src_ids."""
        memory = self.encode(src_ids)
        return self.decode(tgt_ids, self.cross_key_values(memory), padding_mask(src_ids, self.config.pad_id))
