"""What the engine tests share: a scripted runner and tokenizer, the shipped generator, a driver.

Imports neither Ray, FastAPI nor pydantic (as model/ and service/engine/), so that tests/model and
tests/engine run where those are not installed: the GPU check (benchmarks/gpu.py)."""

import functools
import multiprocessing.synchronize
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from loading.checkpoint import DEFAULT_GENERATOR, load_checkpoint
from loading.tokenizer import EOS_ID, PAD_ID
from model.generator import Generator
from service.engine.engine import Engine
from service.engine.request import Delta, Request
from service.engine.runner import RunnerOutput
from service.engine.scheduler import SchedulerOutput

# --- The engine without a model: a scripted runner and tokenizer ---


class FakeTokenizer:
    """Token i (>= 4) is the text "w<i> "."""

    def piece_bytes(self, token_id: int) -> bytes:
        return f"w{token_id} ".encode() if token_id > EOS_ID else b""

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece_bytes(i).decode() for i in ids)


@dataclass
class FakeClock:
    """time.monotonic's stand-in (monkeypatched) that moves only when a FakeRunner steps: deadlines
    then fall after a known number of steps, whatever the machine's speed."""

    now: float

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRunner:
    """Each request emits prompt_ids[0] + 1, + 2, ... and then EOS after `length` tokens,
    where length is prompt_ids[1] (or forever if the prompt has one token)."""

    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    eos_id: int = EOS_ID
    bos_id: int | None = None
    pad_id: int = PAD_ID
    max_len: int = 1100
    max_prompt_len: int = 100
    strip_leading_space: bool = False
    kv_pool: None = None  # no paged KV: the scheduler admits by slots alone
    compiled: None = None  # no compiled steps
    fail_on: set[str] = field(default_factory=set)  # request ids whose step raises
    executed: list[SchedulerOutput] = field(default_factory=list)
    step_seconds: float = 0.0  # simulated model time per step, added to `clock`
    clock: "FakeClock | None" = None
    # When set, each step first takes one permit: a test decides when steps run, never the
    # machine's speed (a step waits for its permit, holding what it admitted). A spawn context's
    # semaphore where the engine steps in its own process (AsyncEngine).
    steps: "threading.Semaphore | multiprocessing.synchronize.Semaphore | None" = None

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset({self.eos_id})

    def max_new_tokens(self, prompt_length: int) -> int:
        return 1000

    def default_max_tokens(self, prompt_length: int) -> int:
        return 64

    @property
    def kv_cache_bytes(self) -> int:
        return 0

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if self.steps is not None:
            self.steps.acquire()
        if self.clock is not None:
            self.clock.now += self.step_seconds
        self.executed.append(SchedulerOutput(list(plan.prefill), list(plan.decode), list(plan.aborted)))
        if any(r.request_id in self.fail_on for r in plan.prefill + plan.decode):
            raise RuntimeError("injected fault")
        output = RunnerOutput()
        for r in plan.prefill + plan.decode:
            n = len(r.output_ids)
            length = r.prompt_ids[1] if len(r.prompt_ids) > 1 else 10**9
            output.tokens[r.request_id] = [EOS_ID if n >= length else r.prompt_ids[0] + n + 1]
        return output


# --- The engine with the shipped generator ---


@functools.cache
def context_sensitive_generator(device: str = "cpu") -> Generator:
    """The shipped generator (one per device): a random tiny model repeats its last token whatever
    came before, so cache or position bugs would not change its outputs."""
    model, _ = load_checkpoint(DEFAULT_GENERATOR)
    assert isinstance(model, Generator)
    return model.to(device)


def deltas_of(engine: Engine, arrivals: dict[int, list[Request]], max_steps: int = 500) -> dict[str, list[Delta]]:
    """Adds requests at the given step numbers and steps until idle; each request's deltas."""
    deltas: dict[str, list[Delta]] = {r.request_id: [] for rs in arrivals.values() for r in rs}
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        if not engine.has_work and step > max(arrivals):
            break
        for d in engine.step().deltas:
            deltas[d.request_id].append(d)
    return deltas


def run(engine: Engine, arrivals: dict[int, list[Request]], max_steps: int = 500) -> dict[str, list[int]]:
    """deltas_of's token ids per request."""
    return {i: [t for d in ds for t in d.token_ids] for i, ds in deltas_of(engine, arrivals, max_steps).items()}


PROMPTS = [[5, 9, 13, 7], [40], [8, 8, 8, 8, 8, 8, 8, 8, 8], [21, 33], [60, 4, 17]]


def assert_equal_up_to_a_tie(got: list[int], expected: list[int], logits_after: Callable[[list[int]], Tensor], tie: float) -> None:
    """got equals expected (each ends with the same eos, or none), or leaves it at a near-tie:
    where they first differ, logits_after(the common prefix) (V,) scores both choices within tie."""
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if first is None:
        assert got == expected  # one may not stop before the other without choosing differently
        return
    logits = logits_after(expected[:first])
    # Not signed: the translator's expected tokens come from a padded batch, logits_after from one row.
    gap = abs(float(logits[expected[first]] - logits[got[first]]))
    assert gap <= tie, f"token {first}: {got[first]} chosen over {expected[first]}, recomputed logits {gap:.6f} apart"
