"""MarianMTModel (opus-mt as Helsinki-NLP ships it) as our Translator.

The sinusoids are laid out in halves (sinusoid_layout "halves"), so the weights need no
permutation; q/k/v of each self-attention are stacked [q; k; v] (qkv_proj); the logits bias is
final_logits_bias; decoding starts from decoder_start_token_id (pad, for opus-mt) and pad is never
generated (opus-mt's bad_words_ids). The tokenizer is MarianTokenizer's (loading/hf_tokenizers.py).
"""

import re

from loading.hf.adapter import Adapter, HFConfig, Table, Transform, Weight, modules, qkv
from loading.hf_tokenizers import MarianTextTokenizer
from model.config import TranslatorConfig

# Options of other fairseq-style models that our Translator does not have: refused when set.
REFUSED = ("normalize_before", "normalize_embedding", "layernorm_embedding", "add_final_layer_norm", "add_bias_logits")
# Our layer's modules <- a Marian layer's (each with .weight and .bias); a decoder layer's cross-attention.
LAYER = [
    ("self_attn.out_proj", "self_attn.out_proj"),
    ("attn_residual.norm", "self_attn_layer_norm"),
    ("feed_forward.fc1", "fc1"),
    ("feed_forward.fc2", "fc2"),
    ("ff_residual.norm", "final_layer_norm"),
]
CROSS = [
    *[(f"src_attn.{p}_proj", f"encoder_attn.{p}_proj") for p in ("q", "k", "v", "out")],
    ("src_residual.norm", "encoder_attn_layer_norm"),
]
ONE_ROW = Transform(load=lambda t: t.reshape(-1), save=lambda t: t.reshape(1, -1))  # final_logits_bias (1, V): our (V,)


def read(c: HFConfig) -> tuple[TranslatorConfig, MarianTextTokenizer]:
    """Absent keys take MarianConfig's defaults. The languages are the folder's (loading/folder.py)."""
    tokenizer = MarianTextTokenizer(c.folder)
    for option in REFUSED:
        if c.get(option):
            raise c.error(f"{option} {c.values[option]!r} is not supported")
    vocab_size = int(c.get("vocab_size", 58101))
    if not c.get("share_encoder_decoder_embeddings", True) or c.get("decoder_vocab_size") not in (None, vocab_size):
        raise c.error("share_encoder_decoder_embeddings False (a separate decoder vocabulary) is not supported")
    for part in ("attention_heads", "ffn_dim"):
        if c.get(f"encoder_{part}", 16) != c.get(f"decoder_{part}", 16):
            raise c.error(f"encoder_{part} != decoder_{part} is not supported")
    pad_id, eos_id = c.token_id("pad_token_id", 58100), c.token_id("eos_token_id", 0)
    start_id, bos_id = c.token_id("decoder_start_token_id", 58100), c.token_id("bos_token_id")
    if pad_id is None or eos_id is None or start_id is None:
        raise c.error("needs pad_token_id, eos_token_id and decoder_start_token_id")
    bad_words = c.generation().get("bad_words_ids") or []
    config = TranslatorConfig(
        vocab_size=vocab_size,
        d_model=int(c.get("d_model", 1024)),
        n_heads=int(c.get("encoder_attention_heads", 16)),
        d_ff=int(c.get("encoder_ffn_dim", 4096)),
        dropout=0.0,
        activation=c.activation("activation_function", "gelu"),
        norm_first=False,
        positions="sinusoidal",
        max_len=int(c.get("max_position_embeddings", 1024)),
        pad_id=pad_id,
        unk_id=tokenizer.unk_id,
        bos_id=start_id if bos_id is None else bos_id,
        eos_id=eos_id,
        suppressed_ids=tuple(sorted({pad_id} | {int(w[0]) for w in bad_words if isinstance(w, list) and len(w) == 1})),
        norm_eps=1e-5,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        n_encoder_layers=int(c.get("encoder_layers", 12)),
        n_decoder_layers=int(c.get("decoder_layers", 12)),
        decoder_start_id=start_id,
        scale_embedding=bool(c.get("scale_embedding", False)),
        logits_bias=True,
        sinusoid_layout="halves",
    )
    return config, tokenizer


def layers(c: TranslatorConfig) -> list[Weight]:
    table = [Weight("final_logits_bias", "logits_bias", transform=ONE_ROW)]
    for side, n_layers, pairs in [("encoder", c.n_encoder_layers, LAYER), ("decoder", c.n_decoder_layers, LAYER + CROSS)]:
        for i in range(n_layers):
            ours, theirs = f"{side}_layers.{i}.", f"model.{side}.layers.{i}."
            table += [*qkv(ours, theirs, "weight", 3 * [c.d_model]), *qkv(ours, theirs, "bias", 3 * [c.d_model])]
            table += modules(ours, theirs, pairs)
    return table


MARIAN = Adapter(
    architectures=("MarianMTModel",),
    kind="translator",
    read=read,
    table=Table(
        layers,
        embed="model.shared.weight",
        head="lm_head.weight",
        # Copies of the shared embedding, and the position tables Marian recomputes.
        ignored=re.compile(r"model\.(encoder|decoder)\.(embed_positions|embed_tokens)\.weight"),
        aliases={"model.shared.weight": ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")},
    ),
)
