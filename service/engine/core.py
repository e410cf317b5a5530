"""The engine's process (vLLM's EngineCore): the Engine steps in a process of its own, so that its
loop shares no GIL with the replica's streaming. AsyncEngine (async_engine.py) starts it and talks
to it through one pipe: a message per submit, abort or fault in; per loop iteration at most one
message of verdicts (each submitted request queued or refused) and one of the step (its deltas, its
report, the engine's state) out.

The process builds its Engine with the picklable `build` it is given (EngineSpec for a served
model), answers with ModelInfo (what the replica needs of the model: the tokenizer, special ids,
sizes) and then loops until told to stop, until its parent's end of the pipe closes, or until its
parent process is gone. A structured output's grammar is compiled on a thread of this process
(the step loop never waits for one) and its request queued when it is ready.
"""

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import llguidance
import torch

from loading.checkpoint import WeightType
from loading.tokenizer import TextTokenizer
from service.engine.config import EngineConfig
from service.engine.engine import Engine, EngineCounters, StepReport
from service.engine.errors import InvalidRequestError, QueueFullError
from service.engine.faults import FaultInjectingRunner, FaultKind
from service.engine.request import Delta, GenerationParams, Request
from service.engine.runner import ModelRunner, prompt_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the replica needs of the engine's model, sent once by the engine's process."""

    tokenizer: TextTokenizer
    eos_id: int
    bos_id: int | None  # a generator's; None for a translator, whose decoder starts from its own id
    pad_id: int
    max_len: int
    kv_cache_bytes: int
    kv_blocks: tuple[int, int] | None  # paged KV: (usable blocks, tokens per block); None: slots
    n_slots: int

    @classmethod
    def of(cls, runner: ModelRunner, n_slots: int) -> "ModelInfo":
        pool = runner.kv_pool
        blocks = None if pool is None else (pool.num_blocks - 1, pool.block_size)
        return cls(runner.tokenizer, runner.eos_id, runner.bos_id, runner.pad_id, runner.max_len, runner.kv_cache_bytes, blocks, n_slots)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as the engine's runner reads them (ModelRunner.encode_prompt)."""
        return prompt_ids(self.tokenizer, text, self.bos_id, self.eos_id)


@dataclass(frozen=True)
class EngineState:
    """The engine's queues and counters as its process last told them: after a step, or after the
    requests it took between two steps were queued (what stats and the gauges read)."""

    running: int = 0
    waiting: int = 0  # queued, or having its grammar compiled
    free_slots: int = 0
    counters: EngineCounters = field(default_factory=EngineCounters)


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    arrival_time: float  # time.monotonic() at submit: the clock is the machine's, shared by both processes


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ArmFault:
    kind: FaultKind
    steps: int
    stall_s: float | None
    release_file: Path | None


@dataclass(frozen=True)
class Ready:
    info: ModelInfo
    state: EngineState


@dataclass(frozen=True)
class StartFailed:
    problem: str  # the exception and its traceback


@dataclass(frozen=True)
class Verdicts:
    """Submitted requests queued (None) or refused (InvalidRequestError or QueueFullError), and the
    state once they are queued (before the step that admits them)."""

    items: list[tuple[str, Exception | None]]
    state: EngineState


@dataclass(frozen=True)
class Stepped:
    """A step's deltas and report (an idle loop's report: no deltas), and the state after it."""

    deltas: list[Delta]
    report: StepReport
    state: EngineState


STOP = None  # the message that ends the loop


@dataclass(frozen=True)
class EngineSpec:
    """A served model's Engine, built in the engine's process: loaded from its checkpoint, run
    through a FaultInjectingRunner when fault_injection (tests), warmed up with one short request."""

    checkpoint: Path
    config: EngineConfig
    device: str
    dtype: WeightType
    fault_injection: bool = False
    torch_threads: int | None = None

    def __call__(self) -> Engine:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        engine = Engine.from_checkpoint(self.checkpoint, self.config, self.device, self.dtype)
        if self.fault_injection:
            engine.runner = FaultInjectingRunner(engine.runner)
        engine.add_request(Request("warm-up", engine.runner.encode_prompt("A"), GenerationParams(max_tokens=2)))
        while engine.has_work:  # the first user request does not pay for lazy init
            engine.step()
        return engine


def run_engine_core(conn: Connection, build: Callable[[], Engine]) -> None:
    """The engine process's entry point."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s engine-core %(process)d -- %(message)s")
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), name="parent-watch", daemon=True).start()
    try:
        engine = build()
    except BaseException as error:
        conn.send(StartFailed(f"{error!r}\n{traceback.format_exc()}"))
        return
    core = EngineCore(engine, conn)
    conn.send(Ready(ModelInfo.of(engine.runner, engine.config.n_slots), core.state()))
    core.run()


def _exit_with(parent: int) -> None:
    """Ends this process once its parent is gone (killed mid-step: the pipe says nothing then)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


class EngineCore:
    """The loop: take the pipe's messages, queue what is ready, step, send what the step made."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._report: StepReport | None = None
        engine.on_step = self._keep_report
        self._compiling: dict[str, tuple[Request, Future[llguidance.LLMatcher]]] = {}
        self._compiler = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._verdicts: list[tuple[str, Exception | None]] = []

    def _keep_report(self, report: StepReport) -> None:
        self._report = report

    def state(self) -> EngineState:
        scheduler = self.engine.scheduler
        waiting = len(scheduler.waiting) + len(self._compiling)
        return EngineState(len(scheduler.running), waiting, scheduler.slots.num_free, self.engine.counters)

    def run(self) -> None:
        while True:
            busy = self.engine.has_work
            if self.conn.poll(0 if busy else 0.005 if self._compiling else 1.0):
                if not self._take_messages():
                    break
            elif not busy and not self._compiling:
                self.engine.report_idle()  # a second without work: the state, for the gauges
            self._queue_compiled()
            if self._verdicts:
                self.conn.send(Verdicts(self._verdicts, self.state()))
                self._verdicts = []
            deltas: list[Delta] = []
            if self.engine.has_work:
                try:
                    deltas = self.engine.step().deltas  # a model failure fails that step's requests only
                except Exception:
                    log.exception("engine step raised outside the model; continuing")
            if self._report is not None:
                self.conn.send(Stepped(deltas, self._report, self.state()))
                self._report = None
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.engine.grammars.checker.close()

    def _take_messages(self) -> bool:
        """Handles every message waiting; False when the loop is to end."""
        while self.conn.poll(0):
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the parent's end closed
                return False
            if message is STOP:
                return False
            if isinstance(message, Submit):
                self._submit(message)
            elif isinstance(message, Abort):
                self._compiling.pop(message.request_id, None)
                self.engine.abort(message.request_id)
            elif isinstance(message, ArmFault):
                runner = self.engine.runner
                assert isinstance(runner, FaultInjectingRunner), "the replica arms faults only where its engine has them"
                runner.arm(message.kind, message.steps, message.stall_s, message.release_file)
        return True

    def _submit(self, message: Submit) -> None:
        """Checks and queues the request, or starts its grammar's compile; a refusal is a verdict."""
        request = Request(message.request_id, message.prompt_ids, message.params, arrival_time=message.arrival_time)
        scheduler = self.engine.scheduler
        try:
            request.params = self.engine.resolve(request.prompt_ids, request.params)
            problem = scheduler.queue_full(len(scheduler.waiting) + len(self._compiling), scheduler.waiting_tokens, request)
            if problem is not None:
                raise QueueFullError(problem)
        except (InvalidRequestError, QueueFullError) as error:
            self._verdicts.append((request.request_id, error))
            return
        structured = request.params.structured
        if structured is None:
            self._queue(request)
        else:
            self._compiling[request.request_id] = (request, self._compiler.submit(self.engine.grammars.matcher, structured))

    def _queue_compiled(self) -> None:
        for request_id, (request, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            error = compiled.exception()
            if error is None:
                request.grammar = compiled.result()
                self._queue(request)
            else:  # InvalidRequestError: a grammar this model cannot serve
                self._verdicts.append((request_id, error if isinstance(error, Exception) else RuntimeError(repr(error))))

    def _queue(self, request: Request) -> None:
        try:
            self.engine.queue(request)
        except QueueFullError as error:
            self._verdicts.append((request.request_id, error))
            return
        self._verdicts.append((request.request_id, None))
