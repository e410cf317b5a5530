"""The async front: streams, early exit aborts, queue bound, a failing step, liveness."""

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from service.engine.async_engine import AsyncEngine, paced
from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepReport
from service.engine.errors import QueueFullError
from service.engine.request import Delta, GenerationParams
from tests.engine.helpers import FakeRunner


async def collect(stream: object) -> list[Delta]:
    return [d async for d in stream]  # type: ignore[attr-defined]


def make(n_slots: int = 4, max_waiting: int = 8, runner: FakeRunner | None = None) -> AsyncEngine:
    return AsyncEngine(Engine(runner or FakeRunner(), EngineConfig(n_slots=n_slots, max_waiting=max_waiting)))  # type: ignore[arg-type]


async def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Returns once `condition` holds; fails after timeout_s (a bound on a broken engine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_concurrent_streams_complete() -> None:
    steps = threading.Semaphore(0)  # no step runs before all six are submitted
    engine = make(runner=FakeRunner(steps=steps))

    async def main() -> list[list[Delta]]:
        streams = [await engine.submit([10 * (i + 1), 3 + i], GenerationParams(max_tokens=50)) for i in range(6)]
        steps.release(1000)
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "stop"
        assert sum(len(d.token_ids) for d in deltas) == 3 + i
    assert engine.engine.counters.max_batch_size == 4  # all four slots busy at once


def test_a_reader_that_falls_behind_gets_the_queued_deltas_merged() -> None:
    steps = threading.Semaphore(0)  # the test runs the steps
    engine = make(runner=FakeRunner(steps=steps))

    async def main() -> tuple[list[Delta], list[Delta]]:
        prompt, params = [10, 20], GenerationParams(max_tokens=50)  # FakeRunner: tokens 11..30, then EOS
        eager_stream, eager = await engine.submit(prompt, params), []
        while not eager or eager[-1].finish_reason is None:  # one step, then its delta read
            steps.release()
            eager.append(await anext(eager_stream))
        lagging = await engine.submit(prompt, params)
        steps.release(21)
        while engine.engine.has_work or engine.num_waiting():  # the whole request runs before the first read
            await asyncio.sleep(0.01)
        engine.stop()  # joins the loop thread: every delta it published is scheduled on this loop
        await asyncio.sleep(0)  # and now delivered
        return eager, await collect(lagging)

    try:
        eager, lagging = asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    assert len(eager) == 21 and len(lagging) == 1
    merged = lagging[0]
    assert merged.token_ids == [t for d in eager for t in d.token_ids] and merged.text == "".join(d.text for d in eager)
    assert (merged.finish_reason, merged.prompt_tokens, merged.completion_tokens) == (
        eager[-1].finish_reason,
        eager[-1].prompt_tokens,
        eager[-1].completion_tokens,
    )


@pytest.mark.parametrize("interval", [None, 0.0, 0.1])
def test_paced_streams_send_the_first_token_at_once_then_what_was_made_meanwhile_merged(interval: float | None) -> None:
    """The test runs the steps: the first alone, read at once; then the other 30 (tokens 12..40,
    then EOS) before the reader looks again, so they reach it as one piece, whatever the interval."""
    steps = threading.Semaphore(0)
    engine = make(runner=FakeRunner(steps=steps))

    async def main() -> list[Delta]:
        stream = paced(await engine.submit([10, 30], GenerationParams(max_tokens=100)), interval)
        steps.release()
        first = await anext(stream)
        steps.release(30)
        await until(lambda: not engine.engine.has_work)
        return [first, *[d async for d in stream]]

    try:
        deltas = asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    assert [d.token_ids for d in deltas] == [[11], list(range(12, 41))]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 30


def test_leaving_a_stream_early_aborts_and_frees_the_slot() -> None:
    steps = threading.Semaphore(0)  # the test runs the steps: three tokens read, then the reader leaves
    engine = make(n_slots=1, runner=FakeRunner(steps=steps))

    async def main() -> None:
        stream = await engine.submit([10], GenerationParams(max_tokens=1000))
        for _ in range(3):
            steps.release()
            await anext(stream)
        await stream.aclose()  # what a cancelled reader does on client disconnect
        steps.release(10)  # ten steps, far fewer than the 997 tokens left: only the abort can end it
        await until(lambda: engine.engine.scheduler.slots.num_free == 1)

    try:
        asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    assert engine.engine.scheduler.slots.num_free == 1
    assert engine.engine.counters.finished.get("abort") == 1


def test_full_queue_refuses_at_submit() -> None:
    steps = threading.Semaphore(0)  # no step runs: the first request stays admitted, the others wait
    engine = make(n_slots=1, max_waiting=2, runner=FakeRunner(steps=steps))

    async def main() -> None:
        held = [await engine.submit([10], GenerationParams(max_tokens=1000))]
        await until(lambda: engine.num_running() == 1)  # admitted: running
        held += [await engine.submit([10], GenerationParams(max_tokens=1000)) for _ in range(2)]  # waiting
        with pytest.raises(QueueFullError):
            await engine.submit([10], GenerationParams(max_tokens=5))
        for s in held:
            await s.aclose()  # type: ignore[attr-defined]

    try:
        asyncio.run(main())
    finally:
        steps.release(10_000)
        engine.stop()


def test_a_failing_step_reports_an_error_and_the_loop_keeps_serving() -> None:
    engine = make(runner=FakeRunner(fail_on={"bad"}))

    async def main() -> tuple[list[Delta], list[Delta]]:
        bad = await collect(await engine.submit([10, 3], GenerationParams(), request_id="bad"))
        good = await collect(await engine.submit([20, 2], GenerationParams()))
        return bad, good

    try:
        bad, good = asyncio.run(main())
        assert engine.alive
    finally:
        engine.stop()
    assert bad[-1].finish_reason == "error" and bad[-1].error is not None
    assert good[-1].finish_reason == "stop"
    assert not engine._thread.is_alive()  # stop() joined the loop thread


def test_an_idle_engine_keeps_reporting_its_state() -> None:
    """Ray drops a gauge not set within two report intervals: an idle loop reports running,
    waiting and KV use without a step, and counts nothing."""
    engine = make()
    reports: list[StepReport] = []
    engine.engine.on_step = reports.append

    async def main() -> int:
        await collect(await engine.submit([10, 2], GenerationParams()))
        served, steps = len(reports), engine.engine.counters.steps
        await until(lambda: len(reports) >= served + 2)
        return steps

    try:
        steps = asyncio.run(main())
    finally:
        engine.stop()
    idle = reports[-1]
    assert (idle.batch_size, idle.generated_tokens, idle.running, idle.waiting, idle.kv_cache_usage) == (0, 0, 0, 0, 0.0)
    assert idle.finished == [] and idle.first_token_latencies == []
    assert steps > 0 and engine.engine.counters.steps == steps  # the idle reports are not steps
