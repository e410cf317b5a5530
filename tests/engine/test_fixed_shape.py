"""The fixed-shape decode steps by bucket (what the GPU captures as CUDA graphs) compute what the
dynamic steps compute: logits at every bucket boundary (to float32 rounding: the kernels' blocked
reductions follow the shapes, so a few ulps differ), and the engine's outputs token for token, for
both models."""

import copy
import dataclasses

import pytest
import torch

from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from loading.tokenizer import EOS_ID
from model.config import GeneratorConfig, TranslatorConfig
from model.generator import Generator
from model.kv_cache import CrossAttentionCache, PagedKVCache
from model.translator import Translator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.fixed_shape import PagedFed, StepShape, bucket, buckets
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner, TranslatorRunner, in_order
from tests.engine.helpers import PROMPTS, FakeTokenizer, context_sensitive_generator, run

N_SLOTS = 9  # batch buckets 1, 2, 4, 8, 9
CONTEXT = 300  # key-length buckets 64, 128, 256, 300
BLOCK_SIZE = EngineConfig().block_size
# Highest slot + 1 at and just past each batch bucket; furthest position + 1 at and just past each key bucket.
BATCHES = [1, 2, 3, 4, 5, 8, 9]
LENGTHS = [1, 64, 65, 128, 129, 256, 257, 300]


def test_buckets_are_powers_of_two_up_to_the_limit_included() -> None:
    assert buckets(9) == [1, 2, 4, 8, 9]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(1) == [1]
    assert buckets(300, 64) == [64, 128, 256, 300]
    assert buckets(40, 64) == [40]  # a context below the smallest key bucket: one bucket


def test_bucket_is_the_smallest_that_holds_the_size() -> None:
    sizes = buckets(256)
    assert [bucket(n, sizes) for n in (1, 2, 3, 64, 65, 129, 255, 256)] == [1, 2, 4, 64, 128, 256, 256, 256]
    assert bucket(9, buckets(9)) == 9 and bucket(5, buckets(9)) == 8
    with pytest.raises(ValueError):
        bucket(257, sizes)


def test_a_step_takes_the_bucket_of_its_highest_slot_and_furthest_position() -> None:
    decoder = generator_runners()[0].fixed_shape
    assert decoder is not None
    assert decoder.shape_for(with_tables({0: (5, 0)})) == StepShape(1, 64, 0)
    assert decoder.shape_for(with_tables({4: (5, 63), 1: (5, 3)})) == StepShape(8, 64, 0)  # slot 4: 5 rows
    assert decoder.shape_for(with_tables({3: (5, 64)})) == StepShape(4, 128, 0)
    assert decoder.shape_for(with_tables({8: (5, 299), 0: (5, 1)})) == StepShape(9, 300, 0)


def tiny_generator() -> Generator:
    torch.manual_seed(4)
    model = Generator(dataclasses.replace(GeneratorConfig.preset("tiny"), max_len=CONTEXT)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)  # wide enough that the logits depend on the whole context
    return model


def tiny_translator() -> Translator:
    torch.manual_seed(2)
    return Translator(dataclasses.replace(TranslatorConfig.preset("tiny"), max_len=CONTEXT)).eval()


def fill(caches: list[CrossAttentionCache] | list[PagedKVCache]) -> None:
    """The same random keys and values in every cache of the list (all of one shape)."""
    for tensors in zip(*[c.keys + c.values for c in caches], strict=True):
        noise = torch.randn_like(tensors[0])
        for t in tensors:
            t.copy_(noise)


def generator_runners(model: Generator | None = None) -> tuple[GeneratorRunner, GeneratorRunner]:
    """(fixed-shape, dynamic) runners of one model, their caches holding the same random keys."""
    model = model or tiny_generator()
    config = EngineConfig(n_slots=N_SLOTS, max_context=CONTEXT)
    fixed, dynamic = (GeneratorRunner(model, FakeTokenizer(), config, fixed_shape_decode=f) for f in (True, False))  # type: ignore[arg-type]
    fill([fixed.cache, dynamic.cache])
    return fixed, dynamic


def with_tables(fed: dict[int, tuple[int, int]]) -> PagedFed:
    """fed with each slot's block table: slot s owns blocks s * n + 1 ... (n per whole context),
    listed up to its position's block, backwards (a table is any order of blocks)."""
    n = -(-CONTEXT // BLOCK_SIZE)
    return {s: (t, p, [s * n + n - j for j in range(p // BLOCK_SIZE + 1)]) for s, (t, p) in fed.items()}


def fed_for(batch: int, length: int) -> dict[int, tuple[int, int]]:
    """Sequences whose highest slot is batch - 1 and furthest position length - 1, others spread below."""
    slots = sorted({batch - 1, *range(0, batch - 1, 2)})
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    positions = torch.randint(0, length, (len(slots),), generator=generator).tolist()
    positions[-1] = length - 1
    tokens = torch.randint(4, 60, (len(slots),), generator=generator).tolist()
    return {s: (t, p) for s, t, p in zip(slots, tokens, positions, strict=True)}


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    """Equal to float32 rounding (logits of about 5: an ulp is 5e-7; measured differences 2.5e-6 at most)."""
    assert got.shape == expected.shape, where
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=where)


@torch.inference_mode()
def test_bucketed_generator_step_equals_the_dynamic_step_at_every_bucket_boundary() -> None:
    fixed, dynamic = generator_runners()
    assert fixed.fixed_shape is not None and dynamic.fixed_shape is None
    for batch in BATCHES:
        for length in LENGTHS:
            fed = with_tables(fed_for(batch, length))
            expected = dynamic.decode_rows(fed).logits(0, len(fed))  # (R, V)
            got = fixed.decode_rows(fed).logits(0, len(fed))
            assert_same_logits(got, expected, f"batch {batch}, length {length}")


@torch.inference_mode()
@pytest.mark.parametrize("beam_blocks", [False, True])
def test_bucketed_translator_step_equals_the_dynamic_step_at_every_bucket_boundary(beam_blocks: bool) -> None:
    """Self-attention keys and source keys at and past each bucket; with beam_blocks, the slots
    form aligned blocks of 2 sharing a source (the dynamic step then reads each block's source keys
    once, the fixed-shape step each row's copy)."""
    model = tiny_translator()
    fixed, dynamic = (TranslatorRunner(model, FakeTokenizer(), N_SLOTS, CONTEXT, fixed_shape_decode=f) for f in (True, False))  # type: ignore[arg-type]
    fill([fixed.cache, dynamic.cache])
    fill([fixed.cross_cache, dynamic.cross_cache])
    for sources in LENGTHS:
        for runner in (fixed, dynamic):
            runner.cross_cache.src_valid.zero_()
            for slot in range(N_SLOTS):
                runner.cross_cache.src_valid[slot, : max(1, sources - 3 * (slot % 2))] = True  # sources of different lengths
            if beam_blocks:  # a block's beams share their source: slot 2i + 1 holds a copy of slot 2i's
                runner.cross_cache.copy_slots(torch.arange(0, N_SLOTS - 1, 2), torch.arange(1, N_SLOTS, 2))
        for batch in BATCHES:
            for length in LENGTHS:
                fed = fed_for(batch, length)
                if beam_blocks:  # every slot up to an even count
                    fed = {s: fed.get(s, (7, length - 1)) for s in range(min(batch + batch % 2, N_SLOTS - 1))}
                slots_of_requests = [list(fed)[i : i + 2] for i in range(0, len(fed), 2)] if beam_blocks else [[s] for s in fed]
                paged = with_tables(fed)
                expected = in_order(*dynamic.step_logits(paged, slots_of_requests, sources))  # (R, V) in fed's order
                got = in_order(*fixed.step_logits(paged, slots_of_requests, sources))
                assert_same_logits(got, expected, f"batch {batch}, length {length}, source {sources}")


def generated(fixed_shape: bool, device: str = "cpu", model: Generator | None = None) -> dict[str, list[int]]:
    """Greedy requests joining at steps 0 and 3 into 6 slots; some run past position 64 (a key bucket)."""
    model = copy.deepcopy(model or context_sensitive_generator()).to(device)  # the shared one stays on the CPU
    config = EngineConfig(n_slots=6)
    engine = Engine(GeneratorRunner(model, FakeTokenizer(), config, fixed_shape_decode=fixed_shape), config)  # type: ignore[arg-type]
    requests = [Request(f"r{i}", p, GenerationParams(sampling=GREEDY, max_tokens=8 + 15 * i)) for i, p in enumerate(PROMPTS)]
    return run(engine, {0: requests[:2], 3: requests[2:]})


def translated(fixed_shape: bool, device: str = "cpu") -> dict[str, list[int]]:
    """Greedy and beam-4 requests (beams in and out of aligned blocks), joining at steps 0 and 2."""
    model = tiny_translator().to(device)
    runner = TranslatorRunner(model, FakeTokenizer(), 16, fixed_shape_decode=fixed_shape)  # type: ignore[arg-type]
    engine = Engine(runner, EngineConfig(n_slots=16))
    sources = [[5, 9, 13, 7, EOS_ID], [40, 41, EOS_ID], [8, 8, 8, 8, 8, 8, EOS_ID], [21, 33, EOS_ID], [11, EOS_ID]]
    greedy = GenerationParams(sampling=GREEDY, max_tokens=70)
    beams = GenerationParams(sampling=GREEDY, max_tokens=12, beam_size=4, n_best=2)
    requests = [Request(f"b{i}", s, beams) for i, s in enumerate(sources[:3])] + [
        Request(f"g{i}", s, greedy) for i, s in enumerate(sources)
    ]
    finals: dict[str, list[int]] = {}
    arrivals = {0: requests[:4], 2: requests[4:]}
    for step in range(200):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        for d in engine.step().deltas:
            finals.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None and d.alternatives is not None:
                finals[d.request_id + "/alternatives"] = [ord(c) for c in "|".join(d.alternatives)]
        if step > 2 and not engine.has_work:
            break
    assert {r.request_id for r in requests} <= set(finals)
    return finals


def test_fixed_shape_decode_equals_dynamic_decode_in_the_generator_engine() -> None:
    assert generated(fixed_shape=True) == generated(fixed_shape=False)


def test_fixed_shape_decode_equals_dynamic_decode_in_the_translator_engine_greedy_and_beams() -> None:
    assert translated(fixed_shape=True) == translated(fixed_shape=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager_decode_on_gpu() -> None:
    assert generated(fixed_shape=True, device="cuda") == generated(fixed_shape=False, device="cuda")
    assert translated(fixed_shape=True, device="cuda") == translated(fixed_shape=False, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_are_captured_by_bucket_and_only_for_the_shapes_used() -> None:
    config = EngineConfig(n_slots=N_SLOTS, max_context=CONTEXT)
    runner = GeneratorRunner(tiny_generator().to("cuda"), FakeTokenizer(), config)  # type: ignore[arg-type]
    assert runner.fixed_shape is not None and runner.fixed_shape.capture
    with torch.inference_mode():
        for fed in ({0: (5, 3)}, {0: (5, 4)}, {2: (5, 70)}):
            runner.decode_rows(with_tables(fed))
    assert set(runner.fixed_shape.graphs) == {StepShape(1, 64, 0), StepShape(4, 128, 0)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shipped_checkpoints_serve_in_bfloat16_on_gpu() -> None:
    for checkpoint in (DEFAULT_GENERATOR, DEFAULT_TRANSLATOR):
        engine = Engine.from_checkpoint(checkpoint, EngineConfig(n_slots=8), "cuda", torch.bfloat16)
        prompt = engine.runner.encode_prompt("A man is riding a bike.")
        tokens = run(engine, {0: [Request("x", prompt, GenerationParams(sampling=GREEDY, max_tokens=20))]})
        assert tokens["x"], f"{checkpoint.name} produced nothing on the GPU"
