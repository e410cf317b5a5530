"""Paged KV, prefix caching, chunked prefill and preemption (service/engine/kv_blocks.py, the
scheduler, the ragged step): the block manager's invariants, and the engine's outputs with
each of them on equal to transformers' and to the engine's own plain run."""

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from decoding.sampling_params import GREEDY
from loading.checkpoint import DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import TextTokenizer
from model.generator import Generator
from model.kv_cache import PagedKVCache
from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepReport
from service.engine.errors import InvalidRequestError
from service.engine.kv_blocks import NULL_BLOCK, KVBlockManager, block_hashes
from service.engine.request import Delta, GenerationParams, Request
from service.engine.runner import GeneratorRunner, TranslatorRunner, in_order
from tests.engine.helpers import assert_equal_up_to_a_tie, deltas_of
from tests.hf_folders import build_llama_folder

# --- The block manager, without tensors ---


def assert_consistent(manager: KVBlockManager) -> None:
    """Every block is free or held, never both; reference counts are the tables' holdings; no table
    holds a block twice; the null block is nobody's; every cached hash maps to a block that says so."""
    holdings = [0] * manager.num_blocks
    for seq in manager.sequences.values():
        assert len(set(seq.table)) == len(seq.table), "a block twice in one table"
        for block in seq.table:
            holdings[block] += 1
    assert holdings == manager.ref_count
    assert holdings[NULL_BLOCK] == 0 and NULL_BLOCK not in manager.free
    for block in range(1, manager.num_blocks):
        assert (block in manager.free) == (holdings[block] == 0), f"block {block} free and held, or neither"
    for digest, block in manager.block_of_hash.items():
        assert manager.hash_of[block] == digest


def test_random_allocations_keep_the_invariants_and_finishing_returns_every_block() -> None:
    rng = random.Random(0)
    manager = KVBlockManager(num_blocks=40, block_size=4)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(12)]  # few distinct tokens: shared prefixes
    live: dict[str, list[int]] = {}
    for step in range(300):
        if live and rng.random() < 0.3:
            seq = rng.choice(sorted(live))
            manager.release(seq)
            del live[seq]
        else:
            seq = f"s{step}"
            tokens = list(rng.choice(prompts))
            cached = manager.cached_prefix(seq, tokens)
            assert cached % manager.block_size == 0 and cached < len(tokens)
            if manager.allocate(seq, len(tokens) + rng.randrange(8)):
                manager.cache_blocks(seq, tokens, len(tokens))
                live[seq] = tokens
            else:
                manager.release(seq)
        assert_consistent(manager)
    for seq in list(live):
        manager.release(seq)
    assert_consistent(manager)
    assert manager.num_free == manager.num_blocks - 1 and manager.usage == 0.0


def test_hashes_chain_over_the_whole_prefix_and_the_salt() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "model-a")
    assert len(a) == 2  # full blocks only
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "model-a") == a
    assert block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, "model-a")[1] != a[1]  # same second block, another first: another hash
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "model-b")[0] != a[0]  # another model never shares
    assert block_hashes([12, 3, 4], 1, "m") != block_hashes([1, 23, 4], 1, "m")  # token boundaries are part of the hash


def test_only_identical_prefixes_share_blocks_and_never_the_last_token() -> None:
    manager = KVBlockManager(num_blocks=20, block_size=4, salt="m")
    first = list(range(10, 22))  # 12 tokens: 3 full blocks
    assert manager.cached_prefix("a", first) == 0
    assert manager.allocate("a", len(first))
    manager.cache_blocks("a", first, len(first))
    assert manager.cached_prefix("same", first) == 8  # the last block is computed again: its last token's logits are needed
    assert manager.table("same") == manager.table("a")[:2]
    assert manager.cached_prefix("longer", [*first, 99]) == 12
    assert manager.cached_prefix("other", [10, 11, 12, 0, *first[4:]]) == 0  # differs in block 0: nothing shared after it
    other_model = KVBlockManager(num_blocks=20, block_size=4, salt="another model")
    assert other_model.cached_prefix("x", first) == 0
    assert_consistent(manager)


def test_freed_cached_blocks_are_evicted_least_recently_freed_first_tail_first() -> None:
    manager = KVBlockManager(num_blocks=7, block_size=2, salt="m")  # 6 usable blocks
    for seq, tokens in (("a", [1, 2, 3, 4, 5, 6]), ("b", [7, 8, 9, 10, 11, 12])):
        assert manager.cached_prefix(seq, tokens) == 0 and manager.allocate(seq, 6)
        manager.cache_blocks(seq, tokens, 6)
    a_blocks, b_blocks = list(manager.table("a")), list(manager.table("b"))
    manager.release("a")
    manager.release("b")
    assert list(manager.free) == [*reversed(a_blocks), *reversed(b_blocks)]  # a freed first; each tail first
    assert manager.allocate("c", 2)  # one new block: a's last block is evicted
    assert manager.table("c") == [a_blocks[-1]]
    assert manager.cached_prefix("a again", [1, 2, 3, 4, 5, 6, 0]) == 4  # a's first two blocks still cached
    assert manager.cached_prefix("b again", [7, 8, 9, 10, 11, 12, 0]) == 6
    assert_consistent(manager)


def test_without_prefix_caching_the_most_recently_freed_block_is_reused_first() -> None:
    manager = KVBlockManager(num_blocks=7, block_size=2, prefix_caching=False)
    assert manager.allocate("a", 4) and manager.allocate("b", 2)
    a_blocks = list(manager.table("a"))
    manager.release("a")
    assert manager.allocate("c", 2) and manager.table("c") == [a_blocks[0]]  # a's head, freed last (tail first)
    assert manager.fork([("b", "c")], 1) == [(manager.table("b")[0], a_blocks[1])]  # the next most recently freed
    assert_consistent(manager)


def test_copy_blocks_copies_the_tokens_written_in_each_block_in_every_layer() -> None:
    cache = PagedKVCache(n_layers=2, num_blocks=6, block_size=4, n_kv_heads=2, head_dim=3)
    for pool in cache.keys + cache.values:
        pool.copy_(torch.randn(pool.shape))
    before = [pool.clone() for pool in cache.keys + cache.values]
    cache.copy_blocks(torch.tensor([1, 2]), torch.tensor([4, 5]), torch.tensor([3, 1]))
    for pool, old in zip(cache.keys + cache.values, before, strict=True):
        assert torch.equal(pool[4, :3], old[1, :3]) and torch.equal(pool[4, 3:], old[4, 3:])  # 3 tokens of block 1
        assert torch.equal(pool[5, :1], old[2, :1]) and torch.equal(pool[5, 1:], old[5, 1:])  # 1 token of block 2
        assert torch.equal(pool[:4], old[:4])  # the sources unchanged


def test_a_beam_fork_shares_full_blocks_moves_or_copies_the_last_and_swaps_rows_safely() -> None:
    manager = KVBlockManager(num_blocks=12, block_size=4)
    for seq in ("0", "1", "2"):
        assert manager.allocate(seq, 10)  # 3 blocks each: two full, one holding 2 tokens
    a, b, c = list(manager.table("0")), list(manager.table("1")), list(manager.table("2"))
    copies = manager.fork([("0", "1"), ("1", "0")], tokens=10)  # the two rows swap beams: each last block moves
    assert manager.table("1") == a and manager.table("0") == b and copies == []
    assert_consistent(manager)
    # Row 0 continues row 2's beam, rows 1 and 2 row 0's: row 2's last block moves to row 0, row 0's
    # to row 1 (its first child), and row 2 gets a copy of it; row 1's old blocks go back.
    copies = manager.fork([("2", "0"), ("0", "1"), ("0", "2")], tokens=10)
    assert manager.table("0") == c and manager.table("1") == b
    assert manager.table("2")[:2] == b[:2] and copies == [(b[2], manager.table("2")[2])] and manager.table("2")[2] not in a + b + c
    assert manager.num_free == 12 - 1 - 7  # the null block; b's, c's and the copy held; a's back
    assert_consistent(manager)
    copies = manager.fork([("0", "1")], tokens=8)  # at a block boundary: nothing to copy
    assert copies == [] and manager.table("1") == manager.table("0")[:2] and manager.ref_count[manager.table("0")[0]] == 2
    assert_consistent(manager)
    copies = manager.fork([("0", "1"), ("0", "2")], tokens=9)  # row 0 continues itself: its last block is copied, twice
    assert [source for source, _ in copies] == [manager.table("0")[2]] * 2
    assert_consistent(manager)
    for seq in ("0", "1", "2"):
        manager.release(seq)
    assert manager.num_free == manager.num_blocks - 1


# --- The engine on a Llama folder: every fast path against transformers and against the plain run ---


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Generator, TextTokenizer]:
    folder = build_llama_folder(tmp_path_factory.mktemp("llama"), max_positions=512)  # 4 query heads over 2 key/value heads
    model, tokenizer = load_checkpoint(folder)
    assert isinstance(model, Generator)
    return folder, model, tokenizer


SYSTEM = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"
TEXTS = ["You are all resolved rather to die than to famish?", "Let us kill him", "O", "We are accounted poor citizens"]


def served(
    model: Generator, tokenizer: TextTokenizer, config: EngineConfig, decode_kernel: bool = True, block_rows: int | None = None
) -> tuple[dict[str, list[Delta]], dict[str, list[int]], Engine]:
    """Greedy requests (24 tokens, logprobs) of SYSTEM + each text in three waves, the last repeating
    the first (whole prompts cached by then); each one's deltas and prompt, and the engine, whose
    reports are kept in engine.reports. decode_kernel False: decodes attend through SDPA, not the
    CPU kernel (model/paged_attention_cpu.py). block_rows: rows projected and sampled together
    (GeneratorRunner._sample_blocks; by default every row of this small vocabulary at once)."""
    engine = Engine(GeneratorRunner(model, tokenizer, config), config)
    assert isinstance(engine.runner, GeneratorRunner)
    engine.runner.cache.decode_kernel &= decode_kernel
    if block_rows is not None:
        engine.runner.block_rows = block_rows
    params = GenerationParams(max_tokens=24, sampling=GREEDY, logprobs=3)
    waves = {0: TEXTS[:2], 3: TEXTS[2:], 40: TEXTS}
    prompts = {f"{step}/{i}": engine.runner.encode_prompt(SYSTEM + t) for step, texts in waves.items() for i, t in enumerate(texts)}
    arrivals = {step: [Request(r, prompts[r], params) for r in prompts if r.startswith(f"{step}/")] for step in waves}
    reports: list[StepReport] = []
    engine.on_step = reports.append
    streams = deltas_of(engine, arrivals)
    engine.reports = reports  # type: ignore[attr-defined]
    return streams, prompts, engine


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


# Each fast path alone and all together, against the plain run: no prefix caching, every prompt whole,
# decodes attending through SDPA (the fast paths: through the CPU kernel, where it builds).
# pool_blocks: a pool of that many blocks of 16 tokens (a context of 120), too small for four sequences at once.
PLAIN = {"prefix_caching": False, "max_num_batched_tokens": 4096}
FAST_PATHS: dict[str, dict[str, object]] = {
    "prefix caching": {},
    "chunked prefill": {"prefix_caching": False, "max_num_batched_tokens": 7},
    "sampling a row at a time": {"block_rows": 1},
    "preemption": {"prefix_caching": False, "pool_blocks": 8},
    "all": {"max_num_batched_tokens": 11, "pool_blocks": 8, "block_rows": 1},
}


def engine_config(model: Generator, options: dict[str, object]) -> EngineConfig:
    options = dict(options)
    options.pop("block_rows", None)  # the runner's (served)
    blocks = options.pop("pool_blocks", None)
    if isinstance(blocks, int):
        c = model.config
        block_bytes = PagedKVCache.block_bytes(c.n_layers, 16, c.kv_heads, c.head_dim, torch.float32)
        options |= {"block_size": 16, "kv_cache_bytes": blocks * block_bytes, "max_context": 120}
    return EngineConfig(n_slots=8, **options)  # type: ignore[arg-type]


@torch.inference_mode()
@pytest.mark.parametrize("path", list(FAST_PATHS))
def test_each_fast_path_answers_as_transformers_and_as_the_plain_run(llama: tuple[Path, Generator, TextTokenizer], path: str) -> None:
    folder, model, tokenizer = llama
    config = engine_config(model, FAST_PATHS[path])
    plain, _, _ = served(model, tokenizer, engine_config(model, PLAIN), decode_kernel=False)
    block_rows = FAST_PATHS[path].get("block_rows")
    fast, prompts, engine = served(model, tokenizer, config, block_rows=block_rows if isinstance(block_rows, int) else None)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    for request_id, deltas in fast.items():
        prompt = prompts[request_id]
        out = hf.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        theirs = out.sequences[0, len(prompt) :].tolist()
        if theirs[-1] in model.config.eos_ids:
            theirs.pop()  # the eos that ended it: the engine streams no token for it
        ours = tokens_of(deltas)

        def their_logits(prefix: list[int], prompt: list[int] = prompt) -> torch.Tensor:
            return hf(torch.tensor([prompt + prefix])).logits[0, -1]

        assert_equal_up_to_a_tie(ours, theirs, their_logits, 1e-4)
        assert ours == tokens_of(plain[request_id]), f"{path}: {request_id} differs from the plain run"
        got = [s.logprob for d in deltas for s in d.logprobs or []]
        assert got == pytest.approx([s.logprob for d in plain[request_id] for s in d.logprobs or []], abs=1e-5)
        if ours == theirs:
            expected = [float(F.log_softmax(logits[0].float(), dim=-1)[t]) for logits, t in zip(out.logits, ours, strict=False)]
            assert got == pytest.approx(expected, abs=1e-4)
    reports: list[StepReport] = engine.reports  # type: ignore[attr-defined]
    if config.prefix_caching:
        assert sum(r.prefix_cache_hits for r in reports) > 0
    if "pool_blocks" in FAST_PATHS[path]:
        assert sum(r.preemptions for r in reports) > 0, "the pool was meant to be too small for the load"
    assert all(r.prefill_tokens <= config.max_num_batched_tokens for r in reports)
    assert engine.blocks is not None and engine.blocks.num_free == engine.blocks.num_blocks - 1, "a block not returned"


@torch.inference_mode()
def test_the_models_whole_context_is_served_by_default(tmp_path: Path) -> None:
    """A folder of 8,192 positions takes an 8,000-token prompt with the default config, and refuses
    one past its context, naming the numbers."""
    model, tokenizer = load_checkpoint(build_llama_folder(tmp_path / "long", max_positions=8192))
    assert isinstance(model, Generator)
    config = EngineConfig()
    engine = Engine(GeneratorRunner(model, tokenizer, config), config)
    prompt = [5 + i % 300 for i in range(8000)]
    streams = deltas_of(engine, {0: [Request("long", prompt, GenerationParams(max_tokens=4, sampling=GREEDY))]})
    assert len(tokens_of(streams["long"])) >= 1 and streams["long"][-1].finish_reason in ("length", "stop")
    assert streams["long"][-1].prompt_tokens == 8000
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 8192 tokens\. However, your request has 8192 input tokens"):
        engine.add_request(Request("too long", [5] * 8192, GenerationParams(max_tokens=1)))
    with pytest.raises(InvalidRequestError, match=r"you requested 8200 tokens \(8000 in the input, 200 in the completion\)"):
        engine.add_request(Request("too many", prompt, GenerationParams(max_tokens=200)))


@torch.inference_mode()
def test_requests_with_one_prompt_in_one_step_compute_it_once(llama: tuple[Path, Generator, TextTokenizer]) -> None:
    """n > 1 (the API sends one request per choice): the second is admitted in the same step and
    reads the first's blocks, written in that step; both answer as one alone does."""
    _, model, tokenizer = llama
    config = EngineConfig(n_slots=8)
    engine = Engine(GeneratorRunner(model, tokenizer, config), config)
    prompt = engine.runner.encode_prompt(SYSTEM + TEXTS[0])
    params = GenerationParams(max_tokens=12, sampling=GREEDY, logprobs=0)
    reports: list[StepReport] = []
    engine.on_step = reports.append
    together = deltas_of(engine, {0: [Request("a", prompt, params), Request("b", prompt, params)]})
    block = config.block_size
    assert reports[0].prefix_cache_queries == 2 * len(prompt)
    assert reports[0].prefix_cache_hits == (len(prompt) - 1) // block * block  # b: every full block but the one with the last token
    assert reports[0].prefill_tokens == 2 * len(prompt) - reports[0].prefix_cache_hits
    alone = deltas_of(Engine(GeneratorRunner(model, tokenizer, config), config), {0: [Request("c", prompt, params)]})["c"]
    for deltas in together.values():
        assert tokens_of(deltas) == tokens_of(alone)
        assert [s.logprob for d in deltas for s in d.logprobs or []] == pytest.approx(
            [s.logprob for d in alone for s in d.logprobs or []], abs=1e-5
        )


@torch.inference_mode()
def test_the_translators_beams_return_every_block_when_they_end() -> None:
    """Beam search on the translator's paged decoder: forks share blocks; every block is back once
    the requests end (greedy beside beams, arriving at two steps)."""
    engine = Engine.from_checkpoint(DEFAULT_TRANSLATOR, EngineConfig(n_slots=16))
    runner = engine.runner
    assert isinstance(runner, TranslatorRunner)
    beams = GenerationParams(sampling=GREEDY, beam_size=4, n_best=2)
    sources = [runner.encode_prompt(t) for t in ("A man rides a bike.", "Two dogs play in the snow.", "A girl reads a book.")]
    requests = [Request(str(i), s, beams) for i, s in enumerate(sources)] + [
        Request("greedy", sources[0], GenerationParams(sampling=GREEDY))
    ]
    finals = deltas_of(engine, {0: requests[:2], 1: requests[2:]})
    assert all(deltas[-1].finish_reason in ("stop", "length") for deltas in finals.values())
    blocks = engine.blocks  # the scheduler's: the runner keeps none
    assert blocks is not None and blocks.num_free == blocks.num_blocks - 1 and not blocks.sequences


def test_in_order_copies_only_rows_out_of_order() -> None:
    """A step's logits go to its samplers as they are when their rows are all there in order."""
    logits = torch.randn(3, 5)
    assert in_order(logits, [0, 1, 2]) is logits
    assert torch.equal(in_order(logits, [2, 0]), logits[[2, 0]])
    assert torch.equal(in_order(logits, [0, 1]), logits[:2])
