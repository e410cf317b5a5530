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
from model.block_quant import BlockLinear, q8_available, set_activation_bits
from model.config import Quantization
from model.generator import Generator
from model.quantize import GGML_TYPES
from model.translator import Translator
from service.engine.offline import OfflineEngine
from training.data import SHARED_DATA, read_lines, split_shakespeare
from training.lm_scoring import nats_per_char


def test_quantized_linear_layers_are_close_to_the_float_layer() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 1024)
    x = torch.randn(5, 7, 256)
    expected = linear(x)
    for quantization, bound in [("int8", 0.01), ("q4_0", 0.12), ("q4_1", 0.12)]:
        got = BlockLinear.quantized(linear.weight, linear.bias, GGML_TYPES[quantization])(x)
        assert got.shape == expected.shape == (5, 7, 1024)
        relative_error = (got - expected).norm() / expected.norm()
        assert 0 < relative_error < bound, quantization  # rounded, not copied


def test_a_rows_output_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = BlockLinear.quantized(linear.weight, linear.bias, GGML_TYPES["int8"])
    rows = torch.randn(6, 64)
    rows[3] *= 100  # one row far larger than the rest
    batched = layer(rows)
    for i in range(6):
        assert torch.equal(layer(rows[i : i + 1])[0], batched[i])


@pytest.mark.parametrize("quantization", ["int8", "q4_1"])
def test_quantize_replaces_every_linear_layer_and_the_output_projection(quantization: Quantization) -> None:
    model, _ = load_checkpoint(DEFAULT_TRANSLATOR, "cpu", quantization)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.output_projection, BlockLinear) and model.output_projection.ggml_type == GGML_TYPES[quantization]
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
    def score(weights: WeightType) -> float:
        model, tokenizer = load_checkpoint(DEFAULT_GENERATOR, "cpu", weights)
        assert isinstance(model, Generator)
        return nats_per_char(model, tokenizer, validation_text, torch.device("cpu"))["nats_per_char"]

    float32, int8 = score(torch.float32), score("int8")
    print(f"nats/char on the validation split: float32 {float32:.6f}, int8 {int8:.6f}")
    assert float32 < 1.42  # the shipped model
    assert abs(int8 - float32) <= 0.01


@pytest.mark.parametrize("quantization", ["int8", "q4_0"])
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
