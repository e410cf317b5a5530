"""Speculative decoding by prompt lookup (service/engine/speculation.py): the proposer, the
scheduler's drafts, and the engine's outputs with speculation equal to those without it, greedy
and sampled, seed for seed, on the shipped generator (a trained model)."""

from dataclasses import replace

import pytest
import torch

from decoding.sampling_params import GREEDY, SamplingParams
from loading.checkpoint import DEFAULT_GENERATOR
from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepReport
from service.engine.kv_blocks import KVBlockManager
from service.engine.request import Delta, GenerationParams, Request
from service.engine.runner import _verify
from service.engine.scheduler import Scheduler
from service.engine.speculation import PromptLookup, RecentOutputs
from tests.engine.helpers import deltas_of

# Prompts that repeat themselves, so the model's continuations often copy what came before.
PROMPTS = [
    "ROMEO:\nWhat light is this? ROMEO:\nWhat light is this?\nROMEO:\nWhat",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;\nKING HENRY:\nOnce more unto",
    "First Citizen:\nWe are accounted poor citizens.\nFirst Citizen:\nWe are",
    "To be, or not to be, that is the question. To be, or not to be,",
]


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    lookup = PromptLookup(min_n=2, max_n=3, max_tokens=3)
    #          0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2]
    assert lookup.propose(context) == [3, 8, 7]  # the latest [1, 2] ends at 6: 3, 8, 7 followed it
    assert lookup.propose([*context, 3]) == [8, 7, 1]  # [1, 2, 3] (n = 3 first), latest at 4..6
    assert lookup.propose([5, 6, 7]) == []  # a new context: nothing of it occurred before (an index per sequence)


def test_prompt_lookup_never_matches_its_own_suffix_and_follows_acceptance() -> None:
    lookup = PromptLookup(min_n=2, max_n=2, max_tokens=4)
    assert lookup.propose([4, 5]) == []  # the suffix itself is no earlier occurrence
    assert lookup.propose([4, 5, 6, 4, 5]) == [6, 4, 5, 6]  # what followed, then it again: the text repeating
    lookup.accepted(proposed=3, taken=0)
    assert lookup.budget == 1 and lookup.propose([4, 5, 6, 4, 5, 6, 4, 5]) == [6]
    lookup.accepted(proposed=1, taken=1)
    assert lookup.budget == 2


def test_the_scheduler_counts_drafts_in_the_budget_and_speculates_only_in_small_batches() -> None:
    blocks = KVBlockManager(num_blocks=64, block_size=4, prefix_caching=True, salt="")
    scheduler = Scheduler(8, 8, max_num_batched_tokens=5, blocks=blocks, decoder_only=True, speculation_max_batch=1)
    r = Request("a", [1, 2, 3], GenerationParams(max_tokens=20))
    scheduler.add(r)
    plan = scheduler.schedule()
    scheduler.advance(plan, {})
    r.output_ids.append(7)
    r.draft_ids = [8, 9, 10, 11, 12]
    plan = scheduler.schedule()
    assert plan.num_tokens["a"] == 5 and plan.drafts["a"] == [8, 9, 10, 11]  # 1 + 4 drafts: the budget of 5
    # Blocks hold the drafts' keys; only blocks of known tokens are registered in the prefix cache.
    assert len(plan.block_tables["a"]) == 2 and blocks.sequences["a"].cached == 1
    scheduler.advance(plan, {"a": 3})  # 1 of 4 drafts accepted: the last token and it computed
    assert r.num_computed_tokens == 3 + 1 + 1
    r.output_ids += [8, 4]
    r.draft_ids = [5]
    scheduler.add(Request("b", [1, 2, 3], GenerationParams(max_tokens=20)))
    scheduler.add(Request("c", [1, 2, 3], GenerationParams(max_tokens=20)))
    plan = scheduler.schedule()
    assert plan.num_tokens["a"] == 2 and plan.drafts == {"a": [5]}  # one decode: it speculates
    scheduler.advance(plan, {"a": 0})  # its draft accepted: it and the token after it
    r.output_ids += [5, 6]
    scheduler.running["b"].output_ids.append(4)  # b's prompt computed: its first token
    for request in scheduler.running.values():
        request.draft_ids = [5, 6]
    plan = scheduler.schedule()
    assert plan.drafts == {} and plan.num_tokens["a"] == plan.num_tokens["b"] == 1  # two decodes: neither drafts


def engine(speculative_tokens: int) -> Engine:
    config = EngineConfig(n_slots=8, num_speculative_tokens=speculative_tokens, speculation_max_batch=8, block_size=4)
    return Engine.from_checkpoint(DEFAULT_GENERATOR, config)


def generate(engine: Engine, params: list[GenerationParams]) -> tuple[dict[str, list[Delta]], list[StepReport]]:
    reports: list[StepReport] = []
    engine.on_step = reports.append
    requests = [Request(str(i), engine.runner.encode_prompt(PROMPTS[i % len(PROMPTS)]), p) for i, p in enumerate(params)]
    return deltas_of(engine, {0: requests[:4], 3: requests[4:]}), reports


PARAMS = [
    GenerationParams(max_tokens=60, sampling=GREEDY),
    GenerationParams(max_tokens=60, sampling=SamplingParams(temperature=0.8, seed=7)),
    GenerationParams(max_tokens=60, sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=3, repetition_penalty=1.3)),
    GenerationParams(max_tokens=60, sampling=SamplingParams(temperature=0.7, seed=11, presence_penalty=0.5), min_tokens=30, logprobs=2),
    GenerationParams(max_tokens=60, sampling=GREEDY, stop=("\n\n",), logprobs=1),
    GenerationParams(max_tokens=45, sampling=SamplingParams(temperature=1.2, seed=5, logit_bias=((10, 2.0),))),
]


def test_outputs_with_speculation_are_those_without_it_seed_for_seed() -> None:
    plain, _ = generate(engine(0), PARAMS)
    speculated, reports = generate(engine(4), PARAMS)
    for request_id, deltas in plain.items():
        got = speculated[request_id]
        assert [t for d in got for t in d.token_ids] == [t for d in deltas for t in d.token_ids], request_id
        assert "".join(d.text for d in got) == "".join(d.text for d in deltas)
        assert got[-1].finish_reason == deltas[-1].finish_reason
        expected_logprobs = [lp for d in deltas for lp in d.logprobs or []]
        got_logprobs = [lp for d in got for lp in d.logprobs or []]
        assert [lp.token for lp in got_logprobs] == [lp.token for lp in expected_logprobs]
        for a, b in zip(got_logprobs, expected_logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # The test means something: drafts were verified, some accepted and some refused, so that
    # fewer steps made the same tokens.
    drafted = sum(r.draft_tokens for r in reports)
    accepted = sum(sum(r.accepted_per_position) for r in reports)
    assert sum(r.drafts for r in reports) > 10 and 0 < accepted < drafted
    assert any(len(d.token_ids) > 1 for deltas in speculated.values() for d in deltas)


def test_a_request_can_turn_speculation_off() -> None:
    off = [replace(p, speculate=False) for p in PARAMS[:2]]
    deltas, reports = generate(engine(4), off)
    assert sum(r.drafts for r in reports) == 0 and all(len(d.token_ids) <= 1 for ds in deltas.values() for d in ds)


def test_verification_samples_the_models_distribution() -> None:
    """Thousands of seeded draws of one position whose draft is a likely token: the tokens kept (the
    draft, or what the row drew instead) follow the row's probabilities, and the draft is kept
    as often as its probability (the rejection sampling of a one-token proposal)."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])
    logits = probs.log().expand(2, -1).contiguous()  # (2, V): the draft's row, and the one after it
    draft = 3
    counts = torch.zeros(5)
    kept = 0
    draws = 4000
    for seed in range(draws):
        r = Request(str(seed), [1], GenerationParams(max_tokens=4, sampling=SamplingParams(temperature=1.0, seed=seed)))
        (tokens,) = _verify(logits, [r], [[draft]], frozenset({0}))
        counts[tokens[0]] += 1
        kept += len(tokens) == 2
        # The generator is left as if it had drawn once per token made.
        plain = torch.Generator().manual_seed(seed)
        torch.rand(len(tokens), generator=plain)
        assert r.rng is not None and torch.equal(r.rng.get_state(), plain.get_state())
    assert (counts / draws - probs).abs().max() < 0.025
    assert abs(kept / draws - probs[draft].item()) < 0.025


def test_preempted_requests_with_drafts_make_the_same_outputs() -> None:
    """A pool too small for every sequence: requests are preempted (drafts dropped, blocks freed)
    and recomputed, and still make what they make without speculation."""
    full = engine(0).runner
    assert full.kv_pool is not None
    block_bytes = full.kv_cache_bytes // full.kv_pool.num_blocks  # 70 blocks: a whole context (64) and a little

    def small(speculative_tokens: int) -> Engine:
        config = EngineConfig(n_slots=8, num_speculative_tokens=speculative_tokens, block_size=4, kv_cache_bytes=70 * block_bytes)
        return Engine.from_checkpoint(DEFAULT_GENERATOR, config)

    params = [replace(p, max_tokens=60, stop=()) for p in PARAMS]
    plain, _ = generate(small(0), params)
    speculated, reports = generate(small(4), params)
    assert sum(r.preemptions for r in reports) > 0 and sum(r.drafts for r in reports) > 0
    for request_id, deltas in plain.items():
        assert [t for d in speculated[request_id] for t in d.token_ids] == [t for d in deltas for t in d.token_ids], request_id


def test_recent_outputs_propose_what_followed_in_another_requests_output() -> None:
    recent = RecentOutputs(min_n=2, max_n=3, max_tokens=12)
    recent.add([1, 2, 3, 4, 5, 6])
    recent.add([9, 2, 3, 7, 8])
    assert recent.propose([0, 2, 3], 4) == [7, 8]  # the latest output with [2, 3], to its end
    assert recent.propose([1, 2, 3], 2) == [4, 5]  # [1, 2, 3]: the longest match first
    lookup = PromptLookup(min_n=2, max_n=3, max_tokens=3)
    assert lookup.propose([5, 9, 2, 3], recent) == [7, 8]  # nothing in its own context: the shared outputs'
    recent.add([10, 11, 12, 13, 14, 15])  # 17 tokens held: the oldest output is dropped
    assert recent.propose([1, 2, 3], 2) == [7, 8]  # [1, 2, 3] went with it; [2, 3] is still in the second


def test_a_request_speculates_from_an_earlier_requests_output_and_answers_the_same() -> None:
    """A request whose answer another request gave before: its drafts come from that output (its
    own context has no match at first), and its tokens are those made without speculation."""
    prompt = "BRUTUS:\\nGood morrow"
    plain = engine(0)
    expected = run_one(plain, prompt)
    shared = engine(4)
    assert run_one(shared, prompt) == expected
    reports: list[StepReport] = []
    shared.on_step = reports.append
    assert run_one(shared, prompt) == expected
    accepted = sum(sum(r.accepted_per_position) for r in reports)
    assert accepted >= len(expected) // 2  # most of the second answer came from the first's


def run_one(engine: Engine, prompt: str) -> list[int]:
    request = Request(prompt, engine.runner.encode_prompt(prompt), GenerationParams(max_tokens=40, sampling=GREEDY))
    return [t for d in deltas_of(engine, {0: [request]})[prompt] for t in d.token_ids]


def test_recent_outputs_hold_a_bounded_index_however_many_outputs_come() -> None:
    recent = RecentOutputs(min_n=2, max_n=4, max_tokens=1000)
    for i in range(2000):
        recent.add([(i * 7 + j * 13) % 997 for j in range(25)])
        assert len(recent._ends) <= 2 * 1000 * 3 + 25 * 3  # an output's entries over the bound before they are swept
    assert sum(len(tokens) for tokens in recent._outputs.values()) <= 1000
