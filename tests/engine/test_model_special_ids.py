"""The engine takes its special ids and sizes from the model and the engine config, not from our
tokenizers' constants (pad 0, unk 1, bos 2, eos 3): tiny random models with other ids (a
Marian-like translator: pad 63 = decoder start, eos 0, pad never generated; a generator with bos 7,
eos 9) decode in the engine as the plain reference paths decode them."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import service.engine.runner as runner_module
from decoding.reference_decoding import beam_search_uncached, generate_greedy_uncached, greedy_translate_uncached
from decoding.sampling_params import GREEDY, SamplingParams
from decoding.translate import pad_batch
from loading.checkpoint import DEFAULT_GENERATOR
from model.config import GeneratorConfig, TranslatorConfig
from model.generator import Generator
from model.packed_linear import pack_linear_layers, packing_available
from model.quantize import quantize_weights
from model.translator import Translator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.errors import InvalidRequestError
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner, TranslatorRunner, beam_group
from tests.engine.helpers import deltas_of

MARIAN_LIKE: dict[str, Any] = {"pad_id": 63, "decoder_start_id": 63, "eos_id": 0, "bos_id": 5, "suppressed_ids": (63,)}
NEOX_LIKE: dict[str, Any] = {"pad_id": 11, "bos_id": 7, "eos_id": 9, "suppressed_ids": (11,)}
SOURCES = [[12, 9, 13, 7, 0], [40, 0], [8, 8, 8, 8, 8, 8, 0], [21, 33, 0], [17, 44, 52, 0]]  # each ends with eos 0
PROMPTS = [[12, 13, 14], [7], [40, 41, 42, 43, 44], [20], [33, 8]]
OUR_EOS = 3  # loading/tokenizer.py's EOS_ID: an ordinary token for these models


class FakeTokenizer:
    """A TextTokenizer over "w<i>" words; the given special ids have no text."""

    def __init__(self, special: set[int]) -> None:
        self.special = special

    @property
    def vocab_size(self) -> int:
        return 64

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece_bytes(i).decode() for i in ids)

    def piece_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in self.special else f"w{token_id} ".encode()


def tokenizer_for(model: Translator | Generator) -> FakeTokenizer:
    c = model.config
    return FakeTokenizer({c.pad_id, c.bos_id, c.eos_id})


def translator(**changes: Any) -> Translator:
    """The tiny translator with Marian's ids, an untied output projection and a logits bias (random,
    eos raised so that some sentences end before their limit and some do not)."""
    torch.manual_seed(2)
    config = dataclasses.replace(
        TranslatorConfig.preset("tiny"), **(MARIAN_LIKE | {"logits_bias": True, "tie_embeddings": False} | changes)
    )
    model = Translator(config).eval()
    assert model.logits_bias is not None
    model.logits_bias.copy_(torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.5)
    model.logits_bias[config.eos_id] = 1.0
    return model


def generator(**changes: Any) -> Generator:
    """The tiny generator with bos 7, eos 9, pad 11 (suppressed) and an untied output projection;
    weights drawn wide enough that it does not just repeat its last token."""
    torch.manual_seed(4)
    config = dataclasses.replace(GeneratorConfig.preset("tiny"), **(NEOX_LIKE | {"tie_embeddings": False} | changes))
    model = Generator(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def favour(model: Translator | Generator, token: int, amount: float = 100.0) -> Callable[[], None]:
    """Adds amount to token's logit at every output of the model (a translator's decode, a
    generator's forward and its projection of a ragged step's rows); returns the undo."""
    bias = torch.zeros(model.config.vocab_size)
    bias[token] = amount
    names = ["logits"] if isinstance(model, Generator) else ["decode"]
    handle = model.register_forward_hook(lambda module, args, logits: logits + bias) if isinstance(model, Generator) else None
    for name in names:
        original = getattr(model, name)

        def biased(*args: object, original: Callable[..., Tensor] = original, **kwargs: object) -> Tensor:
            return original(*args, **kwargs) + bias

        setattr(model, name, biased)

    def undo() -> None:
        for name in names:
            delattr(model, name)
        if handle is not None:
            handle.remove()

    return undo


@dataclass
class Final:
    tokens: list[int]  # streamed tokens; a beam search's best hypothesis
    reason: str | None
    text: str  # all of it: a streamed request's deltas joined
    alternatives: list[str] | None


def drive(engine: Engine, arrivals: dict[int, list[Request]], max_steps: int = 300) -> dict[str, Final]:
    """Adds requests at the given steps and steps until idle; each request's outcome."""
    requests = {r.request_id: r for rs in arrivals.values() for r in rs}
    finals: dict[str, Final] = {}
    for request_id, deltas in deltas_of(engine, arrivals, max_steps).items():
        r, last = requests[request_id], deltas[-1]
        tokens = r.output_ids if r.params.beam_size > 1 else [t for d in deltas for t in d.token_ids]
        finals[request_id] = Final(tokens, last.finish_reason, "".join(d.text for d in deltas), last.alternatives)
    assert all(f.reason is not None for f in finals.values()) and not engine.has_work
    return finals


def translator_engine(model: Translator, n_slots: int = 16, max_context: int | None = None, fixed_shape: bool | None = None) -> Engine:
    runner = TranslatorRunner(model, tokenizer_for(model), n_slots, max_context, fixed_shape_decode=fixed_shape)
    return Engine(runner, EngineConfig(n_slots=n_slots, max_context=max_context))


def generator_engine(model: Generator, fixed_shape: bool = False, n_slots: int = 8, max_context: int | None = None) -> Engine:
    config = EngineConfig(n_slots=n_slots, max_context=max_context)
    return Engine(GeneratorRunner(model, tokenizer_for(model), config, fixed_shape_decode=fixed_shape), config)


def greedy(n: int) -> GenerationParams:
    return GenerationParams(sampling=GREEDY, max_tokens=n)


def beams(n: int, k: int = 4, n_best: int = 2) -> GenerationParams:
    return GenerationParams(sampling=GREEDY, max_tokens=n, beam_size=k, n_best=n_best)


def assert_translations_equal_the_references(model: Translator, finals: dict[str, Final], n: int) -> None:
    """g<i>: greedy, equal to recomputation; b<i>: beam 4, equal to the beam search by recomputation."""
    tokenizer, device = tokenizer_for(model), next(model.parameters()).device
    for i, s in enumerate(SOURCES):
        expected = greedy_translate_uncached(model, torch.tensor([s], device=device), n)[0]
        assert finals[f"g{i}"].tokens == expected
        assert finals[f"g{i}"].reason == ("stop" if len(expected) < n else "length")
        hypotheses = beam_search_uncached(model, torch.tensor([s], device=device), beam_size=4, max_new_tokens=n, n_best=2)[0]
        assert finals[f"b{i}"].tokens == hypotheses[0].tokens
        assert finals[f"b{i}"].alternatives == [tokenizer.decode(hypotheses[1].tokens)]


def translation_arrivals(n: int) -> dict[int, list[Request]]:
    """Greedy and beam-4 requests for every source, joining at steps 0 and 3."""
    requests = [Request(f"g{i}", s, greedy(n)) for i, s in enumerate(SOURCES)]
    requests += [Request(f"b{i}", s, beams(n)) for i, s in enumerate(SOURCES)]
    return {0: requests[:4], 3: requests[4:]}


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_translator_engine_decodes_with_the_models_start_eos_and_pad(fixed_shape: bool, device: str) -> None:
    """Greedy and beam search, batched (sources padded with 63), equal the plain paths alone; eos 0
    ends some sentences before their limit. (On CUDA through the runner's CUDA graphs.)"""
    model = translator().to(device)
    finals = drive(translator_engine(model, fixed_shape=fixed_shape), translation_arrivals(12))
    assert_translations_equal_the_references(model, finals, 12)
    assert {finals[f"g{i}"].reason for i in range(len(SOURCES))} == {"stop", "length"}
    padded = pad_batch(SOURCES, model.config.pad_id).to(device)  # (5, 7) right-padded with 63
    assert greedy_translate_uncached(model, padded, 12) == [finals[f"g{i}"].tokens for i in range(len(SOURCES))]


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_generator_engine_decodes_with_the_models_eos_and_starts_an_empty_prompt_from_bos(fixed_shape: bool, device: str) -> None:
    model = generator().to(device)
    engine = generator_engine(model, fixed_shape)
    assert engine.runner.encode_prompt("") == [7]
    prompts = [*PROMPTS, engine.runner.encode_prompt("")]
    finals = drive(
        engine,
        {
            0: [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts[:3])],
            2: [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts[3:], 3)],
        },
    )
    for i, p in enumerate(prompts):
        reference = generate_greedy_uncached(model, p, 12)
        expected = reference[: reference.index(9)] if 9 in reference else reference
        assert finals[f"r{i}"].tokens == expected
        assert finals[f"r{i}"].reason == ("stop" if 9 in reference else "length")
    assert {f.reason for f in finals.values()} == {"stop", "length"}


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_the_suppressed_pad_is_never_generated_by_the_translator_even_when_it_would_win(fixed_shape: bool) -> None:
    model, unsuppressed = translator(), translator(suppressed_ids=())
    favour(model, 63)
    favour(unsuppressed, 63)
    assert all(t == 63 for t in greedy_translate_uncached(unsuppressed, torch.tensor([SOURCES[0]]), 5)[0])  # pad would win
    sampled = GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=1))
    arrivals = translation_arrivals(12)
    arrivals[5] = [Request(f"s{i}", s, sampled) for i, s in enumerate(SOURCES)]
    finals = drive(translator_engine(model, fixed_shape=fixed_shape), arrivals)
    assert all(63 not in f.tokens for f in finals.values())
    assert_translations_equal_the_references(model, finals, 12)  # the runner-up, as the plain paths take it


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_the_suppressed_pad_is_never_generated_by_the_generator_even_when_it_would_win(fixed_shape: bool) -> None:
    """Neither the prefill's first token nor the decode steps' (dynamic or fixed-shape), greedy or sampled."""
    model = generator()
    favour(model, 11)
    sampled = GenerationParams(max_tokens=10, sampling=SamplingParams(temperature=1.0, seed=3))
    requests = [Request(f"g{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)] + [
        Request(f"s{i}", p, sampled) for i, p in enumerate(PROMPTS)
    ]
    finals = drive(generator_engine(model, fixed_shape), {0: requests[:5], 1: requests[5:]})
    assert all(len(f.tokens) > 0 and 11 not in f.tokens for f in finals.values())
    for i, p in enumerate(PROMPTS):
        reference = generate_greedy_uncached(model, p, 10)
        assert 11 not in reference
        assert finals[f"g{i}"].tokens == (reference[: reference.index(9)] if 9 in reference else reference)


def test_the_models_eos_ends_a_sequence_and_ours_is_an_ordinary_token() -> None:
    gen = generator()
    undo = favour(gen, OUR_EOS)
    assert drive(generator_engine(gen), {0: [Request("r", [12, 13], greedy(6))]})["r"] == Final([OUR_EOS] * 6, "length", "w3 " * 6, None)
    undo()
    favour(gen, 9)
    assert drive(generator_engine(gen), {0: [Request("r", [12, 13], greedy(6))]})["r"] == Final([], "stop", "", None)

    model = translator()
    undo = favour(model, OUR_EOS)
    finals = drive(translator_engine(model), {0: [Request("g", SOURCES[0], greedy(6)), Request("b", SOURCES[0], beams(6))]})
    assert finals["g"].tokens == finals["b"].tokens == [OUR_EOS] * 6 and finals["g"].reason == finals["b"].reason == "length"
    undo()
    favour(model, 0)
    finals = drive(translator_engine(model), {0: [Request("g", SOURCES[0], greedy(6)), Request("b", SOURCES[0], beams(6))]})
    assert finals["g"] == Final([], "stop", "", None)
    assert finals["b"].tokens == [] and finals["b"].reason == "stop"


def test_the_context_limit_sizes_the_caches_and_refuses_longer_prompts() -> None:
    gen, model = generator(), translator()  # both of 64 positions
    for make in (lambda m: generator_engine(gen, max_context=m).runner, lambda m: translator_engine(model, max_context=m).runner):
        assert make(48).kv_cache_bytes > make(16).kv_cache_bytes  # rows (translator) or the default pool (n_slots contexts)
        assert make(None).max_len == 64 and make(None).kv_cache_bytes == make(64).kv_cache_bytes  # the default: the model's positions
        with pytest.raises(ValueError, match="max_context"):
            make(65)

    engine = generator_engine(gen, max_context=16)
    engine.add_request(Request("fits", list(range(20, 35)), greedy(1)))  # 15 tokens and one generated
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 16 tokens\. However, your request has 16 input tokens"):
        engine.add_request(Request("long", list(range(20, 36)), greedy(1)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(Request("too many", list(range(20, 35)), greedy(2)))
    full = drive(generator_engine(gen, max_context=16), {0: [Request("r", [20], GenerationParams(sampling=GREEDY))]})["r"]
    assert full.tokens == generate_greedy_uncached(gen, [20], 15)  # to the end of the cache, no eos on the way

    engine = translator_engine(model, max_context=16)
    engine.add_request(Request("fits", [*range(20, 35), 0], greedy(15)))  # 16 source tokens, 15 target tokens
    with pytest.raises(InvalidRequestError, match=r"17 input tokens \(at most 16\)"):
        engine.add_request(Request("long", [*range(20, 36), 0], greedy(1)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(Request("too many", [20, 0], greedy(16)))

    with pytest.raises(ValueError, match="max_context"):
        EngineConfig(max_context=1)
    long = generator(max_len=2048)  # as a GPT-NeoX folder's max_position_embeddings
    assert generator_engine(long, n_slots=1).runner.max_prompt_len == 2047  # the whole context by default
    assert generator_engine(long, n_slots=1, max_context=1024).runner.max_prompt_len == 1023  # asked for
    served = Engine.from_checkpoint(DEFAULT_GENERATOR, EngineConfig(n_slots=2, max_context=32))
    assert served.runner.max_prompt_len == 31 and served.max_tokens_limit(10) == 22


def assert_logits_close(fast: nn.Module, plain: nn.Module, inputs: tuple[Tensor, ...], tolerance: float) -> None:
    """fast's logits within tolerance x the largest magnitude of plain's (a dropped bias or a wrong
    output projection is far outside)."""
    with torch.inference_mode():
        expected = plain(*inputs)
        assert (fast(*inputs) - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize(
    "fast_path",
    [pytest.param("packed", marks=pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")), "int8"],
)
def test_packed_and_int8_models_keep_the_untied_head_and_logits_bias_in_the_engine(fast_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast paths convert the untied output projection and keep the logits bias: their logits
    stay close to float32's, and the engine's greedy, grouped beam (each sentence's 4 rows reading
    its source once) and fixed-shape steps with them equal the plain paths on the same converted model."""
    convert = pack_linear_layers if fast_path == "packed" else quantize_weights
    tolerance = 1e-5 if fast_path == "packed" else 0.05  # int8: measured 0.016 (translator) and 0.031
    plain, fast = translator(), translator()
    convert(fast)
    assert_logits_close(fast, plain, (pad_batch(SOURCES, 63), torch.tensor([[63, 12, 13, 14]] * len(SOURCES))), tolerance)
    groups: list[int] = []

    def recorded(slots_of_requests: list[list[int]], rows: list[int]) -> int:
        groups.append(beam_group(slots_of_requests, rows))
        return groups[-1]

    monkeypatch.setattr(runner_module, "beam_group", recorded)
    arrivals = translation_arrivals(10)
    finals = drive(translator_engine(fast), {0: [r for r in arrivals[0] + arrivals[3] if r.params.beam_size == 1]})
    beams = translator_engine(fast)
    assert isinstance(beams.runner, TranslatorRunner)
    beams.runner.cross_cache.decode_kernel = False  # the grouped read (the CPU kernel reads each row's source in place)
    finals |= drive(beams, {0: [r for r in arrivals[0] + arrivals[3] if r.params.beam_size > 1]})
    assert_translations_equal_the_references(fast, finals, 10)
    assert 4 in groups

    plain_gen, fast_gen = generator(), generator()
    convert(fast_gen)
    assert_logits_close(fast_gen, plain_gen, (torch.tensor(PROMPTS[2:3]),), tolerance)
    for fixed_shape in (False, True):
        finals = drive(generator_engine(fast_gen, fixed_shape), {0: [Request(f"r{i}", p, greedy(10)) for i, p in enumerate(PROMPTS)]})
        for i, p in enumerate(PROMPTS):
            reference = generate_greedy_uncached(fast_gen, p, 10)
            assert finals[f"r{i}"].tokens == (reference[: reference.index(9)] if 9 in reference else reference)
