"""The engine's limits and defaults, in one place. No torch here: the serving config that holds
an EngineConfig is read by processes that never load a model."""

from dataclasses import dataclass
from typing import Literal

BatchingPolicy = Literal["continuous", "static"]


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

    def __post_init__(self) -> None:
        if self.n_slots < 1 or self.max_waiting < 0 or self.max_prefill_tokens < 1:
            raise ValueError("n_slots and max_prefill_tokens must be at least 1, max_waiting at least 0")
        if (self.max_tokens_cap is not None and self.max_tokens_cap < 1) or (
            self.default_max_tokens is not None and self.default_max_tokens < 1
        ):
            raise ValueError("max_tokens_cap and default_max_tokens must be at least 1")
