"""Attention maps read by hooks equal attention computed by hand from the same module inputs."""

import math
from typing import Any

import torch

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import EOS_ID
from model.attention import MultiHeadAttention
from model.attention_maps import cross_attention, self_attention
from model.layers import DecoderLayer


def test_cross_attention_maps_equal_softmax_of_scaled_scores_by_hand() -> None:
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    source = tokenizer.encode("A man in a red shirt is riding a bike.") + [EOS_ID]
    target = tokenizer.encode("Ein Mann in einem roten Hemd fährt Fahrrad.") + [EOS_ID]
    inputs: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]] = []

    def keep_inputs(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.append((args[0], kwargs["key_value"], kwargs["mask"]))

    modules = [layer.src_attn for layer in model.decoder_layers if isinstance(layer, DecoderLayer)]
    handles = [m.register_forward_pre_hook(keep_inputs, with_kwargs=True) for m in modules if m is not None]
    try:
        maps = cross_attention(model, source, target)  # (L, H, T, S)
    finally:
        for handle in handles:
            handle.remove()
    assert maps.shape == (3, 4, len(target), len(source))
    for layer, (module, (x, (keys, _), mask)) in enumerate(zip(modules, inputs, strict=True)):
        assert isinstance(module, MultiHeadAttention)
        x, keys, mask = x.clone(), keys.clone(), mask.clone()  # made under inference_mode
        B, T, _ = x.shape
        with torch.no_grad():
            q = module.q_proj(x).view(B, T, module.n_heads, module.head_dim).transpose(1, 2)  # (1, H, T, D)
        scores = (q @ keys.transpose(-2, -1) / math.sqrt(module.head_dim)).masked_fill(~mask, float("-inf"))
        assert torch.allclose(maps[layer], scores.softmax(-1)[0], atol=1e-6)
    assert torch.allclose(maps.sum(-1), torch.ones(maps.shape[:-1]), atol=1e-5)


def test_self_attention_maps_are_causal_rows_of_probabilities() -> None:
    model, tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    ids = tokenizer.encode("ROMEO:\nBut soft, what light through yonder window breaks?")
    maps = self_attention(model, ids)  # type: ignore[arg-type]
    assert maps.shape == (6, 4, len(ids), len(ids))
    assert torch.all(maps.triu(diagonal=1) == 0)
    assert torch.allclose(maps.sum(-1), torch.ones(maps.shape[:-1]), atol=1e-5)
    assert torch.allclose(maps[:, :, 0, 0], torch.ones(6, 4))  # the first token can only attend to itself
