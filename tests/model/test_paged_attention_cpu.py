"""The CPU paged decode attention kernel (model/paged_attention_cpu.py) against the plain path it
replaces (the blocks gathered, then SDPA): same attention, same pool writes, for grouped and plain
heads, ragged lengths and scattered blocks (how it is built: tests/model/test_cpu_kernels.py). Also the CPU's
two-part attention of a prompt chunk after a cached prefix against one masked SDPA."""

import shutil

import pytest
import torch

from model import paged_attention_cpu
from model.kv_cache import PagedKVCache, PagedLayer, ragged_step


def test_the_kernel_builds_where_there_is_a_c_compiler() -> None:
    """CI and this project's machines have one: the kernel's equality tests below must not be
    comparing the plain path with itself."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    assert paged_attention_cpu.kernel() is not None


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "block_size"), [(9, 3, 16), (4, 4, 8), (8, 1, 16)])
def test_decode_attention_and_writes_equal_the_plain_paths(n_heads: int, n_kv_heads: int, block_size: int) -> None:
    if paged_attention_cpu.kernel() is None:
        pytest.skip("the kernel did not build here")
    torch.manual_seed(0)
    head_dim, lengths = 32, [1, 7, block_size, 3 * block_size + 5, 100]  # keys of each sequence, its new token the last
    blocks_needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + 1
    order = (torch.randperm(num_blocks - 1) + 1).tolist()  # scattered, never the null block 0
    tables = [[order.pop() for _ in range(n)] for n in blocks_needed]
    results = []
    for decode_kernel in (False, True):
        cache = PagedKVCache(1, num_blocks, block_size, n_kv_heads, head_dim)
        torch.manual_seed(1)
        cache.keys[0].normal_()
        cache.values[0].normal_()
        step = ragged_step([1] * len(lengths), [n - 1 for n in lengths], tables, block_size, torch.device("cpu"))
        q = torch.randn(1, n_heads, len(lengths), head_dim)
        k, v = torch.randn(1, n_kv_heads, len(lengths), head_dim), torch.randn(1, n_kv_heads, len(lengths), head_dim)
        out = PagedLayer(cache.keys[0], cache.values[0], step, decode_kernel).attend(q, k, v)  # (1, H, N, D)
        results.append((out, cache.keys[0], cache.values[0]))
    (plain, plain_keys, plain_values), (fast, fast_keys, fast_values) = results
    assert fast.shape == plain.shape == (1, n_heads, len(lengths), head_dim)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_keys, plain_keys) and torch.equal(fast_values, plain_values)


def test_lengths_past_the_rows_blocks_are_refused_not_read() -> None:
    if paged_attention_cpu.kernel() is None:
        pytest.skip("the kernel did not build here")
    pool = torch.zeros(4, 16, 2, 8)
    with pytest.raises(ValueError, match="past the rows' 2 blocks of 16"):
        paged_attention_cpu.paged_decode_attention(torch.zeros(1, 2, 8), pool, pool, torch.tensor([[1, 2]]), torch.tensor([33]))


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(9, 3), (4, 4)])
def test_a_chunk_after_a_cached_prefix_attends_as_the_masked_sdpa_over_all_its_keys(n_heads: int, n_kv_heads: int) -> None:
    """The CPU's two-part attention of a prompt chunk (model/kv_cache.py `_attend_after_prefix`:
    the cached keys unmasked, the chunk's own causal, merged) against one SDPA over every key with
    the causal mask."""
    torch.manual_seed(0)
    block_size, head_dim, start, length = 16, 32, 37, 11
    cache = PagedKVCache(1, 8, block_size, n_kv_heads, head_dim)
    cache.keys[0].normal_()
    cache.values[0].normal_()
    table = [5, 2, 7, 1]  # keys [0, 48) then the chunk's up to 48
    step = ragged_step([length], [start], [table], block_size, torch.device("cpu"))
    q = torch.randn(1, n_heads, length, head_dim)
    k, v = torch.randn(1, n_kv_heads, length, head_dim), torch.randn(1, n_kv_heads, length, head_dim)
    out = PagedLayer(cache.keys[0], cache.values[0], step).attend(q, k, v)  # writes the chunk's keys, then attends
    flat_keys, flat_values = (c.view(-1, n_kv_heads, head_dim) for c in (cache.keys[0], cache.values[0]))
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(start + length)])
    keys, values = (c.index_select(0, slots).transpose(0, 1)[None] for c in (flat_keys, flat_values))  # (1, Hkv, start + T, D)
    causal = torch.arange(start + length)[None] <= torch.arange(start, start + length)[:, None]  # (T, start + T)
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=causal, enable_gqa=n_heads != n_kv_heads)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
