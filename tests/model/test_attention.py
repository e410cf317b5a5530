"""Attention against references: torch.nn.MultiheadAttention, the fused SDPA path, masks."""

import math

import pytest
import torch

from model.attention import MultiHeadAttention, scaled_dot_product_attention
from model.masks import causal_mask, padding_mask


def copy_into_torch_mha(ours: MultiHeadAttention, d_model: int, n_heads: int) -> torch.nn.MultiheadAttention:
    ref = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True)
    with torch.no_grad():
        weights, biases = zip(*ours.projection_weights(), strict=True)
        ref.in_proj_weight.copy_(torch.cat(weights))
        assert ref.in_proj_bias is not None
        ref.in_proj_bias.copy_(torch.cat(biases))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_self_attention_equals_torch_multihead_attention(use_sdpa: bool) -> None:
    d_model, n_heads = 32, 4
    ours = MultiHeadAttention(d_model, n_heads).eval()
    ours.use_sdpa = use_sdpa
    ref = copy_into_torch_mha(ours, d_model, n_heads)
    x = torch.randn(3, 7, d_model)
    ids = torch.tensor([[5] * 7, [5] * 4 + [0] * 3, [5] * 6 + [0]])
    mask = padding_mask(ids, pad_id=0) & causal_mask(7)  # (B, 1, T, T)
    ours_out, _ = ours(x, mask=mask)
    # torch's boolean attn_mask is True where attention is *not* allowed.
    ref_out, _ = ref(x, x, x, attn_mask=(~mask).repeat_interleave(n_heads, dim=0).squeeze(1), need_weights=False)
    torch.testing.assert_close(ours_out, ref_out, rtol=1e-5, atol=1e-5)


def test_cross_attention_equals_torch_multihead_attention() -> None:
    d_model, n_heads = 32, 4
    ours = MultiHeadAttention(d_model, n_heads, cross=True).eval()
    ref = copy_into_torch_mha(ours, d_model, n_heads)
    x, memory = torch.randn(2, 5, d_model), torch.randn(2, 9, d_model)
    src = torch.tensor([[4] * 9, [4] * 6 + [0] * 3])
    out, weights = ours(x, key_value=ours.project_key_value(memory), mask=padding_mask(src, 0), need_weights=True)
    ref_out, ref_weights = ref(x, memory, memory, key_padding_mask=src == 0, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert weights is not None
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-5)
    assert float(weights.detach()[1, :, :, 6:].abs().max()) == 0.0  # padded keys get no weight


def test_sdpa_fast_path_equals_explicit_softmax() -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    mask = torch.rand(2, 1, 6, 10) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    bias = torch.randn(2, 4, 6, 10)
    for m in (mask, bias):
        explicit, _ = scaled_dot_product_attention(q, k, v, m)
        fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-5)


def test_attention_weights_are_the_formula() -> None:
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    out, weights = scaled_dot_product_attention(q, k, v)
    expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(out, expected @ v)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 1, 3))
