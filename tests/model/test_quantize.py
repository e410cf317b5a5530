"""The int8 path (model/quantize.py): close to float32 layer by layer, independent of the batch
row by row, and within its quality bounds on the shipped checkpoints: the translator's greedy
test_2016 BLEU within 0.3 of float32's, the generator's nats/char on its validation split within 0.01."""

from pathlib import Path

import pytest
import torch
from sacrebleu.metrics.bleu import BLEU
from torch import nn

from model.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_checkpoint
from model.data import SHARED_DATA, read_lines, split_shakespeare
from model.generator import Generator
from model.lm_scoring import nats_per_char
from model.quantize import Int8Linear
from model.translate import translate_sentences
from model.translator import Translator


def test_int8_linear_is_close_to_the_float_layer() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 1024)
    x = torch.randn(5, 7, 256)
    expected, got = linear(x), Int8Linear.from_linear(linear)(x)
    assert got.shape == expected.shape == (5, 7, 1024)
    relative_error = (got - expected).norm() / expected.norm()
    assert 0 < relative_error < 0.02  # rounded, not copied


def test_a_rows_output_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 32))
    rows = torch.randn(6, 64)
    rows[3] *= 100  # one row far larger than the rest: a shared scale would crush the others
    batched = layer(rows)
    for i in range(6):
        assert torch.equal(layer(rows[i : i + 1])[0], batched[i])


def test_quantize_replaces_every_linear_layer_and_the_output_projection() -> None:
    model, _ = load_checkpoint(DEFAULT_TRANSLATOR, "cpu", "int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.output_projection, Int8Linear)
    assert model.embed.weight.dtype == torch.float32


def _bleu(weights: WeightType, sentences: list[str], references: list[str]) -> float:
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR, "cpu", weights)
    assert isinstance(model, Translator)
    hypotheses = [h[0] for h in translate_sentences(model, tokenizer, sentences, beam_size=1, length_penalty=1.0, batch_size=64)]
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
