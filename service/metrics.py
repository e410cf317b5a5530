"""Prometheus metrics, defined once and recorded from inside the replicas through
`ray.serve.metrics`, so Ray's per-node endpoint exports them (as `ray_<name>`) with the
`deployment`, `replica` and `application` tags beside Ray's own `ray_serve_*` metrics.

Names follow vLLM's (see ../shared/docs/API.md); labels never carry anything a user sends.
"""

from typing import TYPE_CHECKING, Any

from ray.serve.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:  # the ingress records failures here and must not import the engine (torch)
    from service.engine.engine import StepReport

# Both CPU (tens of ms per token) and GPU (sub-ms) latencies land in distinct buckets.
LATENCY_BUCKETS = [
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
]
# Ray rebuilds a histogram's sum from bucket midpoints, so one bucket per batch size up to 32
# (edges at k + 0.5, midpoint k) keeps rate(sum) / rate(count), the mean batch, exact there.
BATCH_BUCKETS = [k + 0.5 for k in range(33)] + [48.5, 64.5, 96.5, 128.5, 256.5]
FAILURE_REASONS = ("validation", "overloaded", "cancelled", "timeout", "internal", "unavailable")
# An output that could not satisfy its structured output is the request's grammar's failure: a 400.
ENGINE_FAILURES = {"abort": "cancelled", "error": "internal", "timeout": "timeout", "constraint": "validation"}


def request_failure_counter() -> Counter:
    """Also used by the ingress, which refuses malformed requests before any replica sees them."""
    tags: Any = ("model", "reason")
    return Counter("serving_request_failure_total", "Failed requests by reason.", tags)


# What became of requests whose replica was lost (service/ingress.py, RayBackend): "retried" each
# time one is sent again, "answered" when a retried one is answered in full, "unavailable" when the
# tries run out (503), "cut" when a stream had begun (it ends with an error event).
RETRY_OUTCOMES = ("retried", "answered", "unavailable", "cut")


def request_retry_counter() -> Counter:
    """Counted by the ingress, by model and outcome (RETRY_OUTCOMES)."""
    tags: Any = ("model", "outcome")
    return Counter("serving_request_retries_total", "Requests whose replica was lost, by outcome.", tags)


class ServingMetrics:
    """One model's metrics in one replica (or the ingress, which only counts failures)."""

    def __init__(self, model: str) -> None:
        tags = ("model",)
        self.ttft = Histogram("serving_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS, tags)
        self.itl = Histogram("serving_inter_token_latency_seconds", "Time between two tokens of a stream.", LATENCY_BUCKETS, tags)
        self.queue = Histogram("serving_request_queue_time_seconds", "Arrival to admission into the running batch.", LATENCY_BUCKETS, tags)
        self.e2e = Histogram("serving_e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS, tags)
        self.prefill = Histogram(
            "serving_prefill_seconds", "Prompt (generator) or encoder (translator) pass of one step.", LATENCY_BUCKETS, tags
        )
        self.batch_size = Histogram("serving_batch_size", "Sequences in one engine step.", BATCH_BUCKETS, tags)
        # Exact sums (Ray rebuilds a histogram's sum from its buckets): their ratio is the engine's
        # time per sequence in a step, what grows with the number of streams.
        self.step_seconds = Counter("serving_engine_step_seconds_total", "Time in engine steps.", tags)
        self.step_sequences = Counter("serving_engine_step_sequences_total", "Sequences in engine steps, summed.", tags)
        self.running = Gauge("serving_num_requests_running", "Requests in the running batch.", tags)
        self.waiting = Gauge("serving_num_requests_waiting", "Requests in the engine's queue.", tags)
        self.kv_usage = Gauge("serving_kv_cache_usage_ratio", "Fraction of KV-cache blocks (a translator's slots) in use (0-1).", tags)
        # Paged KV only (decoder-only models), with vLLM's meanings: prompt tokens looked up in the
        # prefix cache and found there (vllm:prefix_cache_queries / _hits), blocks held and in all,
        # running requests preempted (vllm:num_preemptions).
        self.prefix_queries = Counter("serving_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", tags)
        self.prefix_hits = Counter("serving_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", tags)
        self.kv_blocks_used = Gauge("serving_kv_cache_blocks_used", "KV-cache blocks held by running requests.", tags)
        self.kv_blocks_total = Gauge("serving_kv_cache_blocks_total", "KV-cache blocks in the pool.", tags)
        self.compiled_sizes = Gauge(
            "serving_compiled_decode_batch_sizes", "Decode batch sizes (rows) running compiled (-1 while they compile).", tags
        )
        self.preemptions = Counter("serving_num_preemptions_total", "Running requests preempted (blocks freed, recomputed later).", tags)
        # Speculative decoding (vLLM's vllm:spec_decode_*): sequences that verified drafts, the drafts,
        # those accepted, and those accepted by position (the first draft, the second, ...).
        self.spec_drafts = Counter("serving_spec_decode_num_drafts_total", "Sequences that verified drafted tokens.", tags)
        self.spec_draft_tokens = Counter("serving_spec_decode_num_draft_tokens_total", "Drafted tokens verified.", tags)
        self.spec_accepted = Counter("serving_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.", tags)
        position_tags: Any = ("model", "position")
        self.spec_accepted_per_pos = Counter(
            "serving_spec_decode_num_accepted_tokens_per_pos_total", "Drafted tokens accepted, by position.", position_tags
        )
        self.prompt_tokens = Counter("serving_prompt_tokens_total", "Prompt tokens admitted.", tags)
        self.generation_tokens = Counter("serving_generation_tokens_total", "Tokens generated.", tags)
        two_tags: Any = ("model", "finished_reason")  # Ray annotates tag_keys as a 1-tuple
        self.success = Counter("serving_request_success_total", "Finished requests by finish reason.", two_tags)
        self.failure = request_failure_counter()
        metrics: list[Counter | Gauge | Histogram] = [
            self.ttft, self.itl, self.queue, self.e2e, self.prefill, self.batch_size, self.step_seconds, self.step_sequences,
            self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens, self.success, self.failure,
            self.prefix_queries, self.prefix_hits, self.kv_blocks_used, self.kv_blocks_total, self.preemptions, self.compiled_sizes,
            self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.spec_accepted_per_pos,
        ]  # fmt: skip
        for metric in metrics:
            metric.set_default_tags({"model": model})
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)  # not compiled_sizes: unknown until the engine's first report

    def record_failure(self, reason: str) -> None:
        assert reason in FAILURE_REASONS, reason
        self.failure.inc(1, tags={"reason": reason})

    def record_step(self, report: "StepReport") -> None:
        """Called by the engine thread after every step."""
        for value in report.first_token_latencies:
            self.ttft.observe(value)
        for value in report.inter_token_latencies:
            self.itl.observe(value)
        if report.batch_size:
            self.batch_size.observe(report.batch_size)
            self.step_seconds.inc(report.step_seconds)
            self.step_sequences.inc(report.batch_size)
        if report.prefill_tokens:
            self.prefill.observe(report.prefill_seconds)
            self.prompt_tokens.inc(report.prefill_tokens)
        if report.generated_tokens:
            self.generation_tokens.inc(report.generated_tokens)
        for record in report.finished:
            if record.queue_seconds is not None:
                self.queue.observe(record.queue_seconds)
            if record.reason in ENGINE_FAILURES:
                self.record_failure(ENGINE_FAILURES[record.reason])
            else:
                self.e2e.observe(record.e2e_seconds)
                self.success.inc(1, tags={"finished_reason": record.reason})
        self.running.set(report.running)
        self.waiting.set(report.waiting)
        self.kv_usage.set(report.kv_cache_usage)
        self.compiled_sizes.set(report.compiled_batch_sizes)
        if report.kv_blocks_total:
            self.kv_blocks_used.set(report.kv_blocks_used)
            self.kv_blocks_total.set(report.kv_blocks_total)
        if report.prefix_cache_queries:
            self.prefix_queries.inc(report.prefix_cache_queries)
        if report.prefix_cache_hits:  # Ray's counters refuse an increment of 0
            self.prefix_hits.inc(report.prefix_cache_hits)
        if report.preemptions:
            self.preemptions.inc(report.preemptions)
        if report.drafts:
            self.spec_drafts.inc(report.drafts)
            self.spec_draft_tokens.inc(report.draft_tokens)
            if sum(report.accepted_per_position):
                self.spec_accepted.inc(sum(report.accepted_per_position))
            for position, accepted in enumerate(report.accepted_per_position):
                if accepted:
                    self.spec_accepted_per_pos.inc(accepted, tags={"position": str(position)})
