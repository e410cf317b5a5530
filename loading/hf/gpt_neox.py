"""GPTNeoXForCausalLM (Pythia) as our Generator.

query_key_value holds each head's [q_h; k_h; v_h] rows, regrouped into [q; k; v] (qkv_proj);
parallel residual, partial rotary and an untied embed_out as the config says. The tokenizer is the
folder's tokenizer.json.
"""

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from loading.hf.adapter import BOTH, Adapter, HFConfig, Table, Transform, Weight, modules
from loading.hf_tokenizers import FastTextTokenizer, fast_tokenizer_of
from model.config import GeneratorConfig

if TYPE_CHECKING:
    from torch import Tensor

# Our layer's modules <- a GPT-NeoX layer's (each with .weight and .bias), but for query_key_value.
LAYER = [
    ("self_attn.out_proj", "attention.dense"),
    ("attn_residual.norm", "input_layernorm"),
    ("ff_residual.norm", "post_attention_layernorm"),
    ("feed_forward.fc1", "mlp.dense_h_to_4h"),
    ("feed_forward.fc2", "mlp.dense_4h_to_h"),
]


def read(c: HFConfig) -> tuple[GeneratorConfig, FastTextTokenizer]:
    """Absent keys take GPTNeoXConfig's defaults."""
    if not c.get("attention_bias", True):
        raise c.error("attention_bias False is not supported")
    bos_id, eos_id, pad_id = c.token_id("bos_token_id", 0), c.token_id("eos_token_id", 2), c.token_id("pad_token_id")
    if bos_id is None or eos_id is None:
        raise c.error("needs bos_token_id and eos_token_id")
    config = GeneratorConfig(
        vocab_size=int(c.get("vocab_size", 50432)),
        d_model=int(c.get("hidden_size", 6144)),
        n_heads=int(c.get("num_attention_heads", 64)),
        d_ff=int(c.get("intermediate_size", 24576)),
        dropout=0.0,
        activation=c.activation("hidden_act", "gelu"),
        max_len=int(c.get("max_position_embeddings", 2048)),
        pad_id=eos_id if pad_id is None else pad_id,
        unk_id=eos_id,  # byte-level BPE has no unknown token
        bos_id=bos_id,
        eos_id=eos_id,
        norm_eps=float(c.get("layer_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        n_layers=int(c.get("num_hidden_layers", 44)),
        parallel_residual=bool(c.get("use_parallel_residual", True)),
        **c.rope(theta=("rotary_emb_base", 10000.0), fraction=("rotary_pct", 0.25)),
    )
    return config, fast_tokenizer_of(c.folder)


def _swap(outer: int, inner: int) -> Callable[["Tensor"], "Tensor"]:
    """Rows in groups (outer, inner, n) regrouped as (inner, outer, n)."""

    def swap(t: "Tensor") -> "Tensor":
        grouped = t.reshape(outer, inner, -1, *t.shape[1:])  # (outer, inner, n, ...)
        return grouped.transpose(0, 1).reshape(t.shape)  # (inner, outer, n, ...) as t's shape

    return swap


def layers(c: GeneratorConfig) -> list[Weight]:
    regroup = Transform(load=_swap(c.n_heads, 3), save=_swap(3, c.n_heads))  # per head [q_h; k_h; v_h] <-> [q; k; v]
    table = modules("", "gpt_neox.", [("final_norm", "final_layer_norm")])
    for i in range(c.n_layers):
        ours, theirs = f"layers.{i}.", f"gpt_neox.layers.{i}."
        table += [Weight(f"{theirs}attention.query_key_value.{f}", f"{ours}self_attn.qkv_proj.{f}", transform=regroup) for f in BOTH]
        table += modules(ours, theirs, LAYER)
    return table


# Buffers older checkpoints (Pythia) saved: the causal mask and rotary frequencies.
IGNORED = re.compile(r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)")
GPT_NEOX = Adapter(
    architectures=("GPTNeoXForCausalLM",),
    kind="generator",
    read=read,
    table=Table(layers, embed="gpt_neox.embed_in.weight", head="embed_out.weight", ignored=IGNORED),
)
