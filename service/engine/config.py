"""The engine's limits and defaults, and the words its callers share with it (the batching policy,
why a request finished), in one place. No torch here: the serving config that holds an
EngineConfig, and the wire protocol, are read by processes that never load a model."""

from dataclasses import dataclass
from typing import Literal

BatchingPolicy = Literal["continuous", "static"]
# Why a request ended: eos or a stop string, its token limit, the caller left, the model failed, a deadline.
FinishReason = Literal["stop", "length", "abort", "error", "timeout"]


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 32  # concurrent sequences (beams count one each): the KV cache's rows
    max_waiting: int = 64  # waiting queue bound: beyond it, requests are refused at once (429)
    max_prefill_tokens: int = 4096  # prompt tokens admitted per step
    policy: BatchingPolicy = "continuous"
    max_tokens_cap: int | None = None  # the most tokens one request may ask for (None: what the context allows)
    # Output length when a request sets none (None: the runner's, e.g. what the context allows for
    # the generator, twice the source plus ten for the translator); capped by the limit above.
    default_max_tokens: int | None = None
    # Deadlines from arrival, checked every step: waiting for admission, and until the last token.
    # Past one, the request ends with reason "timeout" and its slots are freed. The total stays
    # below Serve's request_timeout_s (deploy/serve_config.yaml) so the engine ends a request first.
    queue_timeout_s: float | None = 60.0
    request_timeout_s: float | None = 240.0

    def __post_init__(self) -> None:
        if self.n_slots < 1 or self.max_waiting < 1 or self.max_prefill_tokens < 1:
            raise ValueError("n_slots, max_waiting and max_prefill_tokens must be at least 1 (a request waits before it runs)")
        if (self.max_tokens_cap is not None and self.max_tokens_cap < 1) or (
            self.default_max_tokens is not None and self.default_max_tokens < 1
        ):
            raise ValueError("max_tokens_cap and default_max_tokens must be at least 1")
