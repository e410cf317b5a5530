"""The engine: step() = schedule -> execute -> update. Synchronous and single-threaded; see
async_engine.py for the front that serves many callers."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.checkpoint import load_checkpoint
from model.tokenizer import EOS_ID
from model.translator import Translator
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.errors import InvalidRequestError
from service.engine.request import Delta, FinishReason, Request
from service.engine.runner import ModelRunner, StepResult, runner_for
from service.engine.scheduler import BatchingPolicy, Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 32  # concurrent sequences (beams count one each): the KV cache's rows
    max_waiting: int = 256  # waiting queue bound: beyond it, requests are refused at once
    max_prefill_tokens: int = 4096  # prompt tokens admitted per step
    policy: BatchingPolicy = "continuous"
    max_tokens_cap: int | None = None  # the most tokens one request may ask for (None: what the context allows)


@dataclass(frozen=True)
class FinishedRecord:
    reason: FinishReason
    queue_seconds: float | None  # arrival -> admission; None when it never left the queue
    e2e_seconds: float  # arrival -> finish


@dataclass
class StepReport:
    """What one step did, for metrics and benchmarks. Latencies are in seconds."""

    batch_size: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0  # prompt / encoder pass of the admitted requests
    generated_tokens: int = 0
    first_token_latencies: list[float] = field(default_factory=list)  # arrival -> first token
    inter_token_latencies: list[float] = field(default_factory=list)  # previous token -> this one
    finished: list[FinishedRecord] = field(default_factory=list)
    running: int = 0  # after the step
    waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class EngineCounters:
    steps: int = 0
    batch_size_sum: int = 0
    max_batch_size: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, strip_leading_space: bool = False) -> None:
        self.runner = runner
        self.config = config
        self.scheduler = Scheduler(config.n_slots, config.max_waiting, config.max_prefill_tokens, config.policy)
        self.strip_leading_space = strip_leading_space
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.counters = EngineCounters()
        self.on_step: Callable[[StepReport], None] | None = None  # e.g. metrics; called from the stepping thread
        self._report = StepReport()

    @classmethod
    def from_checkpoint(cls, directory: Path, config: EngineConfig, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "Engine":
        model, tokenizer = load_checkpoint(directory, device, dtype)
        # Sentence tokenizers start a sentence with a word-boundary space; plays keep their layout.
        return cls(runner_for(model, tokenizer, config.n_slots), config, strip_leading_space=isinstance(model, Translator))

    def max_tokens_limit(self, prompt_length: int) -> int:
        """The most tokens a request with this prompt may ask for."""
        limit = self.runner.max_new_tokens(prompt_length)
        return limit if self.config.max_tokens_cap is None else min(limit, self.config.max_tokens_cap)

    def validate(self, prompt_ids: list[int], max_tokens: int, beam_size: int, n_best: int) -> None:
        """Raises InvalidRequestError for a request this engine could never serve."""
        if not prompt_ids:
            raise InvalidRequestError("the input is empty after tokenization", "prompt")
        if len(prompt_ids) > self.runner.max_prompt_len:
            raise InvalidRequestError(f"the input has {len(prompt_ids)} tokens; the limit is {self.runner.max_prompt_len}", "prompt")
        limit = self.max_tokens_limit(len(prompt_ids))
        if max_tokens < 1 or max_tokens > limit:
            raise InvalidRequestError(f"max_tokens must be between 1 and {limit} for this input ({len(prompt_ids)} tokens)", "max_tokens")
        if beam_size < 1 or beam_size > self.config.n_slots:
            raise InvalidRequestError(f"beam_size must be between 1 and {self.config.n_slots}", "beam_size")
        if n_best < 1 or n_best > beam_size:
            raise InvalidRequestError("alternatives must be fewer than the beam size", "n_best")

    def add_request(self, request: Request) -> None:
        """Validates and queues; raises InvalidRequestError or QueueFullError without queueing."""
        p = request.params
        self.validate(request.prompt_ids, p.max_tokens, p.beam_size, p.n_best)
        self.scheduler.add(request)
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.runner.tokenizer, p.stop, self.strip_leading_space)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Delta]:
        """One iteration: admit, run one token for every running sequence, emit deltas.

        An exception from the model fails only the requests of this step; it is re-raised after
        they have been finished with reason "error", so the caller can report it and go on.
        """
        self._report = StepReport()
        plan = self.scheduler.schedule()
        deltas = [self._finish(r, "abort") for r in plan.aborted]
        if plan.is_empty:
            self._publish_report(plan)
            return deltas
        try:
            results = self.runner.execute(plan)
        except Exception as error:
            log.exception("step failed; failing its %d requests", plan.batch_size)
            for r in plan.prefill + plan.decode:
                self.scheduler.finish(r, "error")
                deltas.append(self._finish(r, "error", error=f"internal error: {type(error).__name__}"))
            self._publish_report(plan)
            raise StepError(deltas) from error
        now = time.monotonic()
        for r in plan.prefill + plan.decode:
            delta = self._update(r, results[r.request_id], now)
            if delta is not None:
                deltas.append(delta)
        self._publish_report(plan)
        return deltas

    def _publish_report(self, plan: SchedulerOutput) -> None:
        report = self._report
        report.batch_size = plan.batch_size
        report.prefill_tokens = sum(len(r.prompt_ids) for r in plan.prefill)
        report.prefill_seconds = self.runner.last_prefill_seconds if plan.prefill else 0.0
        report.running, report.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        report.kv_cache_usage = self.scheduler.kv_usage
        if plan.batch_size:
            self.counters.steps += 1
            self.counters.batch_size_sum += plan.batch_size
            self.counters.max_batch_size = max(self.counters.max_batch_size, plan.batch_size)
        if self.on_step is not None:
            self.on_step(report)

    def _token_timing(self, r: Request, now: float, tokens: int) -> None:
        if r.first_token_time is None:
            r.first_token_time = now
            self._report.first_token_latencies.append(now - r.arrival_time)
        else:
            self._report.inter_token_latencies.append(now - r.last_token_time)
        r.last_token_time = now
        self._report.generated_tokens += tokens

    def _update(self, r: Request, result: StepResult, now: float) -> Delta | None:
        if result.hypotheses is not None:
            best = result.hypotheses[0].tokens
            self._token_timing(r, now, len(best))
            r.output_ids = best
            reason: FinishReason = "length" if len(best) >= r.params.max_tokens else "stop"
            texts = [self.runner.tokenizer.decode(h.tokens) for h in result.hypotheses]
            self.scheduler.finish(r, reason)
            return self._finish(r, reason, text=texts[0], alternatives=texts[1:])
        if result.token is None:
            return None  # a beam search still running: nothing to stream
        self._token_timing(r, now, 1)
        if result.token == EOS_ID:
            self.scheduler.finish(r, "stop")
            return self._finish(r, "stop")
        r.output_ids.append(result.token)
        detokenizer = self._detokenizers[r.request_id]
        text = detokenizer.add(result.token)
        if detokenizer.stopped:
            self.scheduler.finish(r, "stop")
            return self._finish(r, "stop", text=text, token_ids=[result.token])
        if len(r.output_ids) >= r.params.max_tokens:
            self.scheduler.finish(r, "length")
            return self._finish(r, "length", text=text, token_ids=[result.token])
        return Delta(r.request_id, text, [result.token], None, prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.output_ids))

    def _finish(
        self,
        r: Request,
        reason: FinishReason,
        text: str = "",
        token_ids: list[int] | None = None,
        alternatives: list[str] | None = None,
        error: str | None = None,
    ) -> Delta:
        detokenizer = self._detokenizers.pop(r.request_id, None)
        if detokenizer is not None and reason in ("stop", "length") and not alternatives and r.params.beam_size == 1:
            text += detokenizer.flush()
        self.runner.release(r)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        now = time.monotonic()
        queue_seconds = r.scheduled_time - r.arrival_time if r.scheduled_time is not None else None
        self._report.finished.append(FinishedRecord(reason, queue_seconds, now - r.arrival_time))
        return Delta(
            r.request_id,
            text,
            token_ids or [],
            reason,
            alternatives=alternatives if r.params.beam_size > 1 else None,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            error=error,
        )


class StepError(Exception):
    """A step failed; `deltas` finish its requests with reason "error"."""

    def __init__(self, deltas: list[Delta]) -> None:
        super().__init__("engine step failed")
        self.deltas = deltas
