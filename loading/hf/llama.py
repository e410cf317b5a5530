"""The Llama family (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) as our Generator.

RMSNorm, SwiGLU, grouped-query attention, q/k/v stacked into qkv_proj as they are (the checkpoints
already hold the rotate-half layout), biases as attention_bias / mlp_bias say (Qwen2: on q/k/v
only), RoPE scaling default, linear or llama3; the eos ids of generation_config.json.
Sliding-window attention (Mistral's, Qwen2's use_sliding_window) is refused unless it spans
max_position_embeddings. The tokenizer is the folder's tokenizer.json.
"""

import re

from loading.hf.adapter import BOTH, Adapter, HFConfig, Table, Weight, modules, qkv
from loading.hf_tokenizers import FastTextTokenizer, fast_tokenizer_of
from model.config import GeneratorConfig

NORMS = [("attn_residual.norm", "input_layernorm"), ("ff_residual.norm", "post_attention_layernorm")]
FEED_FORWARD = [("feed_forward.fc1", "mlp.gate_proj"), ("feed_forward.up", "mlp.up_proj"), ("feed_forward.fc2", "mlp.down_proj")]


def _eos_ids(c: HFConfig) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list), else config.json's."""
    value = c.generation().get("eos_token_id", c.get("eos_token_id"))
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(v) for v in values)


def read(c: HFConfig) -> tuple[GeneratorConfig, FastTextTokenizer]:
    """Absent keys take LlamaConfig's defaults."""
    max_len = int(c.get("max_position_embeddings", 2048))
    window = c.get("sliding_window") if c.architecture == "MistralForCausalLM" or c.get("use_sliding_window") else None
    if "sliding_attention" in (c.get("layer_types") or []) or (window is not None and int(window) < max_len):
        raise c.error(f"sliding-window attention (sliding_window {window}) is not supported")
    if int(c.get("pretraining_tp", 1) or 1) != 1:
        raise c.error(f"pretraining_tp {c.values['pretraining_tp']} is not supported")
    eos_ids = _eos_ids(c)
    if not eos_ids:
        raise c.error("needs eos_token_id (here or in generation_config.json)")
    bos_id, pad_id, unk_id = c.token_id("bos_token_id"), c.token_id("pad_token_id"), c.token_id("unk_token_id")
    n_heads = int(c.get("num_attention_heads", 32))
    qwen2 = c.architecture == "Qwen2ForCausalLM"
    attention_bias = bool(c.get("attention_bias", False))
    config = GeneratorConfig(
        vocab_size=int(c.get("vocab_size", 32000)),
        d_model=int(c.get("hidden_size", 4096)),
        n_heads=n_heads,
        d_ff=int(c.get("intermediate_size", 11008)),
        dropout=0.0,
        activation=c.activation("hidden_act", "silu"),
        max_len=max_len,
        pad_id=eos_ids[0] if pad_id is None else pad_id,
        unk_id=eos_ids[0] if unk_id is None else unk_id,
        bos_id=eos_ids[0] if bos_id is None else bos_id,  # Qwen2 has no bos
        eos_id=eos_ids[0],
        extra_eos_ids=tuple(i for i in eos_ids[1:] if i != eos_ids[0]),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        n_layers=int(c.get("num_hidden_layers", 32)),
        **c.rope(theta=("rope_theta", 10000.0), fraction=("partial_rotary_factor", 1.0)),
        norm="rmsnorm",
        feed_forward="gated",
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_size=None if c.get("head_dim") is None else int(c.values["head_dim"]),
        qkv_bias=qwen2 or attention_bias,
        out_bias=not qwen2 and attention_bias,
        ff_bias=bool(c.get("mlp_bias", False)),
    )
    return config, fast_tokenizer_of(c.folder)


def _fields(bias: bool) -> tuple[str, ...]:
    return BOTH if bias else ("weight",)


def layers(c: GeneratorConfig) -> list[Weight]:
    q, kv = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    table = modules("", "model.", [("final_norm", "norm")], _fields(False))
    for i in range(c.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        table += [w for f in _fields(c.qkv_bias) for w in qkv(ours, theirs, f, [q, kv, kv])]
        table += modules(ours, theirs, [("self_attn.out_proj", "self_attn.o_proj")], _fields(c.out_bias))
        table += modules(ours, theirs, NORMS, _fields(False))
        table += modules(ours, theirs, FEED_FORWARD, _fields(c.ff_bias))
    return table


IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # rotary frequencies some checkpoints saved
LLAMA = Adapter(
    architectures=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"),
    kind="generator",
    read=read,
    table=Table(layers, embed="model.embed_tokens.weight", head="lm_head.weight", ignored=IGNORED),
)
