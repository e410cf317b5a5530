"""The offline front (service/engine/offline.py), what training.evaluate, training's validation
and the exports' checks decode with: the engine's outputs in input order, equal to the plain paths
by recomputation, and independent of the other prompts of a call and of the number of slots."""

import pytest
import torch

from decoding.reference_decoding import beam_search_uncached, generate_greedy_uncached, greedy_translate_uncached
from decoding.sampling_params import GREEDY
from decoding.translate import pad_batch
from loading.checkpoint import DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import EOS_ID
from model.config import TranslatorConfig
from model.translator import Translator
from service.engine.errors import InvalidRequestError
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from tests.engine.helpers import PROMPTS, FakeTokenizer, context_sensitive_generator
from training.data import SHARED_DATA, read_lines

SOURCES = [[5, 9, 13, 7, 22, 30, 41], [40, 12, 6, 50, 8], [8, 8, 8, 8, 8, 8, 9], [21, 33, 60, 4]]  # no eos: any ids will do


def tiny_translator(positions: str) -> Translator:
    torch.manual_seed(2)
    config = TranslatorConfig.preset("tiny")
    return Translator(TranslatorConfig.from_dict({**config.to_dict(), "positions": positions})).eval()


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi"])
def test_translator_greedy_equals_recomputation_in_input_order(positions: str) -> None:
    """Fewer slots than sentences: they join as others leave; each output is the padded batch's by recomputation."""
    model = tiny_translator(positions)
    outputs = OfflineEngine(model, FakeTokenizer(), n_slots=3).generate(SOURCES, GenerationParams(sampling=GREEDY, max_tokens=20))  # type: ignore[arg-type]
    expected = greedy_translate_uncached(model, pad_batch(SOURCES, model.config.pad_id), 20)
    assert [o.token_ids for o in outputs] == expected
    assert [o.texts for o in outputs] == [[FakeTokenizer().decode(e).lstrip()] for e in expected]
    assert [o.finish_reason for o in outputs] == ["stop" if len(e) < 20 else "length" for e in expected]


def test_translator_beam_search_equals_recomputation_with_its_n_best() -> None:
    model = tiny_translator("sinusoidal")
    params = GenerationParams(sampling=GREEDY, max_tokens=15, beam_size=4, n_best=3)
    outputs = OfflineEngine(model, FakeTokenizer(), n_slots=8).generate(SOURCES, params)  # type: ignore[arg-type]
    for source, output in zip(SOURCES, outputs, strict=True):
        hypotheses = beam_search_uncached(model, torch.tensor([source]), beam_size=4, max_new_tokens=15, n_best=3)[0]
        assert output.token_ids == hypotheses[0].tokens
        assert output.texts == [FakeTokenizer().decode(h.tokens) for h in hypotheses]


def test_generator_greedy_equals_recomputation() -> None:
    model = context_sensitive_generator()
    outputs = OfflineEngine(model, FakeTokenizer(), n_slots=2).generate(PROMPTS, GenerationParams(sampling=GREEDY, max_tokens=12))  # type: ignore[arg-type]
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = generate_greedy_uncached(model, prompt, 12)
        assert output.token_ids == (expected[: expected.index(EOS_ID)] if EOS_ID in expected else expected)


def test_shipped_translator_outputs_do_not_depend_on_the_other_sentences_or_the_slots() -> None:
    """Greedy and beam-4 requests of test_2016 sentences, all together in 64 slots, in 6 (joining
    as others leave), and each sentence alone: the same tokens and texts every way."""
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    sentences = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")[:16]
    params = [GenerationParams(sampling=GREEDY, beam_size=4 if i % 2 else 1, n_best=2 if i % 2 else 1) for i in range(len(sentences))]
    together = OfflineEngine(model, tokenizer, n_slots=64).generate(sentences, params)
    assert OfflineEngine(model, tokenizer, n_slots=6).generate(sentences, params) == together
    engine = OfflineEngine(model, tokenizer, n_slots=4)
    assert [engine.generate([s], p)[0] for s, p in zip(sentences, params, strict=True)] == together
    assert together[0].texts == [tokenizer.decode(together[0].token_ids)] and len(together[1].texts) == 2
    by_ids = engine.generate([tokenizer.encode(sentences[0]) + [model.config.eos_id]], params[0])  # a text is encoded with eos
    assert by_ids == together[:1]


def test_a_refused_request_raises_before_anything_is_decoded() -> None:
    engine = OfflineEngine(tiny_translator("sinusoidal"), FakeTokenizer(), n_slots=4)  # type: ignore[arg-type]
    assert engine.generate([]) == []
    too_many = GenerationParams(sampling=GREEDY, max_tokens=10**6)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.generate(SOURCES, [GenerationParams(sampling=GREEDY), too_many, GenerationParams(), GenerationParams()])
