"""The async front and the engine's process: streams, early exit aborts, queue bound, a failing
step, liveness, a lost process. The engine steps in a process of its own; the tests' FakeRunner
takes a spawn context's semaphore permit before each step, so a test decides when steps run."""

import asyncio
import functools
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from service.engine.async_engine import AsyncEngine, paced
from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepReport
from service.engine.errors import EngineDeadError, QueueFullError
from service.engine.faults import FaultInjectingRunner
from service.engine.request import Delta, GenerationParams
from tests.engine.helpers import FakeRunner


class Permits:
    """Step permits the engine's process takes (FakeRunner.steps), released n at a time."""

    def __init__(self) -> None:
        self.semaphore = multiprocessing.get_context("spawn").Semaphore(0)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.semaphore.release()


async def collect(stream: object) -> list[Delta]:
    return [d async for d in stream]  # type: ignore[attr-defined]


def fake_engine(n_slots: int, max_waiting: int, runner: FakeRunner) -> Engine:
    """Built in the engine's process."""
    return Engine(runner, EngineConfig(n_slots=n_slots, max_waiting=max_waiting))  # type: ignore[arg-type]


def faulty_engine(n_slots: int, max_waiting: int) -> Engine:
    """Built in the engine's process: FakeRunner's steps through a FaultInjectingRunner."""
    return Engine(FaultInjectingRunner(FakeRunner()), EngineConfig(n_slots=n_slots, max_waiting=max_waiting))  # type: ignore[arg-type]


def make(
    n_slots: int = 4, max_waiting: int = 8, runner: FakeRunner | None = None, on_step: Callable[[StepReport], None] | None = None
) -> AsyncEngine:
    return AsyncEngine(functools.partial(fake_engine, n_slots, max_waiting, runner or FakeRunner()), on_step)


async def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Returns once `condition` holds; fails after timeout_s (a bound on a broken engine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def idle(engine: AsyncEngine) -> bool:
    return engine.num_running() == 0 and engine.num_waiting() == 0


def test_concurrent_streams_complete() -> None:
    steps = Permits()  # the first step holds until all six are submitted
    engine = make(runner=FakeRunner(steps=steps.semaphore))

    async def main() -> list[list[Delta]]:
        submits = [asyncio.create_task(engine.submit([10 * (i + 1), 3 + i], GenerationParams(max_tokens=50))) for i in range(6)]
        await asyncio.sleep(0)  # each task has sent its request
        steps.release(1000)
        streams = [await s for s in submits]
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    for i, deltas in enumerate(results):
        assert deltas[-1].finish_reason == "stop"
        assert sum(len(d.token_ids) for d in deltas) == 3 + i
    assert engine.counters.max_batch_size == 4  # all four slots busy at once


def test_a_reader_that_falls_behind_gets_the_queued_deltas_merged() -> None:
    steps = Permits()  # the test runs the steps
    engine = make(runner=FakeRunner(steps=steps.semaphore))

    async def main() -> tuple[list[Delta], list[Delta]]:
        prompt, params = [10, 20], GenerationParams(max_tokens=50)  # FakeRunner: tokens 11..30, then EOS
        eager_stream, eager = await engine.submit(prompt, params), []
        while not eager or eager[-1].finish_reason is None:  # one step, then its delta read
            steps.release()
            eager.append(await anext(eager_stream))
        lagging = asyncio.create_task(engine.submit(prompt, params))
        steps.release(21)  # the step the engine is in, then the lagging request's 21
        lagging_stream = await lagging
        await until(lambda: idle(engine) and engine.counters.finished.get("stop") == 2)  # run to its end before the first read
        engine.stop()  # joins the reader: every delta it published is scheduled on this loop
        await asyncio.sleep(0)  # and now delivered
        return eager, await collect(lagging_stream)

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
    steps = Permits()
    engine = make(runner=FakeRunner(steps=steps.semaphore))

    async def main() -> list[Delta]:
        stream = paced(await engine.submit([10, 30], GenerationParams(max_tokens=100)), interval)
        steps.release()
        first = await anext(stream)
        steps.release(30)
        await until(lambda: engine.counters.finished.get("stop") == 1)
        engine.stop()  # joins the reader: every delta it published is scheduled on this loop
        await asyncio.sleep(0)  # and now delivered
        return [first, *[d async for d in stream]]

    try:
        deltas = asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    assert [d.token_ids for d in deltas] == [[11], list(range(12, 41))]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 30


def test_leaving_a_stream_early_aborts_and_frees_the_slot() -> None:
    steps = Permits()  # the test runs the steps: three tokens read, then the reader leaves
    engine = make(n_slots=1, runner=FakeRunner(steps=steps.semaphore))

    async def main() -> None:
        stream = await engine.submit([10], GenerationParams(max_tokens=1000))
        for _ in range(3):
            steps.release()
            await anext(stream)
        assert engine.num_streams() == 1
        await stream.aclose()  # what a cancelled reader does on client disconnect
        assert engine.num_streams() == 0  # and its Abort is sent: no step has run meanwhile
        steps.release(10)  # ten steps, far fewer than the 997 tokens left: only the abort can end it
        await until(lambda: engine.num_free_slots() == 1)

    try:
        asyncio.run(main())
    finally:
        steps.release(1000)
        engine.stop()
    assert engine.num_free_slots() == 1
    assert engine.counters.finished.get("abort") == 1


def test_full_queue_refuses_at_submit() -> None:
    """One request admitted and held in its step, two waiting, the fourth refused: each submit after
    the first is taken between steps, so the test lets the held step end once for each."""
    steps = Permits()
    engine = make(n_slots=1, max_waiting=2, runner=FakeRunner(steps=steps.semaphore))

    async def between_steps(submit: "asyncio.Future[object]") -> object:
        task = asyncio.ensure_future(submit)
        await asyncio.sleep(0)  # sent
        steps.release()
        return await task

    async def main() -> None:
        held = [await engine.submit([10], GenerationParams(max_tokens=1000))]  # admitted by the next step, which holds
        held += [await between_steps(engine.submit([10], GenerationParams(max_tokens=1000))) for _ in range(2)]  # waiting
        with pytest.raises(QueueFullError, match="waiting queue holds 2 requests"):
            await between_steps(engine.submit([10], GenerationParams(max_tokens=5)))
        assert (engine.num_running(), engine.num_waiting()) == (1, 2)
        for s in held:
            await s.aclose()  # type: ignore[attr-defined]

    try:
        asyncio.run(main())
    finally:
        steps.release(10_000)
        engine.stop()


def test_a_held_step_released_once_its_requests_are_counted_open_takes_them_in_together(tmp_path: Path) -> None:
    """Armed with an open_count_file, the AsyncEngine writes how many requests are open after
    sending each Submit: a step released once it reads 3 takes both requests sent while it was
    held before it steps again, so with one waiting place the third is refused."""
    release, counted = tmp_path / "release", tmp_path / "open"
    engine = AsyncEngine(functools.partial(faulty_engine, 1, 1))

    async def main() -> None:
        engine.arm_fault("stall", 1, None, release, open_count_file=counted)
        first = await engine.submit([10], GenerationParams(max_tokens=1000))  # its step holds
        assert counted.read_text() == "1"
        second = asyncio.ensure_future(engine.submit([10], GenerationParams(max_tokens=1000)))
        await until(lambda: counted.read_text() == "2")
        third = asyncio.ensure_future(engine.submit([10], GenerationParams(max_tokens=5)))
        await until(lambda: counted.read_text() == "3")
        release.touch()
        with pytest.raises(QueueFullError, match="waiting queue holds 1 requests"):
            await asyncio.wait_for(third, 60)  # a bound on a broken engine
        await (await second).aclose()
        await first.aclose()  # type: ignore[attr-defined]
        engine.arm_fault("stall", 0, None, None)  # armed again, without a file: no more counts
        await until(lambda: idle(engine))
        await (await engine.submit([10], GenerationParams(max_tokens=1))).aclose()  # type: ignore[attr-defined]
        assert counted.read_text() == "3"

    try:
        asyncio.run(main())
    finally:
        release.touch()
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
    assert not engine.alive and not engine._process.is_alive()  # stop() ended the engine's process


def test_an_idle_engine_keeps_reporting_its_state() -> None:
    """Ray drops a gauge not set within two report intervals: an idle loop reports running,
    waiting and KV use without a step, and counts nothing."""
    reports: list[StepReport] = []
    engine = make(on_step=reports.append)

    async def main() -> int:
        await collect(await engine.submit([10, 2], GenerationParams()))
        served, steps = len(reports), engine.counters.steps
        await until(lambda: len(reports) >= served + 2)
        return steps

    try:
        steps = asyncio.run(main())
    finally:
        engine.stop()
    idle = reports[-1]
    assert (idle.batch_size, idle.generated_tokens, idle.running, idle.waiting, idle.kv_cache_usage) == (0, 0, 0, 0, 0.0)
    assert idle.finished == [] and idle.first_token_latencies == []
    assert steps > 0 and engine.counters.steps == steps  # the idle reports are not steps


def test_a_lost_engine_process_ends_every_stream_with_an_error_and_refuses_new_requests() -> None:
    steps = Permits()  # the request's step holds until the process is killed
    engine = make(runner=FakeRunner(steps=steps.semaphore))

    async def main() -> list[Delta]:
        stream = await engine.submit([10], GenerationParams(max_tokens=100))
        engine._process.kill()
        deltas = await collect(stream)
        await until(lambda: not engine.alive)
        with pytest.raises(EngineDeadError):
            await engine.submit([10], GenerationParams(max_tokens=5))
        return deltas

    try:
        deltas = asyncio.run(main())
    finally:
        engine.stop()
    assert deltas[-1].finish_reason == "error" and deltas[-1].error == "the engine's process exited"


def test_an_engine_that_cannot_start_is_an_error_naming_why() -> None:
    with pytest.raises(RuntimeError, match=r"the engine could not start: .*n_slots"):
        make(n_slots=0)
