"""On the shipped checkpoints: the engine's KV-cached, batched greedy decoding equals full
recomputation token for token, for both models, with float32 weights and with int8 weights
(model/quantize.py: the int8 engine computes what the same int8 model computes alone).

"Equals" allows one thing: the two paths sum in different orders, so their logits differ by
float rounding (float32: under 1e-5), which int8 amplifies where it rounds an activation to
another integer (measured: up to 0.033 in a chosen token's logprob over 480 steps). Where the
recomputation's top two logits are closer than that, the paths may pick different tokens (seen
on an AVX2-only CPU: 8.5551 against 8.5507) and continue differently. So the sequences must be
equal up to their first difference, and there the recomputed logits of the two choices must be
within TIE of each other."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from decoding.reference_decoding import beam_search_uncached, generate_greedy_uncached, greedy_translate_uncached
from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_checkpoint
from model.generator import Generator
from model.masks import padding_mask
from model.translator import Translator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from tests.engine.helpers import assert_equal_up_to_a_tie, run
from training.data import SHARED_DATA, pad, read_lines

WEIGHTS: list[WeightType] = [torch.float32, "int8"]
TIE: dict[WeightType, float] = {torch.float32: 1e-4, "int8": 0.1}  # logits closer than this are a tie


def on_device(device: str, weights: WeightType) -> str:
    """device, or a skip: int8 weights run on the CPU only (model/quantize.py)."""
    if weights == "int8" and device != "cpu":
        pytest.skip("int8 weights run on the CPU only")
    return device


def generator_logits(model: Generator, prompt: list[int]) -> Callable[[list[int]], Tensor]:
    """The recomputed next-token logits (V,) after prompt + a generated prefix."""

    @torch.no_grad()
    def logits_after(prefix: list[int]) -> Tensor:
        return model(torch.tensor([prompt + prefix], device=next(model.parameters()).device))[0, -1]

    return logits_after


def translator_logits(model: Translator, src: Tensor) -> Callable[[list[int]], Tensor]:
    """The recomputed next-token logits (V,) for one source src (1, S) after a target prefix."""

    @torch.no_grad()
    def logits_after(prefix: list[int]) -> Tensor:
        tgt = torch.tensor([[model.config.start_id, *prefix]], device=src.device)  # (1, T)
        memory_kv = model.cross_key_values(model.encode(src))
        return model.decode(tgt, memory_kv, padding_mask(src, model.config.pad_id))[0, -1]

    return logits_after


@pytest.mark.parametrize("weights", WEIGHTS)
def test_generator_engine_equals_recomputation_on_the_shipped_checkpoint(weights: WeightType, device: str) -> None:
    engine = Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=4), on_device(device, weights), weights)
    prompts = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "KING"]
    requests = [
        Request(f"g{i}", engine.runner.encode_prompt(p), GenerationParams(sampling=GREEDY, max_tokens=30 + 10 * i))
        for i, p in enumerate(prompts)
    ]
    batched = run(engine, {0: requests[:1], 2: requests[1:]})
    model = engine.runner.model  # type: ignore[attr-defined]
    for r in requests:
        expected = generate_greedy_uncached(model, r.prompt_ids, r.params.max_tokens)
        assert_equal_up_to_a_tie(batched[r.request_id], expected, generator_logits(model, r.prompt_ids), TIE[weights])


def test_idle_rows_in_the_decode_span_leave_outputs_unchanged(device: str) -> None:
    # Slots 0-5 fill; 1-4 finish early, so 0 and 5 decode alone (rows gathered: span 6 > 2 x 2).
    # g6 joins slot 1, so rows 0-5 decode as one span with idle rows 2-4 feeding pad tokens; g7 is
    # prefilled into row 2 in a step whose decode span still runs row 2 as idle.
    engine = Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=8), device)
    lengths = [30, 2, 2, 2, 2, 30, 12, 12]
    prompts = ["ROMEO:\n", "A", "B", "C", "D", "JULIET:\nO Romeo", "KING HENRY:\n", "First Citizen:\nWe are"]
    requests = [
        Request(f"g{i}", engine.runner.encode_prompt(p), GenerationParams(sampling=GREEDY, max_tokens=n))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    batched = run(engine, {0: requests[:6], 6: requests[6:7], 9: requests[7:]})
    model = engine.runner.model  # type: ignore[attr-defined]
    for r in requests:
        expected = generate_greedy_uncached(model, r.prompt_ids, r.params.max_tokens)
        assert_equal_up_to_a_tie(batched[r.request_id], expected, generator_logits(model, r.prompt_ids), TIE[torch.float32])
    assert engine.scheduler.slots.num_free == 8


@pytest.mark.parametrize("weights", WEIGHTS)
def test_translator_engine_equals_recomputation_on_the_shipped_checkpoint(weights: WeightType, device: str) -> None:
    sentences = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")[:8]
    engine = Engine.from_checkpoint(DEFAULT_TRANSLATOR, EngineConfig(n_slots=8), on_device(device, weights), weights)
    requests = [
        Request(f"t{i}", engine.runner.encode_prompt(s), GenerationParams(sampling=GREEDY, max_tokens=40)) for i, s in enumerate(sentences)
    ]
    batched = run(engine, {0: requests[:4], 3: requests[4:]})
    model = engine.runner.model  # type: ignore[attr-defined]
    src = pad([r.prompt_ids for r in requests]).to(device)
    expected = greedy_translate_uncached(model, src, 40)
    beam_1 = [h[0].tokens for h in beam_search_uncached(model, src, beam_size=1, max_new_tokens=40)]  # the beams' bookkeeping, at width 1
    eos = [model.config.eos_id]
    for k, r in enumerate(requests):
        logits_after = translator_logits(model, src[k : k + 1])
        for got in (batched[r.request_id], beam_1[k]):
            assert_equal_up_to_a_tie(got + eos, expected[k] + eos, logits_after, TIE[weights])


def test_shipped_checkpoints_load_without_unpickling() -> None:
    for checkpoint in (DEFAULT_GENERATOR, DEFAULT_TRANSLATOR):
        model, _ = load_checkpoint(checkpoint)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert {f.name for f in checkpoint.iterdir()} == {"config.json", "model.safetensors", "tokenizer.model", "training.json"}
