"""Exact exports of the shipped models to other runtimes, loadable with no code of ours.

    python -m exports.export hf --checkpoint DIR --out DIR
    python -m exports.export ct2 --checkpoint DIR --out DIR [--quantization int8]

hf: the translator as transformers' MarianMTModel, the generator as GPTNeoXForCausalLM, with
their tokenizers (AutoModelForSeq2SeqLM / AutoModelForCausalLM and AutoTokenizer load them).
ct2: CTranslate2 models (ctranslate2.Translator / ctranslate2.Generator) built through its
specification API from our weights; they take sentencepiece pieces of our tokenizer.

What makes the exports exact:
- The weights go through the tables that load Hugging Face folders (loading/hf/), backwards.
- Our sinusoidal table interleaves sin/cos (dims 2i, 2i+1); Marian's puts the sines in the first
  half and the cosines in the second, and recomputes it at load. The export permutes the
  residual stream's dimensions through every weight that reads or writes it (embeddings, the
  inputs of q/k/v and fc1, the outputs of out_proj and fc2, layer norms), so that Marian's hidden
  state is ours permuted (marian_layout); attention heads and the FFN's inner dimensions are untouched.
- Decoding starts from <s> (id 2): decoder_start_token_id 2 (Marian's own models start from pad).
- Tied embeddings and output projection; final_logits_bias zero; post-LN; ReLU; sqrt(d) scaling.
- GPT-NeoX: sequential residual, rotary on every head dimension in the rotate-half layout (ours),
  erf GELU, per-head [q, k, v] rows in query_key_value, tied embeddings, final layer norm.
- CTranslate2's Marian converter starts the decoder from a zero embedding and drops the last
  vocabulary row; building the specification directly avoids both, and takes our position table
  as it is (no permutation needed there).

Tokenizers: the translator's is a MarianTokenizer over our one joint sentencepiece model (as
source.spm and target.spm, with a vocab.json mapping every piece to its own id); the generator's
is a `tokenizers` BPE converted from our sentencepiece model (tokenizer.json). Both give our ids
on the test sets, except that, like every transformers tokenizer, they read "<s>", "</s>",
"<pad>" and "<unk>" written in the text as the special tokens (split_special_tokens=True reads
them as text, as sentencepiece does). MarianTokenizer's "pip install sacremoses" warning can be
ignored: its Moses normalisation is never applied when encoding.
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer
from torch import Tensor
from transformers import GenerationConfig, GPTNeoXConfig, MarianConfig, MarianTokenizer, PreTrainedTokenizerFast

from loading.checkpoint import load_native_checkpoint
from loading.hf.gpt_neox import GPT_NEOX
from loading.hf.marian import MARIAN
from loading.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer
from model.config import GeneratorConfig, TranslatorConfig
from model.generator import Generator
from model.layers import DecoderLayer, EncoderLayer
from model.positions import sinusoidal_table
from model.translator import Translator

SPECIAL_PIECES = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
# Our translator's tensors whose columns (READS) or rows (WRITES) are the residual stream's dimensions.
READS = ("embed.weight", "lm_head.weight", "qkv_proj.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "fc1.weight")
WRITES = ("out_proj.weight", "out_proj.bias", "fc2.weight", "fc2.bias", "norm.weight", "norm.bias")


def marian_permutation(d_model: int) -> Tensor:
    """Index p with marian_hidden = our_hidden[..., p]: our even (sine) dims first, then the odd (cosine) ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# Options the exports write as our shipped models have them (the exporters map nothing else).
EXPORTED_AS_DEFAULT = {
    "translator": ("norm_eps", "tie_embeddings", "suppressed_ids", "decoder_start_id", "scale_embedding", "logits_bias", "sinusoid_layout"),
    "generator": (
        *("norm_eps", "tie_embeddings", "suppressed_ids", "extra_eos_ids", "parallel_residual", "rotary_fraction", "rope_base"),
        *("rope_scaling", "norm", "feed_forward", "n_kv_heads", "head_size", "qkv_bias", "out_bias", "ff_bias"),
    ),
}


def _check_defaults(c: TranslatorConfig | GeneratorConfig, kind: str) -> None:
    default = type(c)()
    changed = [name for name in EXPORTED_AS_DEFAULT[kind] if getattr(c, name) != getattr(default, name)]
    if kind == "translator" and c.activation not in ("relu", "gelu"):
        changed.append("activation")
    if changed:
        raise ValueError(f"the export maps only our shipped models' options; this {kind} sets {', '.join(sorted(set(changed)))}")


def _check_translator(c: TranslatorConfig) -> None:
    if c.norm_first or c.positions != "sinusoidal":
        raise ValueError("MarianMT is post-LN with sinusoidal positions; this translator is not")
    _check_defaults(c, "translator")


def _check_generator(c: GeneratorConfig) -> None:
    if not c.norm_first or c.positions != "rope":
        raise ValueError("GPT-NeoX is pre-LN with rotary positions; this generator is not")
    if c.activation not in ("relu", "gelu"):
        raise ValueError(f"the export maps relu and gelu; this generator uses {c.activation}")
    _check_defaults(c, "generator")


def marian_config(c: TranslatorConfig) -> MarianConfig:
    _check_translator(c)
    both_sides = {"attention_heads": c.n_heads, "ffn_dim": c.d_ff}  # encoder_* and decoder_* alike
    sides: dict[str, Any] = {f"{side}_{name}": value for side in ("encoder", "decoder") for name, value in both_sides.items()}
    dropouts: dict[str, Any] = dict.fromkeys(("dropout", "attention_dropout", "activation_dropout"), c.dropout)
    return MarianConfig(
        architectures=list(MARIAN.architectures),
        **sides,
        vocab_size=c.vocab_size,
        decoder_vocab_size=c.vocab_size,
        d_model=c.d_model,
        encoder_layers=c.n_encoder_layers,
        decoder_layers=c.n_decoder_layers,
        **dropouts,
        activation_function=c.activation,
        max_position_embeddings=c.max_len,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=c.pad_id,
        bos_token_id=c.bos_id,
        eos_token_id=c.eos_id,
        decoder_start_token_id=c.bos_id,
        forced_eos_token_id=None,
    )


def marian_layout(model: Translator) -> tuple[TranslatorConfig, dict[str, Tensor]]:
    """Our translator as Marian lays it out: the same function with the residual stream permuted
    (marian_permutation, see the module doc), the sinusoids in halves and a zero logits bias; its
    config and state dict."""
    p = marian_permutation(model.config.d_model)
    state = {name: t[:, p] if name.endswith(READS) else t[p] if name.endswith(WRITES) else t for name, t in model.state_dict().items()}
    state["logits_bias"] = torch.zeros(model.config.vocab_size)
    return replace(model.config, sinusoid_layout="halves", logits_bias=True), state


def gpt_neox_config(c: GeneratorConfig) -> GPTNeoXConfig:
    _check_generator(c)
    return GPTNeoXConfig(
        architectures=list(GPT_NEOX.architectures),
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        use_parallel_residual=False,
        num_attention_heads=c.n_heads,
        intermediate_size=c.d_ff,
        hidden_act=c.activation,  # "gelu" is the erf form, as torch's F.gelu
        layer_norm_eps=1e-5,
        hidden_dropout=c.dropout,
        attention_dropout=c.dropout,
        max_position_embeddings=c.max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        attention_bias=True,
        tie_word_embeddings=True,
        pad_token_id=c.pad_id,
        bos_token_id=c.bos_id,
        eos_token_id=c.eos_id,
    )


def _generation_config(c: TranslatorConfig | GeneratorConfig, encoder_decoder: bool) -> GenerationConfig:
    """Greedy by default, up to the context, stopping at </s>; nothing forced or banned."""
    extra = {"decoder_start_token_id": c.bos_id} if encoder_decoder else {}
    return GenerationConfig(max_length=c.max_len, bos_token_id=c.bos_id, eos_token_id=c.eos_id, pad_token_id=c.pad_id, **extra)


def save_marian_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> None:
    """MarianTokenizer over our one joint sentencepiece model (as source and target) and a vocab
    mapping each piece to its own id, so it gives our ids (and appends </s>, as our translator expects)."""
    for name in ["source.spm", "target.spm"]:
        tokenizer.save(out / name)
    vocab = {tokenizer.sp.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1) + "\n")
    marian = MarianTokenizer(
        str(out / "source.spm"),
        str(out / "target.spm"),
        str(out / "vocab.json"),
        source_lang="en",
        target_lang="de",
        unk_token=SPECIAL_PIECES["unk_token"],
        eos_token=SPECIAL_PIECES["eos_token"],
        pad_token=SPECIAL_PIECES["pad_token"],
        model_max_length=max_len,
    )
    marian.save_pretrained(str(out))


def fast_tokenizer(tokenizer: Tokenizer) -> FastTokenizer:
    """A `tokenizers` BPE equal to a sentencepiece BPE trained with keep_layout (identity
    normalisation, no dummy prefix, whitespace kept, user-defined symbols, byte fallback).
    Merges are ranked by the merged piece's score, as sentencepiece applies them."""
    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf classes
    proto.ParseFromString(tokenizer.model_proto)
    ns, ts = proto.normalizer_spec, proto.trainer_spec
    if ns.name != "identity" or ns.add_dummy_prefix or ns.remove_extra_whitespaces or ts.model_type != ts.BPE or not ts.split_by_whitespace:
        raise ValueError("only a keep_layout BPE sentencepiece model converts exactly to a fast tokenizer")
    pieces = [p.piece for p in proto.pieces]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    normal = sorted((i for i, p in enumerate(proto.pieces) if p.type == p.NORMAL), key=lambda i: -proto.pieces[i].score)
    merges = [
        (pieces[i][:k], pieces[i][k:])
        for i in normal
        for k in range(1, len(pieces[i]))
        if pieces[i][:k] in vocab and pieces[i][k:] in vocab
    ]
    fast = FastTokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=ts.byte_fallback))
    fast.normalizer = normalizers.Replace(" ", "\u2581")
    fast.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")  # a word starts at its space
    fast.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    fast.add_tokens([AddedToken(s, special=False, normalized=False) for s in ts.user_defined_symbols])
    fast.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in SPECIAL_PIECES.values()])
    return fast


def save_fast_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> None:
    wrapped = PreTrainedTokenizerFast(tokenizer_object=fast_tokenizer(tokenizer), model_max_length=max_len, **SPECIAL_PIECES)
    wrapped.save_pretrained(str(out))


def export_hf(checkpoint: Path, out: Path) -> None:
    """Writes a transformers folder (config, safetensors weights, generation config, tokenizer)."""
    model, tokenizer = load_native_checkpoint(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    hf_config: MarianConfig | GPTNeoXConfig
    if isinstance(model, Translator):
        hf_config = marian_config(model.config)
        tensors = MARIAN.table.export(*marian_layout(model))
        save_marian_tokenizer(tokenizer, out, model.config.max_len)
    else:
        hf_config = gpt_neox_config(model.config)
        tensors = GPT_NEOX.table.export(model.config, model.state_dict())
        save_fast_tokenizer(tokenizer, out, model.config.max_len)
    # Clones: the parts of a stack (q, k and v of qkv_proj) share its memory, which safetensors refuses.
    save_file({name: t.clone() for name, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out))
    _generation_config(model.config, isinstance(model, Translator)).save_pretrained(str(out))


def _linear(spec: Any, weight: Tensor, bias: Tensor | None = None) -> None:
    spec.weight = weight.detach().float().numpy()
    if bias is not None:
        spec.bias = bias.detach().float().numpy()


def _layer_norm(spec: Any, layer_norm: torch.nn.Module) -> None:
    assert isinstance(layer_norm, torch.nn.LayerNorm)
    spec.gamma, spec.beta = layer_norm.weight.detach().numpy(), layer_norm.bias.detach().numpy()


def _self_attention(layer_spec: Any, layer: EncoderLayer | DecoderLayer) -> None:
    """A CTranslate2 layer spec's self-attention (fused qkv) and its layer norm, from our layer."""
    _linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias)
    _linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias)
    _layer_norm(layer_spec.self_attention.layer_norm, layer.attn_residual.norm)


def _feed_forward(layer_spec: Any, layer: EncoderLayer | DecoderLayer) -> None:
    _linear(layer_spec.ffn.linear_0, layer.feed_forward.fc1.weight, layer.feed_forward.fc1.bias)
    _linear(layer_spec.ffn.linear_1, layer.feed_forward.fc2.weight, layer.feed_forward.fc2.bias)
    _layer_norm(layer_spec.ffn.layer_norm, layer.ff_residual.norm)


def _self_attention_and_feed_forward(layer_spec: Any, layer: EncoderLayer | DecoderLayer) -> None:
    _self_attention(layer_spec, layer)
    _feed_forward(layer_spec, layer)


def _fused(*linears: torch.nn.Linear) -> tuple[Tensor, Tensor]:
    return torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears])


def _ct2_activation(c: TranslatorConfig | GeneratorConfig) -> Any:
    import ctranslate2  # imported here: export_hf runs where ctranslate2 is not installed (benchmarks/gpu.py)

    return ctranslate2.specs.Activation.RELU if c.activation == "relu" else ctranslate2.specs.Activation.GELU  # GELU: the erf form


def ct2_translator_spec(model: Translator, tokenizer: Tokenizer) -> Any:
    """A ctranslate2 TransformerSpec with our weights; sources are pieces, </s> added by ctranslate2."""
    import ctranslate2  # imported here: export_hf runs where ctranslate2 is not installed (benchmarks/gpu.py)

    c = model.config
    _check_translator(c)
    spec = ctranslate2.specs.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers), c.n_heads, pre_norm=False, activation=_ct2_activation(c)
    )
    table = sinusoidal_table(c.max_len, c.d_model).numpy()  # (L, d), our interleaved layout
    embed = model.embed.weight.detach().numpy()
    for stack in [spec.encoder, spec.decoder]:
        stack.scale_embeddings = True  # by sqrt(d_model)
        stack.position_encodings.encodings = table
    spec.encoder.embeddings[0].weight = embed
    spec.decoder.embeddings.weight = embed
    _linear(spec.decoder.projection, model.embed.weight)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder_layers, strict=True):
        assert isinstance(layer, EncoderLayer)
        _self_attention_and_feed_forward(layer_spec, layer)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder_layers, strict=True):
        assert isinstance(layer, DecoderLayer) and layer.src_attn is not None and layer.src_residual is not None
        _self_attention(layer_spec, layer)
        _linear(layer_spec.attention.linear[0], layer.src_attn.q_proj.weight, layer.src_attn.q_proj.bias)
        _linear(layer_spec.attention.linear[1], *_fused(layer.src_attn.k_proj, layer.src_attn.v_proj))
        _linear(layer_spec.attention.linear[2], layer.src_attn.out_proj.weight, layer.src_attn.out_proj.bias)
        _layer_norm(layer_spec.attention.layer_norm, layer.src_residual.norm)
        _feed_forward(layer_spec, layer)
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.layer_norm_epsilon = 1e-5
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_eos = True
    return spec


def ct2_generator_spec(model: Generator, tokenizer: Tokenizer) -> Any:
    """A ctranslate2 TransformerDecoderModelSpec with our weights; prompts are pieces (no <s>)."""
    import ctranslate2  # imported here: export_hf runs where ctranslate2 is not installed (benchmarks/gpu.py)

    c = model.config
    _check_generator(c)
    spec = ctranslate2.specs.TransformerDecoderModelSpec.from_config(
        c.n_layers, c.n_heads, pre_norm=True, activation=_ct2_activation(c), rotary_dim=0, rotary_interleave=False, rotary_base=10000.0
    )
    decoder = spec.decoder
    decoder.scale_embeddings = False
    decoder.embeddings.weight = model.embed.weight.detach().numpy()
    _linear(decoder.projection, model.embed.weight)
    _layer_norm(decoder.layer_norm, model.final_norm)
    for layer_spec, layer in zip(decoder.layer, model.layers, strict=True):
        assert isinstance(layer, DecoderLayer)
        _self_attention_and_feed_forward(layer_spec, layer)
    spec.register_vocabulary([tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)])
    spec.config.layer_norm_epsilon = 1e-5
    for key, piece_id in [("bos_token", BOS_ID), ("eos_token", EOS_ID), ("unk_token", UNK_ID)]:
        setattr(spec.config, key, tokenizer.sp.id_to_piece(piece_id))
    return spec


def export_ct2(checkpoint: Path, out: Path, quantization: str | None = None) -> None:
    """Writes a CTranslate2 model folder (model.bin, config.json, vocabularies); quantization as
    ctranslate2's converters take it (e.g. int8), float32 weights when None."""
    model, tokenizer = load_native_checkpoint(checkpoint)
    with torch.no_grad():
        spec = ct2_translator_spec(model, tokenizer) if isinstance(model, Translator) else ct2_generator_spec(model, tokenizer)
    spec.validate()
    spec.optimize(quantization=quantization)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=["hf", "ct2"])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint folder (model/checkpoints/...)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quantization", default=None, help="ct2 only: int8, int8_float32, float16, ... (default: float32)")
    args = parser.parse_args()
    if args.format == "hf":
        if args.quantization is not None:
            parser.error("--quantization is for ct2 only")
        export_hf(args.checkpoint, args.out)
    else:
        export_ct2(args.checkpoint, args.out, args.quantization)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
