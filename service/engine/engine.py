"""The engine: step() = schedule -> execute -> update. Synchronous and single-threaded; see
async_engine.py for the front that serves many callers."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from decoding.beam_search import Hypothesis
from loading.checkpoint import WeightType, load_checkpoint
from model.block_quant import set_activation_bits
from model.packed_linear import pack_linear_layers, packing_available
from service.engine.config import EngineConfig, FinishReason, TokenLogprob
from service.engine.detokenizer import IncrementalDetokenizer, PieceBytes
from service.engine.errors import InvalidRequestError
from service.engine.grammar import GrammarCompiler, json_problem
from service.engine.grammar_check import first_line
from service.engine.kv_blocks import KVBlockManager
from service.engine.request import Delta, GenerationParams, Request
from service.engine.runner import ModelRunner, RunnerOutput, runner_for
from service.engine.scheduler import Scheduler, SchedulerOutput
from service.engine.speculation import PromptLookup, RecentOutputs

log = logging.getLogger(__name__)


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
    step_seconds: float = 0.0  # the whole step: schedule, model, sampling, stop checks, deltas
    generated_tokens: int = 0
    first_token_latencies: list[float] = field(default_factory=list)  # arrival -> first token
    inter_token_latencies: list[float] = field(default_factory=list)  # previous token -> this one
    finished: list[FinishedRecord] = field(default_factory=list)
    running: int = 0  # after the step
    waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0  # running requests preempted this step (their blocks freed, recomputed later)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache by the requests admitted
    prefix_cache_hits: int = 0  # of which found cached
    kv_blocks_used: int = 0  # paged KV only: blocks held by running requests
    kv_blocks_total: int = 0
    # Speculative decoding (vLLM's spec_decode counters): sequences that verified drafts, their
    # drafts, and how many were accepted at each position (the first draft, the second, ...).
    drafts: int = 0
    draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    compiled_batch_sizes: int = 0  # decode batch sizes (rows) that run compiled (those that measured faster); -1 while compiling


@dataclass
class StepOutput:
    """What one step returns: every delta it produced, failed requests' included, and its report.
    error: the model raised; the step's requests were finished with reason "error"."""

    deltas: list[Delta]
    report: StepReport
    error: Exception | None = None


@dataclass
class EngineCounters:
    steps: int = 0
    batch_size_sum: int = 0
    max_batch_size: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig) -> None:
        self.runner = runner
        self.config = config
        pool = runner.kv_pool
        self.blocks = None if pool is None else KVBlockManager(pool.num_blocks, pool.block_size, pool.prefix_caching, pool.salt)
        self.scheduler = Scheduler(
            config.n_slots,
            config.max_waiting,
            config.max_num_batched_tokens,
            config.policy,
            config.queue_timeout_s,
            config.request_timeout_s,
            self.blocks,
            decoder_only=pool is not None and not pool.encoder_decoder,
            speculation_max_batch=config.speculation_max_batch,
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pieces = PieceBytes(runner.tokenizer)  # every request's detokenizer reads its tokens' bytes here
        self.grammars = GrammarCompiler(runner.tokenizer, runner.eos_ids, config.grammar_max_bytes, config.grammar_compile_timeout_s)
        self.counters = EngineCounters()
        c = config
        shared = c.num_speculative_tokens > 0 and c.recent_outputs_tokens > 0  # speculation from other requests' outputs
        self.recent = RecentOutputs(c.prompt_lookup_min, c.prompt_lookup_max, c.recent_outputs_tokens) if shared else None
        self.on_step: Callable[[StepReport], None] | None = None  # e.g. metrics; called from the stepping thread
        # What the KV cache holds at once, in tokens: the waiting queue always takes that much.
        self.pool_tokens = (pool.num_blocks - 1) * pool.block_size if pool is not None else config.n_slots * runner.max_len
        self.tokens_per_s: float | None = None  # computed tokens (prompt and generated) per second of busy steps, smoothed
        self.scheduler.waiting_token_budget = self.waiting_token_budget()

    @classmethod
    def from_checkpoint(cls, directory: Path, config: EngineConfig, device: str = "cpu", dtype: WeightType = torch.float32) -> "Engine":
        model, tokenizer = load_checkpoint(directory, device, dtype)
        set_activation_bits(model, config.activation_bits)  # quantized weights' layers, if any
        if torch.device(device).type == "cpu" and dtype == torch.float32 and packing_available():
            pack_linear_layers(model)  # oneDNN GEMMs for the decode steps' many-row batches
        return cls(runner_for(model, tokenizer, config), config)

    def waiting_token_budget(self) -> int | None:
        """The most tokens (prompts and max_tokens) the waiting queue holds: what the engine computes
        in queue_timeout_s at its measured speed, and at least what the KV pool holds. None (the
        count alone bounds it) before a step is measured, or without a queue deadline."""
        if self.config.queue_timeout_s is None or self.tokens_per_s is None:
            return None
        return max(self.pool_tokens, int(self.tokens_per_s * self.config.queue_timeout_s))

    def _measure_speed(self, report: StepReport) -> None:
        """Updates tokens_per_s from a busy step (an exponential average over about 32 steps)."""
        tokens = report.prefill_tokens + report.generated_tokens
        if tokens == 0 or report.step_seconds <= 0:
            return
        speed = tokens / report.step_seconds
        self.tokens_per_s = speed if self.tokens_per_s is None else 0.97 * self.tokens_per_s + 0.03 * speed
        self.scheduler.waiting_token_budget = self.waiting_token_budget()

    def max_tokens_limit(self, prompt_length: int) -> int:
        """The most tokens a request with this prompt may ask for."""
        limit = self.runner.max_new_tokens(prompt_length)
        return limit if self.config.max_tokens_cap is None else min(limit, self.config.max_tokens_cap)

    def resolve(self, prompt_ids: list[int], params: GenerationParams) -> GenerationParams:
        """params with max_tokens decided (the default when None) and checked; raises
        InvalidRequestError for a request this engine could never serve."""
        if not prompt_ids:
            raise InvalidRequestError("the input is empty after tokenization", "prompt")
        if len(prompt_ids) > self.runner.max_prompt_len:
            message = (
                f"This model's maximum context length is {self.runner.max_len} tokens. However, your request has "
                f"{len(prompt_ids)} input tokens (at most {self.runner.max_prompt_len}). Please reduce the length of the input."
            )
            raise InvalidRequestError(message, "prompt")
        limit = self.max_tokens_limit(len(prompt_ids))
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(limit, self.config.default_max_tokens or self.runner.default_max_tokens(len(prompt_ids)))
        else:
            lowest = 0 if params.prompt_logprobs is not None else 1  # 0: the prompt scored alone
            if not lowest <= max_tokens <= limit:
                message = f"max_tokens must be between {lowest} and {limit} for this input ({len(prompt_ids)} tokens)"
                if max_tokens > limit and limit == self.runner.max_new_tokens(len(prompt_ids)):
                    message += (
                        f": this model's maximum context length is {self.runner.max_len} tokens. However, you requested "
                        f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the input, {max_tokens} in the completion)"
                    )
                raise InvalidRequestError(message, "max_tokens")
        if params.beam_size < 1 or params.beam_size > self.config.n_slots:
            raise InvalidRequestError(f"beam_size must be between 1 and {self.config.n_slots}", "beam_size")
        if params.sampling.logit_bias:
            vocab_size = self.runner.tokenizer.vocab_size
            if any(not 0 <= token < vocab_size for token, _ in params.sampling.logit_bias):
                raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
        if not 0 <= params.min_tokens <= max_tokens:
            raise InvalidRequestError(f"min_tokens must be between 0 and max_tokens ({max_tokens})", "min_tokens")
        if params.n_best < 1 or params.n_best > params.beam_size:
            raise InvalidRequestError("alternatives must be fewer than the beam size", "n_best")
        if params.structured is not None:
            if params.beam_size > 1:
                raise InvalidRequestError("a structured output is generated token by token: it cannot take beam search", "beam_size")
            if params.min_tokens:
                raise InvalidRequestError("min_tokens cannot hold back the end of a structured output", "min_tokens")
            if params.ignore_eos:
                raise InvalidRequestError("ignore_eos cannot run past the end of a structured output", "ignore_eos")
        return replace(params, max_tokens=max_tokens)

    def add_request(self, request: Request) -> None:
        """Resolves its parameters, compiles its grammar (on this thread) and queues it; raises
        InvalidRequestError or QueueFullError without queueing."""
        request.params = self.resolve(request.prompt_ids, request.params)
        if request.params.structured is not None:
            request.grammar = self.grammars.matcher(request.params.structured)
        self.queue(request)

    def queue(self, request: Request) -> None:
        """Queues a request whose parameters `resolve` returned, with its grammar's matcher when it
        has a structured output (the engine's thread never compiles); raises QueueFullError
        without queueing. A structured output ends where its grammar does: stop strings do not cut it."""
        assert (request.grammar is None) == (request.params.structured is None), "a structured output's matcher is made by the caller"
        self.scheduler.add(request)
        stop = () if request.params.structured is not None else request.params.stop
        detokenizer = IncrementalDetokenizer(self._pieces, stop, self.runner.strip_leading_space, request.params.min_tokens)
        self._detokenizers[request.request_id] = detokenizer
        c, params = self.config, request.params
        drafting = params.speculate and params.beam_size == 1
        if c.num_speculative_tokens and self.scheduler.decoder_only and drafting:
            request.lookup = PromptLookup(c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> StepOutput:
        """One iteration: admit, run one token for every running sequence, emit deltas.

        An exception from the model fails only the requests of this step: they finish with reason
        "error" and the output carries the exception, so the caller can report it and go on.
        """
        started = time.perf_counter()
        report = StepReport()
        plan = self.scheduler.schedule()
        deltas = [self._finish(r, "abort", report) for r in plan.aborted]
        deltas += [self._finish(r, "timeout", report) for r in plan.timed_out]
        failure: Exception | None = None
        output = RunnerOutput()
        if not plan.is_empty:
            try:
                if self.grammars.in_use:  # the masks are computed while the model runs
                    plan.grammar = self.grammars.masks(plan.prefill + plan.decode, plan.drafts)
                output = self.runner.execute(plan)
            except Exception as error:
                log.exception("step failed; failing its %d requests", plan.batch_size)
                failure = error
                if self.blocks is not None:
                    self.blocks.reset_prefix_cache()  # the step's blocks may hold half-written keys
                for r in plan.prefill + plan.decode:
                    self.scheduler.finish(r, "error")
                    deltas.append(self._finish(r, "error", report, error=f"internal error: {type(error).__name__}"))
            else:
                self.scheduler.advance(plan, output.rejected)
                now = time.monotonic()
                for r in plan.prefill + plan.decode:
                    delta = self._update(r, output, now, report)
                    if delta is not None:
                        deltas.append(delta)
                    parents = output.parents.get(r.request_id)
                    if parents is not None and not r.finished:
                        self.scheduler.fork(r, parents)  # the beams' blocks reordered; the copies go in the next plan
        report.prefill_seconds = output.prefill_seconds
        report.step_seconds = time.perf_counter() - started
        self._publish_report(plan, report)
        self._measure_speed(report)
        return StepOutput(deltas, report, failure)

    def report_idle(self) -> None:
        """Publishes the engine's state (running, waiting, KV use) without a step. The idle loop
        calls it every second: Ray stops exporting a gauge that is not set again within two of its
        report intervals, and a dashboard would show an idle replica as no data instead of 0."""
        self._publish_report(SchedulerOutput(), StepReport())

    def _publish_report(self, plan: SchedulerOutput, report: StepReport) -> None:
        report.batch_size = plan.batch_size
        if self.scheduler.decoder_only:
            report.prefill_tokens = sum(plan.num_tokens[r.request_id] for r in plan.prefill)
        else:  # the sources encoded
            report.prefill_tokens = sum(len(r.prompt_ids) for r in plan.prefill)
        report.running, report.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        report.kv_cache_usage = self.scheduler.kv_usage
        report.preemptions = len(plan.preempted)
        if self.runner.compiled is not None:
            compiled = self.runner.compiled
            report.compiled_batch_sizes = len(compiled.batch_sizes) if compiled.ready.is_set() else -1
        if self.blocks is not None:
            stats = self.blocks.stats
            report.prefix_cache_queries, report.prefix_cache_hits = stats.queries, stats.hits
            stats.queries = stats.hits = 0  # counted once: each report carries its step's
            report.kv_blocks_total = self.blocks.num_blocks - 1
            report.kv_blocks_used = report.kv_blocks_total - self.blocks.num_free
        if plan.batch_size:
            self.counters.steps += 1
            self.counters.batch_size_sum += plan.batch_size
            self.counters.max_batch_size = max(self.counters.max_batch_size, plan.batch_size)
        if self.on_step is not None:
            try:
                self.on_step(report)
            except Exception:  # a metrics failure must not lose the step's deltas
                log.exception("on_step raised; the step's output is delivered regardless")

    @staticmethod
    def _token_timing(r: Request, now: float, tokens: int, report: StepReport) -> None:
        if r.first_token_time is None:
            r.first_token_time = now
            report.first_token_latencies.append(now - r.arrival_time)
        else:
            report.inter_token_latencies.append(now - r.last_token_time)
        r.last_token_time = now
        report.generated_tokens += tokens

    def _update(self, r: Request, output: RunnerOutput, now: float, report: StepReport) -> Delta | None:
        """What r's part of the step means: a beam search that ended, a prompt scored alone, or
        streamed tokens (one, or drafts accepted and the token after them), each checked by its
        grammar, then by the stop conditions (`_ending`); then its next drafts (`_propose`)."""
        hypotheses = output.hypotheses.get(r.request_id)
        if hypotheses is not None:
            return self._beams_ended(r, hypotheses, now, report)
        tokens = output.tokens.get(r.request_id)
        if tokens is None:
            return None  # a beam search still running: nothing to stream
        scored = output.prompt_logprobs.get(r.request_id)  # the prompt's logprobs, at its prefill
        self._token_timing(r, now, 0, report)
        if r.max_tokens == 0:  # the prompt scored alone (GenerationParams.prompt_logprobs)
            return self._end(r, "length", report, prompt_logprobs=scored)
        self._accepted(r, output, len(tokens) - 1, report)
        logprobs = output.logprobs.get(r.request_id)
        detokenizer = self._detokenizers[r.request_id]
        token_ids: list[int] = []
        text = ""
        for i, token in enumerate(tokens):
            report.generated_tokens += 1
            problem = self._grammar_problem(r, [token])
            if problem is None and token in self.runner.eos_ids and not r.params.ignore_eos:
                problem = self._finished_output_problem(r)
                if problem is None:  # the tokens before the eos are the last delta's
                    kept = logprobs[:i] if logprobs is not None else None
                    return self._end(r, "stop", report, text=text, token_ids=token_ids, logprobs=kept, prompt_logprobs=scored)
            if problem is not None:
                return self._end(r, "constraint", report, error=problem)
            r.output_ids.append(token)
            forced = self._fast_forward(r) if i == len(tokens) - 1 else []  # after the step's last token only
            report.generated_tokens += len(forced)
            token_ids += [token, *forced]
            text += "".join(detokenizer.add(t) for t in (token, *forced))
            ending = self._ending(r, detokenizer.stopped)
            if r.grammar is not None and (ending == "stop" or r.grammar.is_error()):
                problem = self._grammar_problem(r, []) or self._finished_output_problem(r)
                if problem is not None:
                    return self._end(r, "constraint", report, error=problem)
            if ending is not None:
                kept = logprobs[: i + 1] if logprobs is not None else None
                return self._end(r, ending, report, text=text, token_ids=token_ids, logprobs=kept, prompt_logprobs=scored)
        self._propose(r)
        return Delta(
            r.request_id,
            text,
            token_ids,
            None,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            logprobs=logprobs,
            prompt_logprobs=scored,
        )

    @staticmethod
    def _accepted(r: Request, output: RunnerOutput, taken: int, report: StepReport) -> None:
        """Counts a verification's drafts (r's, if this step verified some) and adapts r's budget."""
        rejected = output.rejected.get(r.request_id)
        if rejected is None or r.lookup is None:
            return
        r.lookup.accepted(taken + rejected, taken)
        report.drafts += 1
        report.draft_tokens += taken + rejected
        report.accepted_per_position += [0] * (taken - len(report.accepted_per_position))
        for position in range(taken):
            report.accepted_per_position[position] += 1

    def _propose(self, r: Request) -> None:
        """r's drafts for its next step (speculative decoding), within its token limit; none while
        more requests run than a step speculates for (its index catches up when it next proposes)."""
        if r.lookup is None:
            return
        if len(self.scheduler.running) > self.config.speculation_max_batch:
            r.draft_ids = []
            return
        room = r.max_tokens - len(r.output_ids) - 1  # the step's own token comes after them
        drafts = r.lookup.propose(r.token_ids, self.recent)[:room] if room > 0 else []
        if drafts and r.grammar is not None:  # those its grammar allows
            drafts = drafts[: r.grammar.validate_tokens(drafts)]
        r.draft_ids = drafts

    def _beams_ended(self, r: Request, hypotheses: list[Hypothesis], now: float, report: StepReport) -> Delta:
        """A beam search's end: its best hypothesis is the output, the others' texts its alternatives."""
        best = hypotheses[0].tokens
        self._token_timing(r, now, len(best), report)
        r.output_ids = best
        texts = [self.runner.tokenizer.decode(h.tokens) for h in hypotheses]
        return self._end(r, "length" if len(best) >= r.max_tokens else "stop", report, text=texts[0], alternatives=texts[1:])

    def _end(self, r: Request, reason: FinishReason, report: StepReport, **last: Any) -> Delta:
        """Finishes r in the scheduler (its blocks and slots free now), keeps a finished output for
        others' speculation (RecentOutputs), and returns its last delta (`_finish`)."""
        self.scheduler.finish(r, reason)
        if self.recent is not None and r.lookup is not None and reason in ("stop", "length"):
            self.recent.add(r.prompt_ids[-self.config.prompt_lookup_max :] + r.output_ids)
        return self._finish(r, reason, report, **last)

    def _ending(self, r: Request, stop_string: bool) -> FinishReason | None:
        """Why the request ends after its newest tokens, if it does: a stop string, a grammar that
        is complete (only an eos could follow: it is not waited for), its token limit."""
        if stop_string or (r.grammar is not None and r.grammar.is_stopped() and not r.grammar.is_error()):
            return "stop"
        return "length" if len(r.output_ids) >= r.max_tokens else None

    def _grammar_problem(self, r: Request, tokens: list[int]) -> str | None:
        """Why the request's output cannot go on within its structured output with these tokens
        (None when it can, or has none): its grammar failed at this step (a parser limit met, or
        a token refused); the matcher is advanced by them."""
        grammar, output = r.grammar, r.params.structured
        if grammar is None or output is None:
            return None
        if not grammar.consume_tokens(tokens) or grammar.is_error():  # a failed mask leaves the matcher in error
            return f"{output.param}: the output could not go on after {len(r.output_ids)} tokens: {first_line(grammar.get_error())}"
        return None

    def _finished_output_problem(self, r: Request) -> str | None:
        """Why a finished JSON output breaks its schema where the grammar could not see it (None
        when it holds, or is no JSON): service/engine/grammar.py json_problem."""
        output = r.params.structured
        if output is None or output.kind != "json":
            return None
        problem = json_problem(output, self.runner.tokenizer.decode(r.output_ids))
        return None if problem is None else f"{output.param}: the finished output breaks its schema: {problem}"

    def _fast_forward(self, r: Request) -> list[int]:
        """The tokens r's grammar forces next, appended to its output without a model step each
        (llguidance's fast-forward, "jump-forward" decoding): the next step computes them with the
        token it samples after them, as a prompt chunk. Paged KV only; not where logprobs are asked
        (a forced token has none computed). At most what max_tokens leaves."""
        if r.grammar is None or not self.config.grammar_fast_forward or not self.scheduler.decoder_only or r.params.logprobs is not None:
            return []
        forced = r.grammar.compute_ff_tokens()[: r.max_tokens - len(r.output_ids)]
        if forced and self._grammar_problem(r, forced) is None:
            r.output_ids += forced
            return forced
        return []

    def _finish(
        self,
        r: Request,
        reason: FinishReason,
        report: StepReport,
        text: str = "",
        token_ids: list[int] | None = None,
        alternatives: list[str] | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> Delta:
        detokenizer = self._detokenizers.pop(r.request_id, None)
        if detokenizer is not None and reason in ("stop", "length") and not alternatives and r.params.beam_size == 1:
            text += detokenizer.flush()
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        now = time.monotonic()
        queue_seconds = r.scheduled_time - r.arrival_time if r.scheduled_time is not None else None
        report.finished.append(FinishedRecord(reason, queue_seconds, now - r.arrival_time))
        return Delta(
            r.request_id,
            text,
            token_ids or [],
            reason,
            alternatives=alternatives if r.params.beam_size > 1 else None,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            error=error,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
