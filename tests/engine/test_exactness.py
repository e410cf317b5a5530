"""The engine with real (small, randomly initialised) models computes what the plain paths compute:
batched, joining and leaving at different steps, equals alone; equals recomputation."""

import pytest
import torch

import service.engine.runner as runner_module
from decoding.reference_decoding import beam_search_uncached, generate_greedy_uncached, greedy_translate_uncached
from decoding.sampling_params import GREEDY, SamplingParams
from loading.tokenizer import EOS_ID
from model.config import TranslatorConfig
from model.kv_cache import CrossAttentionCache, cache_rows
from model.translator import Translator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner, TranslatorRunner, beam_group, decode_rows
from service.engine.scheduler import SchedulerOutput
from tests.engine.helpers import PROMPTS, FakeTokenizer, context_sensitive_generator, deltas_of, run


def generator_engine(n_slots: int = 8, device: str = "cpu") -> Engine:
    """On CUDA the runner decodes through its CUDA graphs (its default there)."""
    model = context_sensitive_generator(device)
    config = EngineConfig(n_slots=n_slots)
    return Engine(GeneratorRunner(model, FakeTokenizer(), config), config)  # type: ignore[arg-type]


def translator_engine(n_slots: int = 16, device: str = "cpu", fixed_shape_decode: bool | None = None) -> Engine:
    torch.manual_seed(2)
    model = Translator(TranslatorConfig.preset("tiny")).eval().to(device)
    runner = TranslatorRunner(model, FakeTokenizer(), n_slots, fixed_shape_decode=fixed_shape_decode)  # type: ignore[arg-type]
    return Engine(runner, EngineConfig(n_slots=n_slots))


def test_generator_batched_with_joins_and_leaves_equals_alone_and_recomputation(device: str) -> None:
    lengths = [12, 5, 20, 3, 9]

    def requests() -> list[Request]:
        return [
            Request(f"r{i}", p, GenerationParams(sampling=GREEDY, max_tokens=n))
            for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
        ]

    batched = run(generator_engine(device=device), {0: requests()[:2], 2: requests()[2:4], 7: requests()[4:]})
    for i, r in enumerate(requests()):
        alone = run(generator_engine(device=device), {0: [r]})
        assert batched[r.request_id] == alone[r.request_id]
        reference = generate_greedy_uncached(context_sensitive_generator(device), PROMPTS[i], lengths[i])
        expected = reference[: reference.index(EOS_ID)] if EOS_ID in reference else reference
        assert batched[r.request_id] == expected


def test_seeded_sampling_gives_the_same_tokens_alone_or_batched() -> None:
    params = GenerationParams(max_tokens=15, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=42))
    alone = run(generator_engine(), {0: [Request("s", [5, 6], params)]})
    others = [Request(f"o{i}", p, GenerationParams(max_tokens=10, sampling=SamplingParams(temperature=1.0))) for i, p in enumerate(PROMPTS)]
    batched = run(generator_engine(), {0: others[:3], 1: [Request("s", [5, 6], params)], 3: others[3:]})
    assert alone["s"] == batched["s"] and len(alone["s"]) > 0


def test_abort_mid_batch_leaves_the_others_unchanged_and_frees_the_slot() -> None:
    requests = lambda: [Request(f"r{i}", p, GenerationParams(sampling=GREEDY, max_tokens=10)) for i, p in enumerate(PROMPTS[:3])]  # noqa: E731
    expected = run(generator_engine(), {0: requests()})
    engine = generator_engine()
    for r in requests():
        engine.add_request(r)
    got: dict[str, list[int]] = {}
    for step in range(40):
        if step == 3:
            engine.abort("r1")
        for d in engine.step().deltas:
            got.setdefault(d.request_id, []).extend(d.token_ids)
    assert got["r0"] == expected["r0"] and got["r2"] == expected["r2"]
    assert len(got["r1"]) == 3
    assert engine.scheduler.slots.num_free == 8 and not engine.has_work


@pytest.mark.parametrize("ragged_encode", [True, False])
def test_translator_engine_greedy_equals_greedy_by_recomputation_while_requests_come_and_go(device: str, ragged_encode: bool) -> None:
    """New sources of different lengths encoded together, side by side (ragged) or padded, then
    decoded with others joining: each translation is the greedy one by recomputation of its sentence alone."""
    sources = [[5, 9, 13, 7, EOS_ID], [40, EOS_ID], [8, 8, 8, 8, 8, 8, EOS_ID], [21, 33, EOS_ID]]
    requests = [Request(f"t{i}", s, GenerationParams(sampling=GREEDY, max_tokens=12)) for i, s in enumerate(sources)]
    engine = translator_engine(device=device)
    assert isinstance(engine.runner, TranslatorRunner)
    engine.runner.ragged_encode = ragged_encode
    batched = run(engine, {0: requests[:2], 3: requests[2:]})
    model = engine.runner.model  # type: ignore[attr-defined]
    for i, s in enumerate(sources):
        assert batched[f"t{i}"] == greedy_translate_uncached(model, torch.tensor([s], device=device), 12)[0]


@pytest.mark.parametrize("encoded_ahead_tokens", [1024, 0])
def test_sources_encoded_ahead_translate_as_alone(device: str, encoded_ahead_tokens: int) -> None:
    """More requests than slots: the waiting ones' sources are encoded with the first step's and
    kept until their admission (or, with none kept, each at its own), and every translation is
    the greedy one by recomputation of its sentence alone; once the queue is empty nothing is kept."""
    sources = [[5, 9, 13, 7, EOS_ID], [40, EOS_ID], [8, 8, 8, 8, 8, 8, EOS_ID], [21, 33, EOS_ID], [6, 7, EOS_ID], [50, 2, 9, EOS_ID]]
    requests = [Request(f"t{i}", s, GenerationParams(sampling=GREEDY, max_tokens=12)) for i, s in enumerate(sources)]
    engine = translator_engine(n_slots=2, device=device)
    runner = engine.runner
    assert isinstance(runner, TranslatorRunner)
    runner.encoded_ahead_tokens = encoded_ahead_tokens
    encoded: list[int] = []
    encode_ragged = runner.model.encode_ragged
    runner.model.encode_ragged = lambda ids, lengths: encoded.append(len(lengths)) or encode_ragged(ids, lengths)  # type: ignore[method-assign]
    batched = run(engine, {0: requests})
    for i, s in enumerate(sources):
        assert batched[f"t{i}"] == greedy_translate_uncached(runner.model, torch.tensor([s], device=device), 12)[0]
    assert sum(encoded) == len(sources)  # each source encoded once
    assert len(encoded) == 1 if encoded_ahead_tokens else len(encoded) > 1  # all in the first step's batch, or each at its admission
    assert not runner.encoded_ahead


def test_a_source_encoded_ahead_of_a_request_that_ends_waiting_is_dropped() -> None:
    engine = translator_engine(n_slots=1)
    runner = engine.runner
    assert isinstance(runner, TranslatorRunner)
    for i, source in enumerate([[5, 9, EOS_ID], [40, EOS_ID], [8, 8, EOS_ID]]):
        engine.add_request(Request(f"t{i}", source, GenerationParams(sampling=GREEDY, max_tokens=4)))
    engine.step()  # t0 admitted: t1 and t2 encoded ahead
    assert set(runner.encoded_ahead) == {"t1", "t2"}
    engine.abort("t1")
    while engine.has_work:
        engine.step()
    assert not runner.encoded_ahead  # t2's taken at its admission, t1's dropped there


def test_translator_engine_beam_search_equals_the_beam_search_by_recomputation(device: str) -> None:
    sources = [[5, 9, 13, 7, EOS_ID], [40, 41, EOS_ID], [8, 8, 8, EOS_ID]]
    engine = translator_engine(device=device)
    finals = {}
    arrivals = {
        0: [Request("b0", sources[0], GenerationParams(sampling=GREEDY, max_tokens=10, beam_size=4, n_best=2))],
        2: [
            Request("g", sources[1], GenerationParams(sampling=GREEDY, max_tokens=10)),
            Request("b2", sources[2], GenerationParams(sampling=GREEDY, max_tokens=10, beam_size=3)),
        ],
    }
    for step in range(60):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        for d in engine.step().deltas:
            if d.finish_reason is not None:
                finals[d.request_id] = d
    model = engine.runner.model  # type: ignore[attr-defined]
    expected = beam_search_uncached(model, torch.tensor([sources[0]], device=device), beam_size=4, max_new_tokens=10, n_best=2)[0]
    tokenizer = FakeTokenizer()
    assert finals["b0"].text == tokenizer.decode(expected[0].tokens)
    assert finals["b0"].alternatives == [tokenizer.decode(expected[1].tokens)]
    expected2 = beam_search_uncached(model, torch.tensor([sources[2]], device=device), beam_size=3, max_new_tokens=10)[0]
    assert finals["b2"].text == tokenizer.decode(expected2[0].tokens)
    assert engine.scheduler.slots.num_free == 16


def test_a_beam_searchs_first_step_feeds_its_first_beam_only() -> None:
    """Every beam starts from the start token and only the first is expanded: one row at the first
    step, every beam's after; the search still equals the one by recomputation."""
    engine = translator_engine()
    runner = engine.runner
    assert isinstance(runner, TranslatorRunner)
    fed_rows: list[int] = []
    step_logits = runner.step_logits
    runner.step_logits = lambda fed, *args: fed_rows.append(len(fed)) or step_logits(fed, *args)  # type: ignore[method-assign]
    source = [5, 9, 13, 7, EOS_ID]
    deltas = deltas_of(engine, {0: [Request("b", source, GenerationParams(max_tokens=10, beam_size=4))]})["b"]
    finals = [d for d in deltas if d.finish_reason]
    assert fed_rows[0] == 1 and set(fed_rows[1:]) == {4}
    expected = beam_search_uncached(runner.model, torch.tensor([source]), beam_size=4, max_new_tokens=10)[0]
    assert finals[0].text == FakeTokenizer().decode(expected[0].tokens)
    assert engine.scheduler.slots.num_free == 16 and engine.blocks is not None and engine.blocks.num_free == engine.blocks.num_blocks - 1


def test_a_beam_searchs_forks_are_copied_by_the_next_step_unless_it_ended() -> None:
    """After a beam search's first step every beam continues the first: the scheduler forks the
    rows, and the next plan carries the copies of the first row's last block for the 3 others (the
    runner makes them before the step writes a key). A request ended in between takes its copies
    with it: the next plan copies nothing into its freed blocks."""
    params = GenerationParams(max_tokens=10, beam_size=4)
    engine = translator_engine()
    plans: list[SchedulerOutput] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)  # type: ignore[method-assign]
    engine.add_request(Request("b", [5, 9, 13, 7, EOS_ID], params))
    engine.step()
    engine.step()
    assert plans[0].blocks_to_copy == [] and [tokens for _, _, tokens in plans[1].blocks_to_copy] == [1, 1, 1]
    engine = translator_engine()
    engine.add_request(Request("b", [5, 9, 13, 7, EOS_ID], params))
    engine.step()
    engine.abort("b")
    plan = engine.scheduler.schedule()
    assert [r.request_id for r in plan.aborted] == ["b"] and plan.blocks_to_copy == []
    assert engine.blocks is not None and engine.blocks.num_free == engine.blocks.num_blocks - 1


def test_decode_rows_span_the_slots_unless_too_sparse() -> None:
    assert decode_rows([3, 1, 2]) == [1, 2, 3]
    assert decode_rows([0, 2]) == [0, 1, 2]
    assert decode_rows([0, 3]) == [0, 1, 2, 3]
    assert decode_rows([5, 0]) == [0, 5]  # a span of 6 rows for 2 sequences: gathered instead


def test_beam_group_takes_aligned_blocks_of_one_width_only() -> None:
    assert beam_group([[0, 1, 2, 3], [8, 9, 10, 11]], list(range(12))) == 4  # idle block 4-7 included
    assert beam_group([[0, 1, 2, 3], [4]], list(range(5))) == 1  # a greedy request beside it
    assert beam_group([[2, 3, 4, 5]], [2, 3, 4, 5]) == 1  # not aligned
    assert beam_group([[0, 1, 2, 3], [8, 9, 10, 11]], [0, 1, 2, 3, 8, 9, 10, 11]) == 4  # gathered rows: whole blocks still
    assert beam_group([[0, 1, 2, 3]], [0, 1, 2, 3, 4, 5]) == 1  # a part of a block
    assert beam_group([[0, 1], [2, 3]], [0, 1, 2, 3]) == 2


def test_cache_rows_read_evenly_spaced_slots_through_a_view() -> None:
    device = torch.device("cpu")
    assert cache_rows([1, 3, 5], device) == slice(1, 7, 2)
    assert isinstance(cache_rows([1, 2, 4], device), torch.Tensor)  # uneven: gathered
    cache = CrossAttentionCache(n_layers=1, n_slots=8, n_heads=1, length=4, head_dim=1)
    cache.keys[0].copy_(torch.arange(8.0).reshape(8, 1, 1, 1).expand(8, 4, 1, 1))  # slot s holds s at every position
    for slots, view in (([1, 3, 5], True), ([1, 2, 4], False)):
        (keys, _), *_ = cache.read(slots, 2)[0]  # (3, H, 2, D)
        assert keys.flatten().tolist() == [s for s in slots for _ in range(2)]
        assert (keys.untyped_storage().data_ptr() == cache.keys[0].untyped_storage().data_ptr()) == view


@pytest.mark.parametrize("source_kernel", [False, True])
def test_beam_searches_sharing_source_reads_equal_the_beam_search_by_recomputation(
    monkeypatch: pytest.MonkeyPatch, device: str, source_kernel: bool
) -> None:
    """Only beam-4 requests, joining at different steps and leaving as they finish: the engine's
    dynamic step reads each sentence's cross-attention keys once for its 4 rows (beam_group), or,
    with the CPU kernel, in place from its first slot, the one slot its keys are written to; and
    every result equals the beam search by recomputation of that sentence alone."""
    sources = [[5, 9, 13, 7, EOS_ID], [40, 41, EOS_ID], [8, 8, 8, EOS_ID], [21, 33, 60, 4, 17, EOS_ID], [11, EOS_ID]]
    engine = translator_engine(device=device, fixed_shape_decode=False)
    runner = engine.runner
    assert isinstance(runner, TranslatorRunner)
    if source_kernel and not runner.cross_cache.decode_kernel:
        pytest.skip("the CPU kernels are off (or not on this device)")
    runner.cross_cache.decode_kernel = source_kernel
    groups: list[int] = []  # beam_group's answer at every decoder step

    def recorded(slots_of_requests: list[list[int]], rows: list[int]) -> int:
        groups.append(beam_group(slots_of_requests, rows))
        return groups[-1]

    monkeypatch.setattr(runner_module, "beam_group", recorded)
    written: list[int] = []  # how many slots each written source went to
    write = runner.cross_cache.write
    monkeypatch.setattr(runner.cross_cache, "write", lambda slots, *rest: written.extend(map(len, slots)) or write(slots, *rest))
    params = GenerationParams(sampling=GREEDY, max_tokens=8, beam_size=4)
    arrivals = {
        0: [Request(f"b{i}", s, params) for i, s in enumerate(sources[:3])],
        4: [Request(f"b{i}", s, params) for i, s in enumerate(sources[3:], 3)],
    }
    finals = {}
    for step in range(80):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        for d in engine.step().deltas:
            if d.finish_reason is not None:
                finals[d.request_id] = d.text
    assert len(written) == len(sources)
    if source_kernel:
        assert groups == []  # no grouping: every row reads its sentence's source in place
        assert set(written) == {1}  # one copy of each source, in the sentence's first slot
    else:
        assert 4 in groups, groups  # steps that read each sentence's keys once for its 4 beams
        assert set(written) == {4}  # a copy per beam
    tokenizer = FakeTokenizer()
    for i, s in enumerate(sources):
        expected = beam_search_uncached(runner.model, torch.tensor([s], device=device), beam_size=4, max_new_tokens=8)[0]
        assert finals[f"b{i}"] == tokenizer.decode(expected[0].tokens)
    assert engine.scheduler.slots.num_free == 16
