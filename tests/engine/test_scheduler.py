"""Scheduler and engine policy on CPU with a fake runner: admission, slot reuse, queue limit,
aborts, finish reasons, failures."""

import time

import pytest

from decoding.sampling_params import SamplingParams
from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepReport
from service.engine.errors import InvalidRequestError, QueueFullError
from service.engine.request import Delta, GenerationParams, Request
from service.engine.scheduler import Scheduler, SlotAllocator
from tests.engine.helpers import FakeClock, FakeRunner


def request(request_id: str, prompt: list[int], max_tokens: int = 50, stop: tuple[str, ...] = (), beam_size: int = 1) -> Request:
    return Request(request_id, prompt, GenerationParams(max_tokens=max_tokens, stop=stop, beam_size=beam_size, n_best=1))


def run_to_end(engine: Engine, max_steps: int = 200) -> dict[str, list[Delta]]:
    streams: dict[str, list[Delta]] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for d in engine.step().deltas:
            streams.setdefault(d.request_id, []).append(d)
    return streams


def test_slot_allocator_reuses_lowest_free_rows() -> None:
    slots = SlotAllocator(3)
    assert slots.allocate(2) == [0, 1]
    assert slots.allocate(2) is None
    slots.free([0])
    assert slots.allocate(1) == [0]
    with pytest.raises(AssertionError):
        slots.free([2, 2])


def test_admission_is_bounded_by_free_slots_and_slots_are_reused() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=2, max_waiting=10))
    engine.add_request(request("a", [10, 2]))  # 2 tokens then eos
    engine.add_request(request("b", [20, 5]))
    engine.add_request(request("c", [30, 1]))
    engine.step()
    assert set(engine.scheduler.running) == {"a", "b"} and [r.request_id for r in engine.scheduler.waiting] == ["c"]
    a_slot = engine.scheduler.running["a"].slots
    engine.step()
    engine.step()  # a emits eos: finished, slot freed the same step
    assert "a" not in engine.scheduler.running
    engine.step()  # c joins the running batch between two decode steps, in a's slot
    assert engine.scheduler.running["c"].slots == a_slot
    assert engine.runner.executed[-1].prefill[0].request_id == "c"  # type: ignore[attr-defined]
    assert [r.request_id for r in engine.runner.executed[-1].decode] == ["b"]  # type: ignore[attr-defined]


def test_outputs_and_finish_reasons() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=4))
    engine.add_request(request("eos", [10, 3]))
    engine.add_request(request("length", [20], max_tokens=4))
    engine.add_request(request("stop", [30], stop=("w33",)))
    streams = run_to_end(engine)
    text = {k: "".join(d.text for d in v) for k, v in streams.items()}
    assert text == {"eos": "w11 w12 w13 ", "length": "w21 w22 w23 w24 ", "stop": "w31 w32 "}
    assert {k: v[-1].finish_reason for k, v in streams.items()} == {"eos": "stop", "length": "length", "stop": "stop"}
    assert streams["length"][-1].completion_tokens == 4
    assert engine.scheduler.slots.num_free == 4


def test_a_failing_step_observer_loses_no_delta() -> None:
    """on_step (the replica's metrics) raising must not cost the step its output."""
    engine = Engine(FakeRunner(), EngineConfig(n_slots=4))
    calls: list[int] = []

    def failing(report: object) -> None:
        calls.append(1)
        raise ValueError("value must be >0, got 0")

    engine.on_step = failing
    engine.add_request(request("eos", [10, 3]))
    streams = run_to_end(engine)
    assert "".join(d.text for d in streams["eos"]) == "w11 w12 w13 " and streams["eos"][-1].finish_reason == "stop"
    assert len(calls) >= 3


def test_ignore_eos_goes_on_to_max_tokens_and_min_tokens_is_checked() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=4))
    engine.add_request(Request("ignoring", [10, 3], GenerationParams(max_tokens=6, ignore_eos=True)))
    engine.add_request(Request("stopping", [10, 3], GenerationParams(max_tokens=6)))
    streams = run_to_end(engine)
    ignoring = [t for d in streams["ignoring"] for t in d.token_ids]
    assert ignoring == [11, 12, 13, 3, 3, 3] and streams["ignoring"][-1].finish_reason == "length"  # eos went on
    assert [t for d in streams["stopping"] for t in d.token_ids] == [11, 12, 13] and streams["stopping"][-1].finish_reason == "stop"
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        engine.add_request(Request("too-many", [10], GenerationParams(max_tokens=4, min_tokens=5)))


def test_min_tokens_holds_stop_strings_back_as_vllm_does() -> None:
    """No stop string ends in the text of the first min_tokens tokens; one that ends after it stops."""
    engine = Engine(FakeRunner(), EngineConfig(n_slots=4))
    engine.add_request(Request("plain", [30], GenerationParams(max_tokens=6, stop=("w3",))))
    engine.add_request(Request("held", [30], GenerationParams(max_tokens=6, stop=("w3",), min_tokens=2)))
    engine.add_request(Request("spanning", [30], GenerationParams(max_tokens=6, stop=("2 w33",), min_tokens=2)))
    engine.add_request(Request("passed", [30], GenerationParams(max_tokens=6, stop=("w31",), min_tokens=1)))
    streams = run_to_end(engine)
    text = {k: "".join(d.text for d in v) for k, v in streams.items()}
    assert text == {"plain": "", "held": "w31 w32 ", "spanning": "w31 w3", "passed": "w31 w32 w33 w34 w35 w36 "}
    reasons = {k: v[-1].finish_reason for k, v in streams.items()}
    assert reasons == {"plain": "stop", "held": "stop", "spanning": "stop", "passed": "length"}


def test_waiting_queue_limit_refuses_without_queueing() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=1, max_waiting=2))
    engine.add_request(request("a", [10]))
    engine.add_request(request("b", [10]))
    with pytest.raises(QueueFullError):
        engine.add_request(request("c", [10]))
    assert len(engine.scheduler.waiting) == 2


def test_the_waiting_queue_holds_what_the_engine_serves_in_its_queue_time() -> None:
    """Once a step's speed is measured, the queue takes requests (prompt and max_tokens each) up to
    what the engine computes in queue_timeout_s, or what its cache holds if that is more; a first
    waiting request always; the count bounds it besides. Requests leaving the queue give their tokens back."""
    runner = FakeRunner(max_len=100)
    engine = Engine(runner, EngineConfig(n_slots=1, max_waiting=100, queue_timeout_s=10.0))
    assert engine.pool_tokens == 100 and engine.scheduler.waiting_token_budget is None  # nothing measured: the count alone
    engine._measure_speed(StepReport(prefill_tokens=30, generated_tokens=10, step_seconds=2.0))  # 20 tokens/s
    assert engine.tokens_per_s == 20.0 and engine.scheduler.waiting_token_budget == 200  # 20 tokens/s x 10 s > the 100 the cache holds
    engine.add_request(request("first", [5] * 10, max_tokens=290))  # 300 tokens: more than the budget, but the queue is empty
    with pytest.raises(QueueFullError, match="the replica is full"):
        engine.add_request(request("second", [5], max_tokens=9))
    engine.abort("first")
    engine.step()
    assert engine.scheduler.waiting_tokens == 0
    for i in range(20):  # 20 x 10 tokens fill the 200
        engine.add_request(request(f"r{i}", [5] * 5, max_tokens=5))
    with pytest.raises(QueueFullError):
        engine.add_request(request("one more", [5], max_tokens=1))
    assert engine.scheduler.waiting_tokens == 200 and len(engine.scheduler.waiting) == 20
    for _ in range(200):  # much slower (1 token/s): never below what the cache holds
        engine._measure_speed(StepReport(generated_tokens=1, step_seconds=1.0))
    assert engine.tokens_per_s is not None and engine.tokens_per_s < 2.0 and engine.scheduler.waiting_token_budget == 100


def test_abort_while_waiting_never_runs() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=1))
    engine.add_request(request("a", [10, 3]))
    engine.add_request(request("b", [20, 3]))
    engine.abort("b")
    streams = run_to_end(engine)
    assert streams["b"] == [Delta("b", "", [], "abort", prompt_tokens=2)]
    assert all(r.request_id != "b" for plan in engine.runner.executed for r in plan.prefill + plan.decode)  # type: ignore[attr-defined]


def test_abort_while_running_frees_the_slot_at_the_next_step_and_leaves_others_unchanged() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=2))
    engine.add_request(request("keep", [10, 6]))
    alone = run_to_end(engine)
    engine = Engine(FakeRunner(), EngineConfig(n_slots=2))
    engine.add_request(request("keep", [10, 6]))
    engine.add_request(request("drop", [20]))
    first_steps = engine.step().deltas + engine.step().deltas
    engine.abort("drop")
    streams = run_to_end(engine)
    streams["keep"] = [d for d in first_steps if d.request_id == "keep"] + streams["keep"]
    assert streams["drop"][-1].finish_reason == "abort"
    assert engine.scheduler.slots.num_free == 2
    # After the abort, "drop" is never computed again.
    abort_step = next(i for i, p in enumerate(engine.runner.executed) if p.aborted)  # type: ignore[attr-defined]
    assert all(r.request_id != "drop" for p in engine.runner.executed[abort_step:] for r in p.decode)  # type: ignore[attr-defined]
    assert "".join(d.text for d in streams["keep"]) == "".join(d.text for d in alone["keep"])


def test_prefill_token_budget_spreads_admissions_over_steps() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=8, max_num_batched_tokens=6))
    for i in range(3):
        engine.add_request(request(f"r{i}", [10 * (i + 1), 9, 9, 9]))  # 4 prompt tokens each
    engine.step()
    assert len(engine.runner.executed[-1].prefill) == 1  # type: ignore[attr-defined]
    engine.step()
    assert len(engine.runner.executed[-1].prefill) == 1  # type: ignore[attr-defined]


def test_static_policy_admits_only_when_the_batch_has_drained() -> None:
    engine = Engine(FakeRunner(), EngineConfig(n_slots=4, policy="static"))
    engine.add_request(request("long", [10, 5]))
    engine.step()
    engine.add_request(request("late", [20, 1]))
    engine.step()
    assert "late" not in engine.scheduler.running
    run_to_end(engine)
    admitted_at = next(i for i, p in enumerate(engine.runner.executed) if any(r.request_id == "late" for r in p.prefill))  # type: ignore[attr-defined]
    assert admitted_at == 6  # after "long" produced 5 tokens and its eos


def test_beam_requests_hold_beam_size_slots() -> None:
    scheduler = Scheduler(n_slots=4, max_waiting=4, max_num_batched_tokens=100)
    scheduler.add(request("beam", [10], beam_size=3))
    scheduler.add(request("greedy-1", [10]))
    scheduler.add(request("greedy-2", [10]))
    out = scheduler.schedule()
    assert [r.request_id for r in out.prefill] == ["beam", "greedy-1"]
    assert len(out.prefill[0].slots) == 3 and scheduler.slots.num_free == 0


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on() -> None:
    runner = FakeRunner(fail_on={"bad"})
    engine = Engine(runner, EngineConfig(n_slots=4))
    engine.add_request(request("bad", [10, 3]))
    failed = engine.step()
    assert isinstance(failed.error, RuntimeError)
    assert [(d.request_id, d.finish_reason) for d in failed.deltas] == [("bad", "error")]
    assert engine.scheduler.slots.num_free == 4
    engine.add_request(request("good", [20, 2]))
    streams = run_to_end(engine)
    assert "".join(d.text for d in streams["good"]) == "w21 w22 " and streams["good"][-1].finish_reason == "stop"


def test_validation_rejects_what_cannot_be_served() -> None:
    engine = Engine(FakeRunner(max_prompt_len=5), EngineConfig(n_slots=2))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(request("e", []))
    with pytest.raises(InvalidRequestError) as too_long:
        engine.add_request(request("l", list(range(4, 10))))
    assert too_long.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as beams:
        engine.add_request(request("b", [5], beam_size=3))
    assert beams.value.param == "beam_size"
    with pytest.raises(InvalidRequestError):
        engine.add_request(Request("m", [5], GenerationParams(max_tokens=0, sampling=SamplingParams())))
    assert not engine.has_work


def test_a_too_long_prompt_is_blamed_on_the_prompt_and_max_tokens_is_capped() -> None:
    engine = Engine(FakeRunner(max_prompt_len=5), EngineConfig(n_slots=2, max_tokens_cap=20))
    with pytest.raises(InvalidRequestError) as too_long:
        engine.add_request(request("l", list(range(4, 10)), max_tokens=10_000))
    assert too_long.value.param == "prompt"
    assert engine.max_tokens_limit(3) == 20  # FakeRunner allows 1000; the cap wins
    with pytest.raises(InvalidRequestError) as capped:
        engine.add_request(request("c", [5, 6], max_tokens=21))
    assert capped.value.param == "max_tokens"
    engine.add_request(request("ok", [5, 6], max_tokens=20))
    assert engine.has_work


def test_deadlines_end_requests_with_timeout_and_free_their_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """One slot; each step takes 50 ms of a clock that moves only with the steps. The running
    request passes its 0.3 s total deadline, the one behind it its 0.12 s queue deadline; both end
    with "timeout", and the slot is free."""
    clock = FakeClock(time.monotonic())
    monkeypatch.setattr(time, "monotonic", clock)
    engine = Engine(FakeRunner(step_seconds=0.05, clock=clock), EngineConfig(n_slots=1, queue_timeout_s=0.12, request_timeout_s=0.3))
    engine.add_request(request("running", [10], max_tokens=1000))
    engine.add_request(request("queued", [20], max_tokens=1000))
    streams = run_to_end(engine)
    assert streams["queued"] == [streams["queued"][0]] and streams["queued"][0].finish_reason == "timeout"
    assert streams["queued"][0].token_ids == []  # it never ran
    assert streams["running"][-1].finish_reason == "timeout" and len(streams["running"]) > 1
    assert engine.scheduler.slots.num_free == 1 and not engine.has_work
    assert engine.counters.finished == {"timeout": 2}
    engine.add_request(request("after", [30, 2]))  # the engine serves on
    assert run_to_end(engine)["after"][-1].finish_reason == "stop"


def test_a_step_with_admissions_names_the_next_waiting_requests_within_its_budget() -> None:
    scheduler = Scheduler(n_slots=1, max_waiting=10, max_num_batched_tokens=10)
    for i, n in enumerate([3, 4, 2, 5, 1]):
        scheduler.add(request(f"r{i}", [7] * n))
    plan = scheduler.schedule()
    assert [r.request_id for r in plan.prefill] == ["r0"]
    assert [r.request_id for r in plan.upcoming] == ["r1", "r2"]  # 3 + 4 + 2 tokens; r3's 5 more pass the budget of 10
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2", "r3", "r4"]  # upcoming ones are not admitted
    assert scheduler.schedule().upcoming == []  # no admission, nothing upcoming


def test_running_rows_take_the_token_budget_before_admissions() -> None:
    """A step's budget counts the tokens it computes: an admission's prompt and first token, a
    running request's rows one each (each beam one); admissions wait while the rows take it all."""
    scheduler = Scheduler(n_slots=8, max_waiting=4, max_num_batched_tokens=6)
    scheduler.add(request("beams", [10, 9, 9, 9, 9], beam_size=6))
    scheduler.add(request("next", [20]))
    assert [r.request_id for r in scheduler.schedule().prefill] == ["beams"]  # 5 + 1 tokens: the whole budget
    plan = scheduler.schedule()
    assert [r.request_id for r in plan.decode] == ["beams"] and plan.prefill == []  # 6 rows: 2 slots free, no budget left
    scheduler.finish(plan.decode[0], "stop")
    assert [r.request_id for r in scheduler.schedule().prefill] == ["next"]
