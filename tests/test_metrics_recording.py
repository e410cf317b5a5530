"""The replica's metrics recorder on engine step reports, without a Ray cluster (Ray's metric
objects record locally until a cluster exports them)."""

from service.engine.engine import StepReport
from service.metrics import ServingMetrics


def test_a_step_with_prefix_cache_lookups_and_no_hits_is_recorded() -> None:
    """Ray's counters refuse increments of 0: a step whose lookups all missed must not raise."""
    metrics = ServingMetrics("gen")
    metrics.record_step(StepReport(prefix_cache_queries=96, prefix_cache_hits=0, kv_blocks_used=6, kv_blocks_total=100))
    metrics.record_step(StepReport(prefix_cache_queries=96, prefix_cache_hits=64, preemptions=1))
