"""Attention weights of a whole input, read through the explicit attention path.

The models run their fused attention kernel; here each attention module is asked for its
weights (need_weights=True: softmax(Q K^T / sqrt(d)) written out) by forward hooks, for one
teacher-forced pass. Hooks change the modules they are on while the pass runs: use a model
nothing else is running (the service keeps a private copy for this).
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from model.attention import MultiHeadAttention
from model.generator import Generator
from model.layers import DecoderLayer
from model.masks import padding_mask
from model.translator import Translator


@contextmanager
def recorded_weights(modules: Sequence[MultiHeadAttention]) -> Iterator[list[Tensor]]:
    """Inside the block, every call of these modules computes its weights explicitly and appends
    them, (B, H, Tq, Tk), to the yielded list, in call order."""
    weights: list[Tensor] = []

    def ask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**kwargs, "need_weights": True}

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: tuple[Tensor, Tensor]) -> None:
        weights.append(output[1])

    handles = [m.register_forward_pre_hook(ask, with_kwargs=True) for m in modules]
    handles += [m.register_forward_hook(keep, with_kwargs=True) for m in modules]
    try:
        yield weights
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def cross_attention(model: Translator, source_ids: list[int], target_ids: list[int]) -> Tensor:
    """Where each target token looked in the source: (layers, heads, T, S) for the T tokens of
    target_ids, row t being the decoder step that produced target_ids[t]. source_ids end with eos."""
    device = next(model.parameters()).device
    src = torch.tensor([source_ids], device=device)  # (1, S)
    tgt_in = torch.tensor([[model.config.start_id, *target_ids[:-1]]], device=device)  # (1, T): the step that made token t sees tokens < t
    modules = []
    for layer in model.decoder_layers:
        assert isinstance(layer, DecoderLayer) and layer.src_attn is not None
        modules.append(layer.src_attn)
    with recorded_weights(modules) as weights:
        model.decode(tgt_in, model.cross_key_values(model.encode(src)), padding_mask(src, model.config.pad_id))
    return torch.stack([w[0] for w in weights]).float()  # (L, H, T, S)


@torch.inference_mode()
def self_attention(model: Generator, ids: list[int]) -> Tensor:
    """Which earlier tokens each token attends to: (layers, heads, T, T), causal (zero above the diagonal)."""
    device = next(model.parameters()).device
    modules = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        modules.append(layer.self_attn)
    with recorded_weights(modules) as weights:
        model(torch.tensor([ids], device=device))
    return torch.stack([w[0] for w in weights]).float()  # (L, H, T, T)
