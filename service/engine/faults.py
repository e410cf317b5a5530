"""Fault injection for the fault tests: a ModelRunner that runs another's steps, except that steps
armed by `arm` fail or stall. A deployment runs its engine through one only when its configuration
asks for it (ModelServingConfig.fault_injection)."""

import threading
import time
from pathlib import Path
from typing import Literal

from loading.tokenizer import TextTokenizer
from service.engine.runner import ModelRunner, RunnerOutput
from service.engine.scheduler import SchedulerOutput

FaultKind = Literal["error", "stall"]


class FaultInjectingRunner:
    """`runner`'s steps, but each of the next `steps` steps after `arm` raises ("error") or first
    stalls ("stall"): for stall_s seconds (None: forever, a wedged step), or, given release_file,
    until that file exists (a test on the same machine holds the step until it has seen what it
    waits for). Arming is thread-safe: tests arm from the replica's request thread while the
    engine's thread steps."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.tokenizer: TextTokenizer = runner.tokenizer
        self.eos_id, self.eos_ids, self.pad_id, self.max_len = runner.eos_id, runner.eos_ids, runner.pad_id, runner.max_len
        self.bos_id = runner.bos_id
        self.max_prompt_len = runner.max_prompt_len
        self.strip_leading_space = runner.strip_leading_space
        self.kv_pool = runner.kv_pool
        self.compiled = runner.compiled
        self._lock = threading.Lock()
        self._kind: FaultKind = "error"
        self._remaining = 0
        self._stall_s: float | None = None
        self._release_file: Path | None = None

    def arm(self, kind: FaultKind, steps: int = 1, stall_s: float | None = None, release_file: Path | None = None) -> None:
        with self._lock:
            self._kind, self._remaining, self._stall_s, self._release_file = kind, steps, stall_s, release_file

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        with self._lock:
            faulty = self._remaining > 0
            self._remaining -= faulty
            kind, stall_s, release_file = self._kind, self._stall_s, self._release_file
        if faulty and kind == "error":
            raise RuntimeError("injected fault")
        if faulty and release_file is not None:
            while not release_file.exists():
                time.sleep(0.05)
        elif faulty:
            threading.Event().wait(stall_s)  # never set: sleeps stall_s, or forever
        return self.runner.execute(plan)

    def max_new_tokens(self, prompt_length: int) -> int:
        return self.runner.max_new_tokens(prompt_length)

    def encode_prompt(self, text: str) -> list[int]:
        return self.runner.encode_prompt(text)

    def default_max_tokens(self, prompt_length: int) -> int:
        return self.runner.default_max_tokens(prompt_length)

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes
