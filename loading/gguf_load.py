"""A GGUF file's model built from its tensors (loading/gguf.py reads and checks the header): the
quantized matrices kept in their blocks (model/block_quant.py), the float ones as float32 layers."""

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from loading.gguf import BF16, FLOAT_TYPES, INTERLEAVED_ROPE, GGUFFile, inspect_gguf, read_config, read_tokenizer
from loading.hf.load import parameters_on_meta
from loading.hf_tokenizers import FastTextTokenizer
from model.block_quant import BLOCK_BYTES, BlockEmbedding, BlockLinear, ConcatenatedLinear
from model.generator import Generator
from model.layers import DecoderLayer


def _mapped(file: GGUFFile, name: str) -> Tensor:
    """The file's tensor `name` as it lies in the map (no copy): (rows, columns) floats, or (rows,
    row bytes) uint8 for a quantized one."""
    tensor = file.tensors.get(name)
    if tensor is None:
        raise file.error(f"missing tensor {name}")
    return torch.from_numpy(tensor.data)


def _float(file: GGUFFile, name: str) -> Tensor:
    """A float tensor (F32, F16, BF16) as float32, its shape as the model's (rows first): F32 the
    file's pages, the others converted."""
    tensor = file.tensors[name]
    data, shape = _mapped(file, name), [int(n) for n in reversed(tensor.shape)]
    if int(tensor.tensor_type) == BF16:
        return data.view(torch.int16).view(torch.bfloat16).float().reshape(shape)
    return data.float().reshape(shape)  # F32: the same tensor


def _rope_rows(n_heads: int, head_dim: int) -> Tensor:
    """The file's q (or k) rows in rotate-half order: llama.cpp's converter wrote head h's row
    h D + 2 i + t for our row h D + t D / 2 + i."""
    return torch.arange(n_heads * head_dim).view(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


@dataclass(frozen=True)
class Part:
    """One tensor of a linear layer: its rows (in our order) quantized or as float32."""

    kind: int
    data: Tensor  # (out, row bytes) uint8 blocks, or (out, in) float32
    bias: Tensor | None


def _part(file: GGUFFile, name: str, shape: tuple[int, int], rows: Tensor | None = None) -> Part:
    """The layer `name`'s weight of `shape` (out, in) and its bias, if the file has one."""
    tensor = file.tensors.get(f"{name}.weight")
    if tensor is None:
        raise file.error(f"missing tensor {name}.weight")
    found = tuple(int(n) for n in reversed(tensor.shape))
    if found != shape:
        raise file.error(f"tensor {name}.weight has shape {found}, expected {shape}")
    kind = int(tensor.tensor_type)
    data = _float(file, f"{name}.weight") if kind in FLOAT_TYPES else _mapped(file, f"{name}.weight")
    bias = _float(file, f"{name}.bias") if f"{name}.bias" in file.tensors else None
    if rows is not None:
        data, bias = data[rows].contiguous(), None if bias is None else bias[rows]
    return Part(kind, data, bias)


def _linear(parts: list[Part], in_features: int) -> nn.Module:
    """One layer of parts stacked by rows: float32 (nn.Linear), one block type, or parts of several."""
    if len({p.kind for p in parts}) > 1:
        return ConcatenatedLinear([_linear([p], in_features) for p in parts])
    biases = [p.bias for p in parts]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat([b if b is not None else torch.zeros(len(p.data)) for p, b in zip(parts, biases, strict=True)])
    )
    data = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
    if parts[0].kind in BLOCK_BYTES:
        return BlockLinear(data, parts[0].kind, in_features, bias)
    layer = nn.Linear(in_features, data.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(data, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _norm_weight(file: GGUFFile, name: str) -> nn.Parameter:
    return nn.Parameter(_float(file, name), requires_grad=False)


def load_gguf(path: Path, device: str | torch.device = "cpu") -> tuple[Generator, FastTextTokenizer]:
    """The file's model in eval mode on device (float32 activations; the quantized weights kept in
    their blocks) and its tokenizer; CheckpointError when it cannot be served."""
    file = inspect_gguf(path)
    config = read_config(file)
    tokenizer = read_tokenizer(file)
    with parameters_on_meta():
        model = Generator(config)
    c, permuted = config, file.architecture in INTERLEAVED_ROPE
    kind = int(file.tensors["token_embd.weight"].tensor_type)
    found = tuple(int(n) for n in reversed(file.tensors["token_embd.weight"].shape))
    if found != (c.vocab_size, c.d_model):
        raise file.error(f"tensor token_embd.weight has shape {found}, expected {(c.vocab_size, c.d_model)}")
    if kind in BLOCK_BYTES:
        embedding = BlockEmbedding(_mapped(file, "token_embd.weight"), kind, c.d_model)
        model.register_module("embed", embedding)
        model.output_projection = embedding.as_linear() if c.tie_embeddings else None
    else:
        model.embed = nn.Embedding.from_pretrained(_float(file, "token_embd.weight"))
    if not c.tie_embeddings:
        model.lm_head = _linear([_part(file, "output", (c.vocab_size, c.d_model))], c.d_model)
    model.final_norm.register_parameter("weight", _norm_weight(file, "output_norm.weight"))
    q_rows = _rope_rows(c.n_heads, c.head_dim) if permuted else None
    k_rows = _rope_rows(c.kv_heads, c.head_dim) if permuted else None
    q, kv = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    for i, layer in enumerate(cast(list[DecoderLayer], model.layers)):
        blk = f"blk.{i}."
        parts = [_part(file, blk + "attn_q", (q, c.d_model), q_rows), _part(file, blk + "attn_k", (kv, c.d_model), k_rows)]
        layer.self_attn.register_module("qkv_proj", _linear([*parts, _part(file, blk + "attn_v", (kv, c.d_model))], c.d_model))
        layer.self_attn.register_module("out_proj", _linear([_part(file, blk + "attn_output", (c.d_model, q))], q))
        for ours, theirs, shape in [
            ("fc1", "ffn_gate", (c.d_ff, c.d_model)),
            ("up", "ffn_up", (c.d_ff, c.d_model)),
            ("fc2", "ffn_down", (c.d_model, c.d_ff)),
        ]:
            layer.feed_forward.register_module(ours, _linear([_part(file, blk + theirs, shape)], shape[1]))
        layer.attn_residual.norm.register_parameter("weight", _norm_weight(file, blk + "attn_norm.weight"))
        layer.ff_residual.norm.register_parameter("weight", _norm_weight(file, blk + "ffn_norm.weight"))
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise file.error(f"no tensor for {', '.join(left[:5])}")
    return model.to(device).eval(), tokenizer
