"""Hugging Face folders read exactly into our modules: MarianMTModel (opus-mt as Helsinki-NLP ships
it) into a Translator, GPTNeoXForCausalLM (Pythia) and the Llama family (LlamaForCausalLM,
Qwen2ForCausalLM, MistralForCausalLM) into a Generator; no transformers model runs.
For Marian and GPT-NeoX, the inverse of model/export.py's mapping.

config.json is read as JSON (transformers stays out of the serving path), absent keys taking the
defaults of transformers 5.23's MarianConfig and GPTNeoXConfig. Weights come from
model.safetensors, from the shards a model.safetensors.index.json lists, or from
pytorch_model.bin through torch.load(weights_only=True), which unpickles tensors and nothing else.

- Marian: the sinusoids are laid out in halves (sinusoid_layout "halves"), so the weights need no
  permutation; q/k/v of each self-attention are stacked [q; k; v] (qkv_proj); the logits bias is
  final_logits_bias; decoding starts from decoder_start_token_id (pad, for opus-mt) and pad is
  never generated (opus-mt's bad_words_ids).
- GPT-NeoX: query_key_value holds each head's [q_h; k_h; v_h] rows, regrouped into [q; k; v];
  parallel residual, partial rotary and an untied embed_out as the config says.
- Llama: RMSNorm, SwiGLU, grouped-query attention, q/k/v stacked into qkv_proj as they are (the
  checkpoints already hold the rotate-half layout), biases as attention_bias / mlp_bias say (Qwen2:
  on q/k/v only), RoPE scaling default, linear or llama3; the eos ids of generation_config.json.
  Sliding-window attention (Mistral's, Qwen2's use_sliding_window) is refused unless it spans
  max_position_embeddings.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from model.config import Activation, GeneratorConfig, TranslatorConfig
from model.folder import CheckpointError, FolderInfo, inspect_folder, read_json
from model.generator import Generator
from model.hf_tokenizers import MarianTextTokenizer, fast_tokenizer_of
from model.quantize import WeightType, place
from model.tokenizer import TextTokenizer
from model.translator import Translator

ACTIVATIONS: dict[str, Activation] = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "swish": "silu",
    "silu": "silu",
}
# Marian options of other fairseq-style models that our Translator does not have: refused when set.
MARIAN_REFUSED = ("normalize_before", "normalize_embedding", "layernorm_embedding", "add_final_layer_norm", "add_bias_logits")
# Our layer's modules <- a Marian layer's (each with .weight and .bias).
MARIAN_LAYER = [
    ("self_attn.out_proj", "self_attn.out_proj"),
    ("attn_residual.norm", "self_attn_layer_norm"),
    ("feed_forward.fc1", "fc1"),
    ("feed_forward.fc2", "fc2"),
    ("ff_residual.norm", "final_layer_norm"),
]
MARIAN_CROSS = [
    *[(f"src_attn.{p}_proj", f"encoder_attn.{p}_proj") for p in ("q", "k", "v", "out")],
    ("src_residual.norm", "encoder_attn_layer_norm"),
]
# Copies of the shared embedding and position tables Marian recomputes: read, never needed.
MARIAN_IGNORED = re.compile(r"model\.(encoder|decoder)\.(embed_positions|embed_tokens)\.weight")
GPT_NEOX_LAYER = [
    ("self_attn.qkv_proj", "attention.query_key_value"),
    ("self_attn.out_proj", "attention.dense"),
    ("attn_residual.norm", "input_layernorm"),
    ("ff_residual.norm", "post_attention_layernorm"),
    ("feed_forward.fc1", "mlp.dense_h_to_4h"),
    ("feed_forward.fc2", "mlp.dense_4h_to_h"),
]
LLAMA_LAYER = [
    ("self_attn.out_proj", "self_attn.o_proj"),
    ("attn_residual.norm", "input_layernorm"),
    ("ff_residual.norm", "post_attention_layernorm"),
    ("feed_forward.fc1", "mlp.gate_proj"),
    ("feed_forward.up", "mlp.up_proj"),
    ("feed_forward.fc2", "mlp.down_proj"),
]
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ROPE_SCALINGS = ("default", "linear", "llama3")
# Rotary frequencies some Llama checkpoints saved.
LLAMA_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Buffers older GPT-NeoX checkpoints (Pythia) saved: the causal mask and rotary frequencies.
GPT_NEOX_IGNORED = re.compile(r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)")
FIRST_FEW = 5


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _first_few(names: list[str]) -> str:
    more = f" and {len(names) - FIRST_FEW} more" if len(names) > FIRST_FEW else ""
    return ", ".join(names[:FIRST_FEW]) + more


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(path, f"unreadable safetensors ({_one_line(error)})") from None


def _read_pickle(path: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an UnpicklingError for pickled objects; a broken archive raises others
        raise CheckpointError(path, f"refused: not loadable with weights_only=True ({type(error).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(path, "not a state dict of tensors")
    return state


def read_weights(folder: Path) -> tuple[dict[str, Tensor], Path]:
    """The folder's tensors by name, and the file that names them (for messages)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single), single
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, 'has no "weight_map"')
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(map(str, weight_map.values()))):
            tensors.update(_read_safetensors(folder / shard))
        return tensors, index
    if (folder / "pytorch_model.bin").is_file():
        return _read_pickle(folder / "pytorch_model.bin"), folder / "pytorch_model.bin"
    raise CheckpointError(folder, "no weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin")


def _activation(config: dict[str, Any], key: str, default: str, path: Path) -> Activation:
    name = str(config.get(key, default))
    if name not in ACTIVATIONS:
        raise CheckpointError(path, f"{key} {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _token_id(config: dict[str, Any], key: str, default: int | None) -> int | None:
    """A special id from the config; a list (several eos ids) gives its first."""
    value = config.get(key, default)
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def _suppressed_ids(folder: Path, pad_id: int) -> tuple[int, ...]:
    """pad, and the single-token bad_words_ids of generation_config.json."""
    path = folder / "generation_config.json"
    bad_words = read_json(path).get("bad_words_ids") or [] if path.is_file() else []
    return tuple(sorted({pad_id} | {int(w[0]) for w in bad_words if isinstance(w, list) and len(w) == 1}))


def marian_config(folder: Path, config: dict[str, Any], tokenizer: MarianTextTokenizer, info: FolderInfo) -> TranslatorConfig:
    path = folder / "config.json"
    for option in MARIAN_REFUSED:
        if config.get(option):
            raise CheckpointError(path, f"{option} {config[option]!r} is not supported")
    vocab_size = int(config.get("vocab_size", 58101))
    if not config.get("share_encoder_decoder_embeddings", True) or config.get("decoder_vocab_size") not in (None, vocab_size):
        raise CheckpointError(path, "share_encoder_decoder_embeddings False (a separate decoder vocabulary) is not supported")
    for part in ("attention_heads", "ffn_dim"):
        if config.get(f"encoder_{part}", 16) != config.get(f"decoder_{part}", 16):
            raise CheckpointError(path, f"encoder_{part} != decoder_{part} is not supported")
    pad_id = _token_id(config, "pad_token_id", 58100)
    eos_id = _token_id(config, "eos_token_id", 0)
    start_id = _token_id(config, "decoder_start_token_id", 58100)
    bos_id = _token_id(config, "bos_token_id", None)
    if pad_id is None or eos_id is None or start_id is None:
        raise CheckpointError(path, "needs pad_token_id, eos_token_id and decoder_start_token_id")
    return TranslatorConfig(
        vocab_size=vocab_size,
        d_model=int(config.get("d_model", 1024)),
        n_heads=int(config.get("encoder_attention_heads", 16)),
        d_ff=int(config.get("encoder_ffn_dim", 4096)),
        dropout=0.0,
        activation=_activation(config, "activation_function", "gelu", path),
        norm_first=False,
        positions="sinusoidal",
        max_len=int(config.get("max_position_embeddings", 1024)),
        pad_id=pad_id,
        unk_id=tokenizer.unk_id,
        bos_id=start_id if bos_id is None else bos_id,
        eos_id=eos_id,
        suppressed_ids=_suppressed_ids(folder, pad_id),
        norm_eps=1e-5,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        n_encoder_layers=int(config.get("encoder_layers", 12)),
        n_decoder_layers=int(config.get("decoder_layers", 12)),
        decoder_start_id=start_id,
        scale_embedding=bool(config.get("scale_embedding", False)),
        logits_bias=True,
        sinusoid_layout="halves",
        source_lang=info.source_lang or TranslatorConfig.source_lang,
        target_lang=info.target_lang or TranslatorConfig.target_lang,
    )


def marian_names(c: TranslatorConfig) -> dict[str, list[str]]:
    """Our state dict's names <- the Marian names each is read from (several: stacked in order)."""
    names = {"embed.weight": ["model.shared.weight"], "logits_bias": ["final_logits_bias"]}
    if not c.tie_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for side, n_layers in [("encoder", c.n_encoder_layers), ("decoder", c.n_decoder_layers)]:
        for i in range(n_layers):
            ours, theirs = f"{side}_layers.{i}", f"model.{side}.layers.{i}"
            for field in ("weight", "bias"):
                names[f"{ours}.self_attn.qkv_proj.{field}"] = [f"{theirs}.self_attn.{p}_proj.{field}" for p in "qkv"]
                for our_module, their_module in MARIAN_LAYER + (MARIAN_CROSS if side == "decoder" else []):
                    names[f"{ours}.{our_module}.{field}"] = [f"{theirs}.{their_module}.{field}"]
    return names


def gpt_neox_config(folder: Path, config: dict[str, Any]) -> GeneratorConfig:
    path = folder / "config.json"
    if not config.get("attention_bias", True):
        raise CheckpointError(path, "attention_bias False is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(path, f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
    bos_id, eos_id, pad_id = (
        _token_id(config, key, default) for key, default in [("bos_token_id", 0), ("eos_token_id", 2), ("pad_token_id", None)]
    )
    if bos_id is None or eos_id is None:
        raise CheckpointError(path, "needs bos_token_id and eos_token_id")
    return GeneratorConfig(
        vocab_size=int(config.get("vocab_size", 50432)),
        d_model=int(config.get("hidden_size", 6144)),
        n_heads=int(config.get("num_attention_heads", 64)),
        d_ff=int(config.get("intermediate_size", 24576)),
        dropout=0.0,
        activation=_activation(config, "hidden_act", "gelu", path),
        max_len=int(config.get("max_position_embeddings", 2048)),
        pad_id=eos_id if pad_id is None else pad_id,
        unk_id=eos_id,  # byte-level BPE has no unknown token
        bos_id=bos_id,
        eos_id=eos_id,
        norm_eps=float(config.get("layer_norm_eps", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        n_layers=int(config.get("num_hidden_layers", 44)),
        parallel_residual=bool(config.get("use_parallel_residual", True)),
        rotary_fraction=float(rope.get("partial_rotary_factor", config.get("rotary_pct", 0.25))),
        rope_base=float(rope.get("rope_theta", config.get("rotary_emb_base", 10000.0))),
    )


def _eos_ids(folder: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list), else config.json's."""
    path = folder / "generation_config.json"
    generation = read_json(path) if path.is_file() else {}
    value = generation.get("eos_token_id", config.get("eos_token_id"))
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(v) for v in values)


def _rope_scaling(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """GeneratorConfig's RoPE fields from rope_parameters (transformers 5) or rope_scaling and rope_theta."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    if kind not in ROPE_SCALINGS:
        raise CheckpointError(path, f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
    fields: dict[str, Any] = {
        "rope_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rotary_fraction": float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
        "rope_scaling": kind,
    }
    if kind != "default":
        fields["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        fields["rope_low_freq_factor"] = float(rope["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        fields["rope_original_max_len"] = int(rope.get("original_max_position_embeddings", config.get("max_position_embeddings", 2048)))
    return fields


def llama_config(folder: Path, config: dict[str, Any], architecture: str) -> GeneratorConfig:
    path = folder / "config.json"
    max_len = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window") if architecture == "MistralForCausalLM" or config.get("use_sliding_window") else None
    if "sliding_attention" in (config.get("layer_types") or []) or (window is not None and int(window) < max_len):
        raise CheckpointError(path, f"sliding-window attention (sliding_window {window}) is not supported")
    if int(config.get("pretraining_tp", 1) or 1) != 1:
        raise CheckpointError(path, f"pretraining_tp {config['pretraining_tp']} is not supported")
    eos_ids = _eos_ids(folder, config)
    if not eos_ids:
        raise CheckpointError(path, "needs eos_token_id (here or in generation_config.json)")
    bos_id, pad_id = _token_id(config, "bos_token_id", None), _token_id(config, "pad_token_id", None)
    n_heads = int(config.get("num_attention_heads", 32))
    qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(config.get("attention_bias", False))
    return GeneratorConfig(
        vocab_size=int(config.get("vocab_size", 32000)),
        d_model=int(config.get("hidden_size", 4096)),
        n_heads=n_heads,
        d_ff=int(config.get("intermediate_size", 11008)),
        dropout=0.0,
        activation=_activation(config, "hidden_act", "silu", path),
        max_len=max_len,
        pad_id=eos_ids[0] if pad_id is None else pad_id,
        unk_id=eos_ids[0] if config.get("unk_token_id") is None else int(config["unk_token_id"]),
        bos_id=eos_ids[0] if bos_id is None else bos_id,  # Qwen2 has no bos
        eos_id=eos_ids[0],
        extra_eos_ids=tuple(i for i in eos_ids[1:] if i != eos_ids[0]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        n_layers=int(config.get("num_hidden_layers", 32)),
        **_rope_scaling(config, path),
        norm="rmsnorm",
        feed_forward="gated",
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_size=None if config.get("head_dim") is None else int(config["head_dim"]),
        qkv_bias=qwen2 or attention_bias,
        out_bias=not qwen2 and attention_bias,
        ff_bias=bool(config.get("mlp_bias", False)),
    )


def llama_names(c: GeneratorConfig) -> dict[str, list[str]]:
    names = {"embed.weight": ["model.embed_tokens.weight"], "final_norm.weight": ["model.norm.weight"]}
    if not c.tie_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(c.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        names[f"{ours}.self_attn.qkv_proj.weight"] = [f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"]
        if c.qkv_bias:
            names[f"{ours}.self_attn.qkv_proj.bias"] = [f"{theirs}.self_attn.{p}_proj.bias" for p in "qkv"]
        for our_module, their_module in LLAMA_LAYER:
            names[f"{ours}.{our_module}.weight"] = [f"{theirs}.{their_module}.weight"]
            biased = (c.out_bias and "o_proj" in their_module) or (c.ff_bias and "mlp" in their_module)
            if biased:
                names[f"{ours}.{our_module}.bias"] = [f"{theirs}.{their_module}.bias"]
    return names


def gpt_neox_names(c: GeneratorConfig) -> dict[str, list[str]]:
    names = {
        "embed.weight": ["gpt_neox.embed_in.weight"],
        "final_norm.weight": ["gpt_neox.final_layer_norm.weight"],
        "final_norm.bias": ["gpt_neox.final_layer_norm.bias"],
    }
    if not c.tie_embeddings:
        names["lm_head.weight"] = ["embed_out.weight"]
    for i in range(c.n_layers):
        for our_module, their_module in GPT_NEOX_LAYER:
            for field in ("weight", "bias"):
                names[f"layers.{i}.{our_module}.{field}"] = [f"gpt_neox.layers.{i}.{their_module}.{field}"]
    return names


def gpt_neox_regroup(c: GeneratorConfig) -> Callable[[str, Tensor], Tensor]:
    """query_key_value's per-head rows [q_h; k_h; v_h] regrouped as [q; k; v] (qkv_proj)."""

    def regroup(name: str, tensor: Tensor) -> Tensor:
        if not name.endswith("qkv_proj.weight") and not name.endswith("qkv_proj.bias"):
            return tensor
        per_head = tensor.reshape(c.n_heads, 3, c.head_dim, -1)  # (H, 3, D, d) or (H, 3, D, 1)
        return per_head.transpose(0, 1).reshape(tensor.shape)  # (3, H, D, ...) as (3d, ...)

    return regroup


def state_dict(
    model: Translator | Generator,
    names: dict[str, list[str]],
    tensors: dict[str, Tensor],
    source: Path,
    ignored: Callable[[str], bool],
    transform: Callable[[str, Tensor], Tensor] = lambda _, t: t,
) -> dict[str, Tensor]:
    """model's state dict (float32) from the folder's tensors, or CheckpointError naming the first
    few missing, unexpected or misshapen weights."""
    needed = [name for theirs in names.values() for name in theirs]
    missing = [name for name in needed if name not in tensors]
    if missing:
        raise CheckpointError(source, f"missing weights: {_first_few(missing)}")
    unexpected = sorted(set(tensors) - set(needed) - {name for name in tensors if ignored(name)})
    if unexpected:
        raise CheckpointError(source, f"unexpected weights: {_first_few(unexpected)}")
    expected = model.state_dict()
    state = {}
    for ours, theirs in names.items():
        parts = [tensors[name].float() for name in theirs]
        if sum(p.numel() for p in parts) != expected[ours].numel():
            shapes = ", ".join(f"{name} {tuple(tensors[name].shape)}" for name in theirs)
            raise CheckpointError(source, f"{shapes}: expected {expected[ours].numel()} values in all")
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        state[ours] = transform(ours, joined.reshape(expected[ours].shape))
    return state


def read_hf_folder(folder: Path) -> tuple[Translator | Generator, TextTokenizer]:
    """The folder's model (float32, CPU, eval mode) and tokenizer; CheckpointError when it cannot be served."""
    info = inspect_folder(folder)
    config = read_json(folder / "config.json")
    if not info.hugging_face:
        raise CheckpointError(folder / "config.json", "not a Hugging Face folder")
    tokenizer: TextTokenizer
    model: Translator | Generator
    if info.architecture == "MarianMTModel":
        marian_tokenizer = MarianTextTokenizer(folder)
        translator_config = marian_config(folder, config, marian_tokenizer, info)
        model, tokenizer = Translator(translator_config), marian_tokenizer
        tensors, source = read_weights(folder)
        for alias in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            if "model.shared.weight" not in tensors and alias in tensors:
                tensors["model.shared.weight"] = tensors[alias]
        tied = translator_config.tie_embeddings

        def marian_ignored(name: str) -> bool:
            return MARIAN_IGNORED.fullmatch(name) is not None or (tied and name == "lm_head.weight")

        state = state_dict(model, marian_names(translator_config), tensors, source, marian_ignored)
    elif info.architecture in LLAMA_ARCHITECTURES:
        generator_config = llama_config(folder, config, info.architecture)
        model, tokenizer = Generator(generator_config), fast_tokenizer_of(folder)
        tensors, source = read_weights(folder)
        tied = generator_config.tie_embeddings

        def llama_ignored(name: str) -> bool:
            return LLAMA_IGNORED.fullmatch(name) is not None or (tied and name == "lm_head.weight")

        state = state_dict(model, llama_names(generator_config), tensors, source, llama_ignored)
    else:
        generator_config = gpt_neox_config(folder, config)
        model, tokenizer = Generator(generator_config), fast_tokenizer_of(folder)
        tensors, source = read_weights(folder)
        tied = generator_config.tie_embeddings

        def gpt_neox_ignored(name: str) -> bool:
            return GPT_NEOX_IGNORED.fullmatch(name) is not None or (tied and name == "embed_out.weight")

        names = gpt_neox_names(generator_config)
        state = state_dict(model, names, tensors, source, gpt_neox_ignored, gpt_neox_regroup(generator_config))
    model.load_state_dict(state)
    return model.eval(), tokenizer


def load_hf_folder(
    folder: Path, device: str | torch.device = "cpu", dtype: WeightType = torch.float32
) -> tuple[Translator | Generator, TextTokenizer]:
    """The folder's model in eval mode on device, in dtype (or with int8 weights, on the CPU), and its tokenizer."""
    model, tokenizer = read_hf_folder(folder)
    place(model, device, dtype)
    return model, tokenizer
