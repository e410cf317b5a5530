"""The async front: callers submit from an event loop and read an async stream of deltas while one
thread runs the step loop (torch releases the GIL, so the event loop stays responsive)."""

import asyncio
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from service.engine.engine import Engine, EngineCounters
from service.engine.errors import EngineDeadError, QueueFullError
from service.engine.request import Delta, GenerationParams, Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Submit:
    request: Request
    deltas: "asyncio.Queue[Delta]"
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str


# How long a thread holding the GIL keeps it while another waits (Python's default: 5 ms). The step
# loop gives the GIL up around every torch operation and must take it back to go on: with the
# replica's event loop busy streaming, it would wait up to the interval each time, dozens of times a step.
GIL_SWITCH_INTERVAL_S = 0.0005


class AsyncEngine:
    """Owns an Engine and the thread that steps it. All engine state is touched by that thread only;
    callers talk to it through an inbox. Sets the process's GIL switch interval (GIL_SWITCH_INTERVAL_S)."""

    def __init__(self, engine: Engine) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Submit | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.Queue[Delta], asyncio.AbstractEventLoop]] = {}
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._pending = 0  # submitted, not yet taken from the inbox
        self._pending_tokens = 0  # their Request.cost
        self._pending_lock = threading.Lock()
        self.last_heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.grammars.checker.close()

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def num_free_slots(self) -> int:
        return self.engine.scheduler.slots.num_free

    @property
    def counters(self) -> EngineCounters:
        return self.engine.counters

    async def submit(self, prompt_ids: list[int], params: GenerationParams, request_id: str | None = None) -> AsyncGenerator[Delta, None]:
        """Resolves and checks the parameters, compiles a structured output's grammar off the event
        loop, and queues (raising InvalidRequestError or QueueFullError before any model work),
        then returns the request's delta stream. Leaving
        the stream early (a client disconnect cancels the reader) aborts the request at the next
        step."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        params = self.engine.resolve(prompt_ids, params)
        grammar = None
        if params.structured is not None:  # checked in the grammars' worker process, built on a thread: never on the loop
            grammar = await asyncio.to_thread(self.engine.grammars.matcher, params.structured)
        request = Request(request_id or uuid.uuid4().hex, prompt_ids, params, grammar=grammar)
        scheduler = self.engine.scheduler
        with self._pending_lock:
            problem = scheduler.queue_full(self.num_waiting(), scheduler.waiting_tokens + self._pending_tokens, request)
            if problem is not None:
                raise QueueFullError(problem)
            self._pending += 1
            self._pending_tokens += request.cost
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        self._inbox.put(_Submit(request, deltas, asyncio.get_running_loop()))
        self._wakeup.set()
        return self._stream(request.request_id, deltas)

    async def _stream(self, request_id: str, deltas: "asyncio.Queue[Delta]") -> AsyncGenerator[Delta, None]:
        """Yields the request's deltas; a reader that has fallen behind gets the deltas queued
        meanwhile merged into one, so a loaded server sends fewer, larger pieces (as vLLM does)."""
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                while not deltas.empty():
                    delta = delta.followed_by(deltas.get_nowait())
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wakeup.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Abort):
                self.engine.abort(message.request_id)
                continue
            try:
                with self._pending_lock:  # submit() sees it either pending or waiting, never neither
                    self._pending -= 1
                    self._pending_tokens -= message.request.cost
                    self.engine.queue(message.request)  # resolved by submit()
            except Exception as error:  # validated at submit; a race with the queue bound is all that is left
                delta = Delta(message.request.request_id, "", [], "error", error=str(error))
                message.loop.call_soon_threadsafe(message.deltas.put_nowait, delta)
                continue
            self._streams[message.request.request_id] = (message.deltas, message.loop)

    def _publish(self, deltas: list[Delta]) -> None:
        """Hands a step's deltas to their readers: one wake-up per event loop, not one per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delta], Delta]]] = {}
        for delta in deltas:
            target = self._streams.get(delta.request_id)
            if target is None:
                continue
            stream, loop = target
            if delta.finish_reason is not None:
                del self._streams[delta.request_id]
            by_loop.setdefault(loop, []).append((stream, delta))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's event loop has closed: nobody is reading
                for _, delta in items:
                    self._streams.pop(delta.request_id, None)
                    self.engine.abort(delta.request_id)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.last_heartbeat = time.monotonic()
            self._drain_inbox()
            if not self.engine.has_work:
                if not self._wakeup.wait(timeout=1.0):
                    self.engine.report_idle()
                self._wakeup.clear()
                continue
            try:
                output = self.engine.step()  # a model failure fails that step's requests only
            except Exception:
                log.exception("engine step raised outside the model; continuing")
                continue
            self._publish(output.deltas)


def _deliver(items: list[tuple["asyncio.Queue[Delta]", Delta]]) -> None:
    for stream, delta in items:
        stream.put_nowait(delta)


async def paced(deltas: AsyncGenerator[Delta, None], interval_s: float | None) -> AsyncIterator[Delta]:
    """The first delta at once (it tells the caller the request was admitted), then the rest merged:
    at most one delta per interval_s (0: each as it comes), or with interval_s None one delta that
    holds everything to the end. Fewer, larger pieces cost less to send through Ray and HTTP."""
    async with aclosing(deltas):
        pending: Delta | None = None
        first = True
        async for delta in deltas:
            pending = delta if pending is None else pending.followed_by(delta)
            if interval_s is None and not first and pending.finish_reason is None:
                continue
            yield pending
            pending, first = None, False
            if interval_s and delta.finish_reason is None:
                await asyncio.sleep(interval_s)  # what arrives meanwhile is merged by _stream
