"""A Hugging Face Llama-family folder (Llama, Mistral, Qwen2) written as a GGUF file, as llama.cpp's
convert_hf_to_gguf.py writes one, its weights quantized by the gguf package's own quantizers:

    python -m exports.gguf --folder DIR --out FILE.gguf [--type Q8_0|Q4_0|Q4_1|F16|F32]

What llama.cpp, transformers (`gguf_file=`) and this service (loading/gguf.py) read from it: the
hyperparameters under the architecture's keys, the byte-level BPE vocabulary (tokens padded to
the model's rows with [PAD<i>], merges, special tokens as control tokens, the pre-tokenizer),
bos/eos/pad ids, the chat template; the q and k rows of a llama file interleaved as llama.cpp's
converter interleaves them; Llama 3.1's RoPE scaling as a rope_freqs tensor (each frequency's
divisor), as that converter writes it. Norms stay F32; every matrix whose rows are a multiple of 32 wide
(the embedding included) is written in --type. It builds the files the tests and benchmarks serve.
"""

import argparse
import json
from pathlib import Path
from typing import cast

import gguf
import numpy as np
import torch

from loading.folder import CheckpointError, read_json
from loading.gguf import PRE_TOKENIZERS
from loading.hf.load import load_hf_folder
from loading.hf_tokenizers import FastTextTokenizer
from model.block_quant import BLOCK
from model.generator import Generator
from model.layers import DecoderLayer
from model.positions import rope_inv_freq

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
TYPES = {name: gguf.GGMLQuantizationType[name] for name in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")}


def _interleave(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's permute: each head's rotate-half rows (t D/2 + i) to interleaved (2 i + t)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _vocabulary(folder: Path, tokenizer: FastTextTokenizer, rows: int) -> tuple[list[str], list[int], list[str], str]:
    """Tokens by id (padded to rows), their llama.cpp token types, merges, and the pre-tokenizer name."""
    spec = read_json(folder / "tokenizer.json")
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        name = "gpt-2"
    else:
        splits = [p.get("pattern", {}).get("Regex") for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        name = next((n for n, regexes in PRE_TOKENIZERS.items() if regexes == splits), "")
    if not name:
        raise CheckpointError(folder / "tokenizer.json", f"a pre-tokenizer none of {', '.join(PRE_TOKENIZERS)}")
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    by_id = {i: token for token, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(rows)]
    special = tokenizer.special_ids
    types = [3 if i in special else 1 if i in by_id else 5 for i in range(rows)]  # control, normal, unused
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, name


def _tensor(writer: gguf.GGUFWriter, name: str, weight: torch.Tensor, kind: gguf.GGMLQuantizationType) -> None:
    array = weight.detach().float().numpy()
    if array.ndim == 1 or (kind not in (TYPES["F32"], TYPES["F16"]) and array.shape[-1] % BLOCK):
        writer.add_tensor(name, array)  # norms and biases: F32
    elif kind in (TYPES["F32"], TYPES["F16"]):
        writer.add_tensor(name, array.astype(np.float16 if kind == TYPES["F16"] else np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def export_gguf(folder: Path, out: Path, type_name: str = "Q8_0") -> Path:
    """Writes the folder's model to `out` with its matrices in type_name; returns out."""
    architecture = ARCHITECTURES.get(str((read_json(folder / "config.json").get("architectures") or [""])[0]))
    if architecture is None:
        raise CheckpointError(folder / "config.json", f"not one of {', '.join(ARCHITECTURES)}")
    model, tokenizer = load_hf_folder(folder)
    assert isinstance(model, Generator) and isinstance(tokenizer, FastTextTokenizer)
    c, kind = model.config, TYPES[type_name]
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_context_length(c.max_len)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_rope_dimension_count(int(c.head_dim * c.rotary_fraction))
    rope_freqs: torch.Tensor | None = None
    if c.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_factor)
    elif c.rope_scaling == "llama3":  # as llama.cpp's converter writes it: each frequency's divisor, a tensor
        rotary_dim = int(c.head_dim * c.rotary_fraction)
        scaled = rope_inv_freq(
            rotary_dim, c.rope_base, "llama3", c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_len
        )  # (R/2,)
        rope_freqs = rope_inv_freq(rotary_dim, c.rope_base) / scaled
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if type_name == "F32" else gguf.LlamaFileType[f"MOSTLY_{type_name}"]))
    tokens, types, merges, pre = _vocabulary(folder, tokenizer, c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(c.eos_id)
    for extra in c.extra_eos_ids[:1]:
        writer.add_eot_token_id(extra)
    writer.add_pad_token_id(c.pad_id)
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_add_bos_token(tokenizer.bos_id is not None)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
    with torch.no_grad():
        _tensor(writer, "token_embd.weight", model.embed.weight, kind)
        if rope_freqs is not None:
            writer.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
        state = model.state_dict()
        _tensor(writer, "output_norm.weight", state["final_norm.weight"], kind)
        if model.lm_head is not None:
            _tensor(writer, "output.weight", state["lm_head.weight"], kind)
        for i, layer in enumerate(cast(list[DecoderLayer], model.layers)):
            blk, attention = f"blk.{i}.", layer.self_attn
            (q, q_bias), (k, k_bias), (v, v_bias) = attention.projection_weights()
            if architecture == "llama":
                q, k = _interleave(q, c.n_heads), _interleave(k, c.kv_heads)
                q_bias, k_bias = (None if b is None else _interleave(b, n) for b, n in ((q_bias, c.n_heads), (k_bias, c.kv_heads)))
            for name, weight, bias in (("attn_q", q, q_bias), ("attn_k", k, k_bias), ("attn_v", v, v_bias)):
                _tensor(writer, f"{blk}{name}.weight", weight, kind)
                if bias is not None:
                    _tensor(writer, f"{blk}{name}.bias", bias, kind)
            _tensor(writer, f"{blk}attn_output.weight", attention.out_proj.weight, kind)
            if attention.out_proj.bias is not None:
                _tensor(writer, f"{blk}attn_output.bias", attention.out_proj.bias, kind)
            ours = {"attn_norm": "attn_residual.norm", "ffn_norm": "ff_residual.norm", "ffn_gate": "feed_forward.fc1"}
            ours |= {"ffn_up": "feed_forward.up", "ffn_down": "feed_forward.fc2"}
            for name, module in ours.items():
                _tensor(writer, f"{blk}{name}.weight", state[f"layers.{i}.{module}.weight"], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--folder", type=Path, required=True, help="a Hugging Face LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM folder"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--type", default="Q8_0", choices=list(TYPES))
    args = parser.parse_args()
    out = export_gguf(args.folder, args.out, args.type)
    print(json.dumps({"out": str(out), "bytes": out.stat().st_size, "type": args.type}))


if __name__ == "__main__":
    main()
