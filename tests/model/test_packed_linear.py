"""PackedLinear (the C panel kernel for a few rows, oneDNN's pre-packed weights for more, torch's
batched GEMM over the panels past those) computes what nn.Linear computes, up to float32 rounding,
and on the shipped checkpoints the packed models decode the same tokens as the plain ones. The test
session runs torch on one thread (tests/conftest.py), so a few rows take the panel kernel unless a
test sets more threads."""

import ctypes
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoding.reference_decoding import generate_greedy_uncached
from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import EOS_ID
from model import cpu_kernels
from model.generator import Generator
from model.packed_linear import (
    MAX_PACKED_ROWS,
    PackedLinear,
    max_panel_rows,
    pack_linear_layers,
    packing_available,
    padded_rows,
    panel_linear,
    panels_apply,
    to_panels,
)
from model.positions import apply_rope, rope_tables
from model.translator import Translator
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from training.data import SHARED_DATA, pad, read_lines

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two threads for one test: the panel kernel (single-threaded) steps aside for oneDNN."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


def test_the_panel_kernel_runs_on_one_thread_where_there_is_a_c_compiler(two_threads: None) -> None:
    """CI and this project's machines have one: the equality tests below must not be comparing
    oneDNN with itself."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    assert not panels_apply()
    torch.set_num_threads(1)
    assert panels_apply()


SHAPES = [
    (1, 256),
    (2, 256),
    (3, 256),
    (5, 256),
    (9, 256),
    (16, 256),
    (17, 256),
    (32, 256),
    (33, 256),
    (64, 256),
    (128, 256),
    (129, 256),
    (200, 256),
    (256, 256),
    (257, 256),
    (300, 256),
    (600, 256),
]
SHAPES += [(2, 5, 256), (1, 1, 256)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [1024, 1000, 40])  # whole panels of 64 columns, a part panel, one part panel
@pytest.mark.parametrize("shape", SHAPES)
def test_packed_linear_equals_the_plain_layer(shape: tuple[int, ...], out_features: int, bias: bool) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(256, out_features, bias=bias)
    packed = PackedLinear(plain.weight, plain.bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected, got = plain(x), packed(x)
    assert got.shape == expected.shape == (*shape[:-1], out_features)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.weight, plain.weight)


@pytest.mark.parametrize("in_features", [1, 3, 5, 67, 258])  # the k loops take four at a time on AVX2: remainders of 1-3
@pytest.mark.parametrize("rows", [2, 9, 13, 64])  # the row groups and the half panels
def test_inputs_of_any_width_equal_the_plain_layer(rows: int, in_features: int) -> None:
    """The panel kernel itself (not a path that might fall back to oneDNN) against nn.Linear."""
    if not panels_apply():
        pytest.skip("the panel kernel is off here")
    torch.manual_seed(in_features)
    plain = nn.Linear(in_features, 70)
    packed = PackedLinear(plain.weight, plain.bias)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        torch.testing.assert_close(panel_linear(x, packed.panels, packed.bias, 70), plain(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, max_panel_rows()])
def test_on_two_threads_onednn_takes_the_few_rows_and_equals_the_plain_layer(rows: int, two_threads: None) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(256, 1000)
    packed = PackedLinear(plain.weight, plain.bias)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        assert torch.allclose(packed(x), plain(x), atol=1e-5, rtol=1e-5)


# The panel kernel's operation (in pieces past max_panel_rows()), oneDNN's on its packed weight (two threads).
@pytest.mark.parametrize(("rows", "threads"), [(3, 1), (2 * max_panel_rows() + 1, 1), (3, 2), (max_panel_rows() + 1, 2)])
def test_a_compiled_graph_calls_both_products_as_operations_and_equals_the_eager_layer(
    rows: int, threads: int, request: pytest.FixtureRequest
) -> None:
    if threads == 2:
        request.getfixturevalue("two_threads")
    torch.manual_seed(0)
    packed = PackedLinear(torch.randn(100, 256), torch.randn(100))
    x = torch.randn(rows, 256)
    graph = torch.compile(lambda x: packed(x + 1) * 2, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        assert torch.allclose(graph(x), packed(x + 1) * 2, atol=1e-5, rtol=1e-5)


def test_on_one_thread_the_panel_kernel_takes_rows_past_its_limit_in_pieces_where_onednn_would_take_pieces_as_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where max_panel_rows() is MAX_PACKED_ROWS (AVX2's half panels) the kernel takes every row
    count, each piece written in place; elsewhere oneDNN takes the rows past it."""
    if not panels_apply():
        pytest.skip("the CPU kernels are not built")
    torch.manual_seed(0)
    plain = nn.Linear(256, 1000)
    packed = PackedLinear(plain.weight, plain.bias)
    x = torch.randn(2 * max_panel_rows() + 7, 256)
    onednn = torch.ops.mkldnn._linear_pointwise
    calls: list[int] = []

    def counted(rows: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(rows.shape[0])
        return onednn(rows, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)  # the real product, its calls counted
    with torch.inference_mode():
        got = packed(x)
    monkeypatch.undo()
    assert torch.allclose(got, plain(x), atol=1e-5, rtol=1e-5)
    assert calls == ([] if max_panel_rows() >= MAX_PACKED_ROWS else [padded_rows(len(piece)) for piece in x.split(MAX_PACKED_ROWS)])


def test_the_packed_path_runs_few_row_counts() -> None:
    # oneDNN keeps a kernel (and memory) per row count it sees: 19 counts, each at least the rows.
    counts = {padded_rows(n) for n in range(2, MAX_PACKED_ROWS + 1)}
    assert len(counts) == 19 and max(counts) == MAX_PACKED_ROWS
    assert all(n <= padded_rows(n) < n + 16 for n in range(2, MAX_PACKED_ROWS + 1))


def test_with_gradients_the_batched_gemm_computes_them() -> None:
    # Neither kernel has a gradient: with autograd on, 8 rows take torch's GEMM over the panels.
    torch.manual_seed(0)
    plain = nn.Linear(256, 256)
    packed = PackedLinear(plain.weight, plain.bias)
    x_plain, x_packed = torch.randn(8, 256).requires_grad_(), torch.randn(8, 256).requires_grad_()
    with torch.no_grad():
        x_packed.copy_(x_plain)
    with torch.enable_grad():
        y_plain, y_packed = plain(x_plain), packed(x_packed)
        (y_plain**2).sum().backward()
        (y_packed**2).sum().backward()
    assert torch.allclose(y_packed, y_plain, atol=1e-5)
    assert x_packed.grad is not None and x_plain.grad is not None
    assert torch.allclose(x_packed.grad, x_plain.grad, atol=1e-4)


def test_packing_replaces_every_linear_and_projects_with_the_embedding() -> None:
    model, _ = load_checkpoint(DEFAULT_GENERATOR)
    assert isinstance(model, Generator)
    pack_linear_layers(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.output_projection, PackedLinear)
    assert torch.equal(model.output_projection.weight, model.embed.weight)


@pytest.mark.parametrize("rows", [1, 5, 16, 300])  # the panel kernel at 1, 5 and 16 rows; oneDNN in two pieces
def test_packed_queries_keys_and_values_equal_three_separate_products(rows: int) -> None:
    plain, _ = load_checkpoint(DEFAULT_TRANSLATOR)
    model, _ = load_checkpoint(DEFAULT_TRANSLATOR)
    assert isinstance(plain, Translator) and isinstance(model, Translator)
    pack_linear_layers(model)
    attentions = [layer.self_attn for layer in [*model.encoder_layers, *model.decoder_layers]]
    plain_attentions = [layer.self_attn for layer in [*plain.encoder_layers, *plain.decoder_layers]]
    x = torch.randn(1, rows, model.config.d_model)
    with torch.inference_mode():
        for attention, plain_attention in zip(attentions, plain_attentions, strict=True):
            assert isinstance(attention.qkv_proj, PackedLinear)
            separate = [
                F.linear(x, w, b).view(1, rows, -1, attention.head_dim).transpose(1, 2) for w, b in plain_attention.projection_weights()
            ]
            for a, b in zip(attention._project_self(x), separate, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7])
def test_queries_and_keys_rotated_together_equal_each_rotated_alone(rows: int) -> None:
    model, _ = load_checkpoint(DEFAULT_GENERATOR)
    assert isinstance(model, Generator)
    pack_linear_layers(model)
    cos, sin = rope_tables(model.config.max_len, model.config.d_model // model.config.n_heads)
    positions = torch.tensor([[3, 40, 41, 100, 101, 102, 255][:rows], [0, 1, 2, 3, 4, 5, 6][:rows]])  # (B, T)
    rope = cos[positions][:, None], sin[positions][:, None]  # (B, 1, T, D) each
    x = torch.randn(2, rows, model.config.d_model)
    with torch.inference_mode():
        for layer in model.layers:
            q, k, v = layer.self_attn._project_self(x, rope)  # one product, one rotation of q and k together
            q_plain, k_plain, v_plain = layer.self_attn._project_self(x)  # unrotated
            for a, b in zip((q, k, v), (apply_rope(q_plain, *rope), apply_rope(k_plain, *rope), v_plain), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_packed_translator_translates_as_the_plain_one() -> None:
    plain, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    packed, _ = load_checkpoint(DEFAULT_TRANSLATOR)
    assert isinstance(plain, Translator) and isinstance(packed, Translator)
    pack_linear_layers(packed)
    sentences = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")[:32]
    ids = [tokenizer.encode(s) + [EOS_ID] for s in sentences]
    src = pad(ids)  # (B, S)
    tgt = src[:, :12]  # any target ids will do for comparing logits
    with torch.inference_mode():
        assert torch.allclose(packed(src, tgt), plain(src, tgt), atol=1e-4)  # (B, T, V)
    params = GenerationParams(sampling=GREEDY, max_tokens=60)
    packed_out, plain_out = ([c.token_ids for c in OfflineEngine(m, tokenizer).generate(ids, params)] for m in (packed, plain))
    assert packed_out == plain_out


def test_packed_generator_generates_as_the_plain_one() -> None:
    plain, tokenizer = load_checkpoint(DEFAULT_GENERATOR)
    packed, _ = load_checkpoint(DEFAULT_GENERATOR)
    pack_linear_layers(packed)  # type: ignore[arg-type]
    for prompt in ["ROMEO:\n", "KING HENRY:\nNow"]:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            assert generate_greedy_uncached(packed, ids, 40) == generate_greedy_uncached(plain, ids, 40)


def _vector_targets() -> list[str]:
    """gcc -march levels this CPU runs, one per vector width the panel kernel picks: SSE's 4 floats,
    AVX2's 8 and AVX-512's 16 (x86); the native one elsewhere."""
    if platform.machine() != "x86_64":
        return ["native"]
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return ["x86-64"] + ["x86-64-v3"] * ("avx2" in flags and "fma" in flags) + ["x86-64-v4"] * ("avx512f" in flags)


@pytest.mark.parametrize("target", _vector_targets())
def test_the_panel_kernel_built_for_each_vector_width_equals_the_plain_product(target: str, tmp_path: Path) -> None:
    """Each width has its own accumulators per row group (model/csrc/panel_linear.c): every group
    remainder, the half panels' balanced groups, part panels and part half panels and no bias,
    built for each width this CPU runs, not only its widest."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    kernel = ctypes.CDLL(str(cpu_kernels.build(compiler, tmp_path, march=target))).panel_linear
    kernel.restype, kernel.argtypes = None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    torch.manual_seed(0)
    for rows in [*range(1, 20), 24, 25, 31, 64, 127, 256]:  # the 6-row groups of half panels past 8 rows (AVX2)
        for out_features, bias in ((96, True), (70, False), (88, True)):
            weight, x = torch.randn(out_features, 48), torch.randn(rows, 48)
            b = torch.randn(out_features) if bias else None
            panels, y = to_panels(weight), torch.empty(rows, out_features)
            kernel(x.data_ptr(), panels.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(), rows, 48, out_features)
            assert torch.allclose(y, F.linear(x, weight, b), atol=1e-5, rtol=1e-5), (rows, out_features)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [1024, 1000, 40, 3])  # whole panels, a part panel, one part panel, fewer than a vector
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 13, 64, 257])  # the kernel's row groups of each vector width, its half panels
def test_the_argmax_kernel_is_the_argmax_of_the_products(rows: int, out_features: int, bias: bool) -> None:
    """PackedLinear.argmax (panel_argmax: the products folded into a running maximum, never stored)
    equals forward's products' argmax exactly, the first of equal ones; a row holding a NaN or
    +inf product makes it answer None."""
    layer = PackedLinear(torch.randn(out_features, 64), torch.randn(out_features) if bias else None)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    x[0] = 0.0  # every product of row 0 equal (the bias, if any): the first column without one
    with torch.inference_mode():
        ids = layer.argmax(x)
        if ids is None:
            pytest.skip("the panel kernel is off here")
        assert torch.equal(ids, layer(x).argmax(-1))
        tied = PackedLinear(torch.cat([layer.weight, layer.weight]), None)  # every column twice: the first of each pair wins
        tied_ids = tied.argmax(x)
        assert tied_ids is not None and torch.equal(tied_ids, tied(x).argmax(-1)) and bool((tied_ids < out_features).all())
        poisoned = x.clone()
        poisoned[-1] = float("nan")  # every product of the last row NaN
        assert layer.argmax(poisoned) is None
        infinite = torch.zeros(out_features)
        infinite[-1] = float("inf")  # the last column's products +inf
        assert PackedLinear(layer.weight, infinite).argmax(x) is None
