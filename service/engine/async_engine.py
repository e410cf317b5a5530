"""The async front (vLLM's AsyncLLM): callers submit from an event loop and read an async stream
of deltas, while the engine steps in a process of its own (core.py); a thread of this process
reads what that process sends and hands each step's deltas to their readers."""

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path

from service.engine.core import (
    STOP,
    Abort,
    ArmFault,
    EngineState,
    ModelInfo,
    Ready,
    StartFailed,
    Stepped,
    Submit,
    Verdicts,
    run_engine_core,
)
from service.engine.engine import Engine, EngineCounters, StepReport
from service.engine.errors import EngineDeadError
from service.engine.faults import FaultKind
from service.engine.request import Delta, GenerationParams

log = logging.getLogger(__name__)

Stream = tuple["asyncio.Queue[Delta]", asyncio.AbstractEventLoop]
Verdict = tuple["asyncio.Future[Exception | None]", asyncio.AbstractEventLoop]


class AsyncEngine:
    """Starts the engine's process with `build` (a picklable callable that returns the Engine:
    core.EngineSpec for a served model) and waits until it is ready (RuntimeError when it could
    not start). on_step: called with each step's report (and an idle engine's, every second), on
    this process's reader thread. The engine's state is what its last message said."""

    def __init__(self, build: Callable[[], Engine], on_step: Callable[[StepReport], None] | None = None) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads (and CUDA)
        self._conn, child = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(child, build), name="engine-core", daemon=True)
        self._process.start()
        child.close()
        try:
            ready = self._conn.recv()
        except EOFError:
            ready = StartFailed(f"the engine's process exited with {self._process.exitcode}")
        if isinstance(ready, StartFailed):
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine could not start: {ready.problem}")
        assert isinstance(ready, Ready)
        self.info: ModelInfo = ready.info
        self.state: EngineState = ready.state
        self.on_step = on_step
        self.last_heartbeat = time.monotonic()  # of the last message from the engine's process
        self._streams: dict[str, Stream] = {}
        self._verdicts: dict[str, Verdict] = {}
        self._open_count_file: Path | None = None  # fault tests: where the number of open requests is written
        self._lock = threading.Lock()  # the two maps and _open_count_file (and its writes)
        self._send_lock = threading.Lock()  # the pipe's sending end (never held with the other)
        self._stopping = threading.Event()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        """The engine's process."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and self._process.is_alive() and not self._stopping.is_set()

    def stop(self) -> None:
        """Ends the engine's process (its loop stops after the step it is in) and the reader."""
        self._stopping.set()
        self._send(STOP)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(timeout=10)

    def num_waiting(self) -> int:
        return self.state.waiting

    def num_running(self) -> int:
        return self.state.running

    def num_free_slots(self) -> int:
        return self.state.free_slots

    def num_streams(self) -> int:
        """Requests submitted through this AsyncEngine and not yet finished or left by their reader
        (a request left has had its Abort sent)."""
        with self._lock:
            return len(self._streams)

    @property
    def counters(self) -> EngineCounters:
        return self.state.counters

    def arm_fault(
        self,
        kind: FaultKind,
        steps: int = 1,
        stall_s: float | None = None,
        release_file: Path | None = None,
        open_count_file: Path | None = None,
    ) -> None:
        """Arms the engine's FaultInjectingRunner (an engine built without one ends its process).
        Given open_count_file, this AsyncEngine writes the number of requests open here to that file
        (replaced whole) after sending each Submit, until armed again: a step held until the count
        is reached ends with all of them in the engine's pipe, which takes them in before its next step."""
        with self._lock:
            self._open_count_file = open_count_file
        self._send(ArmFault(kind, steps, stall_s, release_file))

    def _write_open_count(self) -> None:
        with self._lock:  # held while writing: the file's counts come in the order they were taken
            if self._open_count_file is None:
                return
            written = self._open_count_file.with_name(self._open_count_file.name + ".tmp")
            written.write_text(str(len(self._streams)))
            written.replace(self._open_count_file)

    async def submit(self, prompt_ids: list[int], params: GenerationParams, request_id: str | None = None) -> AsyncGenerator[Delta, None]:
        """Sends the request to the engine and returns its delta stream once the engine has queued it
        (after a structured output's grammar is compiled); raises InvalidRequestError or QueueFullError
        when the engine refuses it, before any model work. Leaving the stream early (a client
        disconnect cancels the reader) aborts the request at the next step."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        verdict: asyncio.Future[Exception | None] = loop.create_future()
        with self._lock:
            self._streams[request_id] = (deltas, loop)
            self._verdicts[request_id] = (verdict, loop)
        self._send(Submit(request_id, prompt_ids, params, time.monotonic()))
        self._write_open_count()
        try:
            error = await verdict
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if error is not None:
            raise error
        return self._stream(request_id, deltas)

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
        self._send(Abort(request_id))  # before its stream goes: num_streams drops once it is sent
        with self._lock:
            self._streams.pop(request_id, None)
            self._verdicts.pop(request_id, None)  # one aborted while its grammar compiles gets none

    def _send(self, message: object) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # OSError: the process is gone (alive says so; the reader fails its streams)
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            self.last_heartbeat = time.monotonic()
            if isinstance(message, Verdicts):
                self.state = message.state
                self._settle(message.items)
            elif isinstance(message, Stepped):
                self.state = message.state
                if self.on_step is not None:
                    self.on_step(message.report)
                self._publish(message.deltas)
        if not self._stopping.is_set():
            log.error("the engine's process exited (code %s): failing its requests", self._process.exitcode)
        self._fail_all()

    def _settle(self, items: list[tuple[str, Exception | None]]) -> None:
        """Resolves submit()'s waits: None (queued) or the refusal."""
        for request_id, error in items:
            with self._lock:
                verdict, loop = self._verdicts.pop(request_id, (None, None))
                if error is not None:
                    self._streams.pop(request_id, None)
            if verdict is not None and loop is not None:
                _call_in(loop, _resolve, verdict, error)

    def _publish(self, deltas: list[Delta]) -> None:
        """Hands a step's deltas to their readers: one wake-up per event loop, not one per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delta], Delta]]] = {}
        with self._lock:
            for delta in deltas:
                target = self._streams.get(delta.request_id)
                if target is None:
                    continue
                if delta.finish_reason is not None:
                    del self._streams[delta.request_id]
                by_loop.setdefault(target[1], []).append((target[0], delta))
        for loop, items in by_loop.items():
            if not _call_in(loop, _deliver, items):  # the caller's event loop has closed: nobody is reading
                for _, delta in items:
                    self.abort(delta.request_id)

    def _fail_all(self) -> None:
        """The engine's process is gone: every waiting submit fails, every open stream ends in an error."""
        with self._lock:
            verdicts, self._verdicts = self._verdicts, {}
            streams, self._streams = self._streams, {}
        for verdict, loop in verdicts.values():
            _call_in(loop, _resolve, verdict, EngineDeadError("the engine loop is not running"))
        for request_id, (deltas, loop) in streams.items():
            _call_in(loop, _deliver, [(deltas, Delta(request_id, "", [], "error", error="the engine's process exited"))])


def _call_in(loop: asyncio.AbstractEventLoop, function: Callable[..., None], *args: object) -> bool:
    """Schedules function(*args) on loop from another thread; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:
        return False
    return True


def _resolve(verdict: "asyncio.Future[Exception | None]", error: Exception | None) -> None:
    if not verdict.done():  # a submit cancelled meanwhile has gone
        verdict.set_result(error)


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
