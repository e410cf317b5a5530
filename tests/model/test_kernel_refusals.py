"""The C kernels refuse what they cannot read safely, with a Python ValueError and before reading
anything: out-of-range block ids, lengths below 1, wrong shapes and dtypes, through their Python
wrappers (ctypes) and their C++ operators alike (tests/model/test_kernels_asan.py runs these under
AddressSanitizer too)."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from decoding import top_k_cpu
from model import cpu_kernels, paged_attention_cpu
from model.packed_linear import panel_kernel, panel_product, to_panels

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 6, 16, 2, 4, 8
Attention = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def attention_entries() -> list[Attention]:
    """The kernel's Python wrapper, and its C++ operator where it is built."""
    if paged_attention_cpu.kernel() is None:
        pytest.skip("the C kernels did not build here")
    entries: list[Attention] = [paged_attention_cpu._kernel_attention]
    if "paged_decode_attention" in cpu_kernels.native_operators():
        entries.append(torch.ops.transformer_serving.paged_decode_attention)
    return entries


def pools() -> tuple[Tensor, Tensor]:
    torch.manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape), torch.randn(shape)


@pytest.mark.parametrize(
    ("key_blocks", "lengths", "message"),
    [
        ([[1, NUM_BLOCKS]], [20], f"block id outside the pools' {NUM_BLOCKS} blocks"),
        ([[1, 10**12]], [17], "block id outside"),
        ([[-1, 2]], [3], "block id outside"),
        ([[1, 2]], [0], "length below 1"),
        ([[1, 2]], [-5], "length below 1"),
        ([[1, 2]], [33], "past the rows' 2 blocks of 16"),
    ],
)
def test_attention_refuses_block_ids_and_lengths_it_cannot_read(key_blocks: list[list[int]], lengths: list[int], message: str) -> None:
    keys, values = pools()
    queries = torch.randn(1, HEADS, HEAD_DIM)
    for attend in attention_entries():
        with pytest.raises(ValueError, match=message):
            attend(queries, keys, values, torch.tensor(key_blocks), torch.tensor(lengths))


def test_attention_reads_only_the_blocks_a_length_reaches() -> None:
    """A table's entries past its length (padding) are not block ids the kernel reads: any value passes."""
    keys, values = pools()
    queries = torch.randn(1, HEADS, HEAD_DIM)
    for attend in attention_entries():
        padded = attend(queries, keys, values, torch.tensor([[3, 10**9]]), torch.tensor([BLOCK_SIZE]))
        assert torch.equal(padded, attend(queries, keys, values, torch.tensor([[3, 0]]), torch.tensor([BLOCK_SIZE])))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v, b, n: (q.double(), k, v, b, n), "queries"),
        (lambda q, k, v, b, n: (q[0], k, v, b, n), "queries"),
        (lambda q, k, v, b, n: (q, k.double(), v.double(), b, n), "pools"),
        (lambda q, k, v, b, n: (q, k, v[:, :8].contiguous(), b, n), "pools"),
        (lambda q, k, v, b, n: (q, k.transpose(1, 2), v.transpose(1, 2), b, n), "pools"),
        (lambda q, k, v, b, n: (q[:, :3], k, v, b, n), "multiple of key heads"),
        (lambda q, k, v, b, n: (q, k, v, b[:1], n), "block tables"),
        (lambda q, k, v, b, n: (q, k, v, b, n[:1]), "block tables"),
        (lambda q, k, v, b, n: (q, k, v, b[0], n), "block tables"),
    ],
)
def test_attention_refuses_shapes_and_dtypes_not_its_own(change: Callable[..., tuple[Tensor, ...]], message: str) -> None:
    keys, values = pools()
    inputs = (torch.randn(2, HEADS, HEAD_DIM), keys, values, torch.tensor([[1, 2], [3, 0]]), torch.tensor([20, 5]))
    for attend in attention_entries():
        attend(*inputs)  # as given, they are the kernel's
        with pytest.raises(ValueError, match=message):
            attend(*change(*inputs))


def panel_entries() -> list[Callable[[Tensor, Tensor, Tensor | None, int], Tensor]]:
    if panel_kernel() is None:
        pytest.skip("the C kernels did not build here")
    entries: list[Callable[[Tensor, Tensor, Tensor | None, int], Tensor]] = [panel_product]
    if "panel_linear" in cpu_kernels.native_operators():
        entries.append(torch.ops.transformer_serving.panel_linear)
    return entries


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, p, b, n: (x.double(), p, b, n), "rows"),
        (lambda x, p, b, n: (x[0], p, b, n), "rows"),
        (lambda x, p, b, n: (x, p.double(), b, n), "panels"),
        (lambda x, p, b, n: (x, p[:, :40], b, n), "panels"),
        (lambda x, p, b, n: (x, p.transpose(1, 2), b, n), "panels"),
        (lambda x, p, b, n: (x, p[:1], b, n), "panels"),
        (lambda x, p, b, n: (x, p, b, 0), "panels"),
        (lambda x, p, b, n: (x, p, b[:10], n), "bias"),
        (lambda x, p, b, n: (x, p, b.double(), n), "bias"),
    ],
)
def test_the_panel_product_refuses_shapes_and_dtypes_not_its_own(change: Callable[..., tuple[object, ...]], message: str) -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(3, 64), to_panels(torch.randn(50, 64)), torch.randn(50), 50)
    for product in panel_entries():
        product(*inputs)  # as given, they are the kernel's
        with pytest.raises(ValueError, match=message):
            product(*change(*inputs))


@pytest.mark.parametrize(
    ("logits", "k", "rows", "message"),
    [
        (torch.zeros(2, 10), 0, None, "k = 0 of 10"),
        (torch.zeros(2, 10), 11, None, "k = 11 of 10"),
        (torch.zeros(10), 1, None, "logits"),
        (torch.zeros(2, 10), 1, torch.tensor([0, 2]), "rows outside the logits' 2"),
        (torch.zeros(2, 10), 1, torch.tensor([-1]), "rows outside"),
    ],
)
def test_top_k_refuses_what_it_cannot_read(logits: Tensor, k: int, rows: Tensor | None, message: str) -> None:
    if top_k_cpu.kernel() is None:
        pytest.skip("the C kernels did not build here")
    with pytest.raises(ValueError, match=message):
        top_k_cpu.row_top_k(logits, k, rows=rows)


@pytest.mark.parametrize(
    ("logits", "temperature", "uniform", "message"),
    [
        (torch.zeros(10), torch.ones(1), torch.zeros(1), r"logits \(S, V\)"),
        (torch.zeros(2, 0), torch.ones(2), torch.zeros(2), r"V > 0"),
        (torch.zeros(2, 10), torch.ones(3), torch.zeros(2), "temperature and uniform"),
        (torch.zeros(2, 10), torch.ones(2), torch.zeros(1), "temperature and uniform"),
        (torch.zeros(2, 10), torch.tensor([1.0, 0.0]), torch.zeros(2), "temperatures above 0"),
        (torch.zeros(2, 10), torch.tensor([1.0, float("nan")]), torch.zeros(2), "temperatures above 0"),
        (torch.zeros(2, 10), torch.ones(2), torch.tensor([0.5, 1.5]), r"uniforms in \[0, 1\]"),
    ],
)
def test_the_draw_refuses_what_it_cannot_read(logits: Tensor, temperature: Tensor, uniform: Tensor, message: str) -> None:
    if top_k_cpu.draw_kernel() is None:
        pytest.skip("the C kernels did not build here")
    with pytest.raises(ValueError, match=message):
        top_k_cpu.row_draw(logits, temperature, uniform)
