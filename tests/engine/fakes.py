"""A scripted runner and tokenizer: the scheduler and engine tested without a model."""

import time
from dataclasses import dataclass, field

from model.tokenizer import EOS_ID
from service.engine.request import Request
from service.engine.runner import StepResult
from service.engine.scheduler import SchedulerOutput


class FakeTokenizer:
    """Token i (>= 4) is the text "w<i> "."""

    def piece_bytes(self, token_id: int) -> bytes:
        return f"w{token_id} ".encode() if token_id > EOS_ID else b""

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece_bytes(i).decode() for i in ids)


@dataclass
class FakeRunner:
    """Each request emits prompt_ids[0] + 1, + 2, ... and then EOS after `length` tokens,
    where length is prompt_ids[1] (or forever if the prompt has one token)."""

    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    max_prompt_len: int = 100
    strip_leading_space: bool = False
    fail_on: set[str] = field(default_factory=set)  # request ids whose step raises
    executed: list[SchedulerOutput] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    step_seconds: float = 0.0  # simulated model time per step
    last_prefill_seconds: float = 0.0

    def max_new_tokens(self, prompt_length: int) -> int:
        return 1000

    def default_max_tokens(self, prompt_length: int) -> int:
        return 64

    @property
    def kv_cache_bytes(self) -> int:
        return 0

    def release(self, request: Request) -> None:
        self.released.append(request.request_id)

    def execute(self, plan: SchedulerOutput) -> dict[str, StepResult]:
        time.sleep(self.step_seconds)
        self.executed.append(SchedulerOutput(list(plan.prefill), list(plan.decode), list(plan.aborted)))
        if any(r.request_id in self.fail_on for r in plan.prefill + plan.decode):
            raise RuntimeError("injected fault")
        results = {}
        for r in plan.prefill + plan.decode:
            n = len(r.output_ids)
            length = r.prompt_ids[1] if len(r.prompt_ids) > 1 else 10**9
            results[r.request_id] = StepResult(token=EOS_ID if n >= length else r.prompt_ids[0] + n + 1)
        return results
