"""Weights quantized at load (model/quantize.py): close to float32 layer by layer, independent of
the batch row by row, and int8 (Q8_0 blocks) within its quality bounds on the shipped checkpoints:
the translator's greedy test_2016 BLEU within 0.3 of float32's, the generator's nats/char on its
validation split within 0.01."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sacrebleu.metrics.bleu import BLEU
from torch import nn

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_checkpoint
from model import cpu_kernels
from model.block_quant import BlockLinear, q8_available, set_activation_bits
from model.config import Quantization
from model.generator import Generator
from model.quantize import (
    EXACT_FLOAT_K,
    GGML_TYPES,
    INT8_KERNEL_ROWS,
    Int8Linear,
    int8_kernel_built,
    int8_matmul,
    int8_rows_product,
)
from model.translator import Translator
from service.engine.offline import OfflineEngine
from training.data import SHARED_DATA, read_lines, split_shakespeare
from training.lm_scoring import nats_per_char


def test_quantized_linear_layers_are_close_to_the_float_layer() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 1024)
    x = torch.randn(5, 7, 256)
    expected = linear(x)
    layers = {"int8": Int8Linear.from_linear(linear)}
    layers |= {q: BlockLinear.quantized(linear.weight, linear.bias, GGML_TYPES[q]) for q in ("q8_0", "q4_0", "q4_1")}
    for quantization, layer in layers.items():
        got = layer(x)
        assert got.shape == expected.shape == (5, 7, 1024)
        relative_error = (got - expected).norm() / expected.norm()
        assert 0 < relative_error < (0.02 if quantization in ("int8", "q8_0") else 0.12), quantization  # rounded, not copied


@pytest.mark.parametrize("k", [1, 256, EXACT_FLOAT_K, EXACT_FLOAT_K + 1, 2500])
def test_the_float_gemm_path_gives_torchs_int8_sums_exactly(k: int) -> None:
    """int8_matmul without torch._int_mm (AVX2-only CPUs) computes the same int32 sums, also at
    the largest magnitudes: rows and columns of +-127 over all of K."""
    generator = torch.Generator().manual_seed(k)
    a = torch.randint(-127, 128, (9, k), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (k, 33), dtype=torch.int8, generator=generator)
    a[0], b[:, 0], b[:, 1] = 127, 127, -127  # sums of +-127^2 k
    expected = torch._int_mm(a, b).float()
    assert expected[0, 0] == float(127 * 127 * k) and expected[0, 1] == float(-127 * 127 * k)
    assert torch.equal(int8_matmul(a, b, use_int_mm=False), expected)


@pytest.mark.parametrize("in_features", [64, 96, 1024])
def test_a_rows_output_does_not_depend_on_its_batch(in_features: int) -> None:
    """Int8Linear's few rows (the C kernel) and many rows (the GEMMs) give each row the same
    output, to the bit; so do the block types' rows within a kernel call."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 40)
    rows = torch.randn(INT8_KERNEL_ROWS + 4, in_features)
    rows[3] *= 100  # one row far larger than the rest: a shared scale would crush the others
    for layer in [Int8Linear.from_linear(linear), BlockLinear.quantized(linear.weight, linear.bias, GGML_TYPES["q8_0"])]:
        batched = layer(rows if isinstance(layer, Int8Linear) else rows[:6])
        for i in range(len(batched)):
            assert torch.equal(layer(rows[i : i + 1])[0], batched[i]), type(layer).__name__
        assert torch.equal(layer(rows[:5]), batched[:5])
    int8 = Int8Linear.from_linear(linear)
    if int8_kernel_built():  # both paths on the same rows, and on rows the kernel's row groups split unevenly
        many = torch.cat([rows] * 13)  # past INT8_KERNEL_ROWS wherever it lies: forward takes the GEMMs
        assert len(many) > INT8_KERNEL_ROWS and torch.equal(int8.by_kernel(many), int8.by_gemms(many))
        assert torch.equal(int8.by_kernel(many), int8(many)) and torch.equal(int8.by_kernel(rows[:11]), int8(rows)[:11])


def test_the_int8_kernel_gives_a_row_with_a_nan_or_an_infinity_nan_outputs_and_leaves_the_others_alone() -> None:
    if not int8_kernel_built():
        pytest.skip("the int8 kernel is not built here")
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 20))
    rows = torch.randn(6, 64)
    rows[1, 5], rows[3, 0], rows[4, 63] = float("nan"), float("inf"), float("-inf")
    got = layer.by_kernel(rows)
    assert torch.isnan(got[[1, 3, 4]]).all()
    finite = [0, 2, 5]
    assert torch.equal(got[finite], layer.by_gemms(rows[finite]))


def test_the_cpp_int8_operator_equals_its_python_function_and_refuses_what_is_not_its_own() -> None:
    if "int8_linear" not in cpu_kernels.native_operators() or not q8_available():
        pytest.skip("the C++ operators or the int8 kernel are not built here")
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(96, 44))  # 44 outputs: the last group of 8 padded
    weight = layer.weight_x8
    assert weight is not None
    operator = torch.ops.transformer_serving.int8_linear
    for n, bias in [(1, layer.bias), (5, None), (16, layer.bias), (19, layer.bias)]:
        rows = torch.randn(n, 192)[:, ::2] * torch.rand(n, 1) * 10  # not contiguous: both copy it
        layer.bias = bias
        expected = int8_rows_product(rows, weight, layer.scale, bias)
        assert torch.equal(operator(rows, weight, layer.scale, bias), expected)
        assert torch.equal(expected, layer.by_gemms(rows))  # the GEMMs' numbers
    rows = torch.randn(2, 96)
    for arguments, message in [
        ((rows.double(), weight, layer.scale, None), "rows"),
        ((rows[:, :64], weight, layer.scale, None), "weight"),
        ((rows, weight.float(), layer.scale, None), "weight"),
        ((rows, layer.weight_t, layer.scale, None), "weight"),
        ((rows, weight, layer.scale[:, :39], None), "weight"),
        ((rows, weight, layer.scale.double(), None), "scale per output"),
        ((rows, weight, layer.scale, torch.zeros(39)), "bias"),
    ]:
        with pytest.raises(ValueError, match=message):
            operator(*arguments)


@pytest.mark.parametrize(("quantization", "layer"), [("int8", Int8Linear), ("q4_1", BlockLinear)])
def test_quantize_replaces_every_linear_layer_and_the_output_projection(quantization: Quantization, layer: type) -> None:
    model, _ = load_checkpoint(DEFAULT_TRANSLATOR, "cpu", quantization)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.output_projection, layer)
    assert model.embed.weight.dtype == torch.float32


def _bleu(weights: WeightType, sentences: list[str], references: list[str]) -> float:
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR, "cpu", weights)
    assert isinstance(model, Translator)
    hypotheses = [c.text for c in OfflineEngine(model, tokenizer, n_slots=64).generate(sentences)]  # greedy
    return BLEU().corpus_score(hypotheses, [references]).score


def test_int8_translator_keeps_greedy_bleu_within_0_3_of_float32() -> None:
    test_set = SHARED_DATA / "multi30k"
    sentences, references = read_lines(test_set / "test_2016_flickr.en.gz"), read_lines(test_set / "test_2016_flickr.de.gz")
    float32, int8 = _bleu(torch.float32, sentences, references), _bleu("int8", sentences, references)
    print(f"test_2016 greedy BLEU: float32 {float32:.2f}, int8 {int8:.2f}")
    assert float32 > 30  # the shipped model, not a broken load
    assert abs(int8 - float32) <= 0.3


@pytest.fixture(scope="module")
def validation_text() -> str:
    return split_shakespeare(Path(SHARED_DATA / "tinyshakespeare" / "train.txt").read_text(encoding="utf-8"))[1]


def test_int8_generator_keeps_nats_per_char_within_0_01_of_float32(validation_text: str) -> None:
    """On the first quarter of the validation split (41,000 characters; the whole split took two
    minutes of CI, and its float32 figure is the training's own report)."""
    quarter = validation_text[: len(validation_text) // 4]

    def score(weights: WeightType) -> float:
        model, tokenizer = load_checkpoint(DEFAULT_GENERATOR, "cpu", weights)
        assert isinstance(model, Generator)
        return nats_per_char(model, tokenizer, quarter, torch.device("cpu"))["nats_per_char"]

    float32, int8 = score(torch.float32), score("int8")
    print(f"nats/char on the validation split's first quarter: float32 {float32:.6f}, int8 {int8:.6f}")
    assert float32 < 1.0  # the shipped model (0.9466 on this quarter), not a broken load
    assert abs(int8 - float32) <= 0.01


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_8_bit_activations_keep_held_out_perplexity_within_1_percent(validation_text: str, quantization: Quantization) -> None:
    """A decode step's activations in 8 bits (EngineConfig.activation_bits): the perplexity of the
    validation split, scored a token at a time as decoding computes it, within 1% of float32 activations."""
    if not q8_available():
        pytest.skip("no 8-bit activation kernels on this CPU")
    model, tokenizer = load_checkpoint(DEFAULT_GENERATOR, "cpu", quantization)
    assert isinstance(model, Generator)
    ids = torch.tensor([tokenizer.encode(validation_text[:3000])[:256]])

    def perplexity(bits: int) -> float:
        set_activation_bits(model, bits)
        with torch.no_grad():  # one row a step: the activations go through the 8-bit kernels
            nll = [F.cross_entropy(model(ids[:, : t + 1])[0, -1:], ids[0, t + 1 : t + 2]) for t in range(ids.shape[1] - 1)]
        return float(torch.stack(nll).mean().exp())

    float32, eight = perplexity(32), perplexity(8)
    print(f"{quantization}: perplexity with float32 activations {float32:.4f}, 8-bit {eight:.4f}")
    assert eight != float32 and abs(eight / float32 - 1) <= 0.01
