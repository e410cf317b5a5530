"""The service's one configuration object. Parsed from a Serve config file's `args` or built by
`python -m service`; nothing reads the environment at import time."""

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from model.paths import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.engine.config import EngineConfig

# Ray Serve's proxy must start within 5 s by default; on a busy 2-core machine it may not, and is
# then killed and restarted in a loop. These are set for Ray's processes before `ray.init`.
RAY_ENVIRONMENT = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


class ModelServingConfig(BaseModel):
    """One model deployment: its checkpoint, its engine's limits and defaults (per replica), and
    its replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # the model id clients see
    checkpoint: Path
    device: str = "auto"  # "auto": cuda when the replica has a GPU, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    engine: EngineConfig = EngineConfig()
    num_replicas: int | str = 1  # or "auto" with autoscaling_config
    autoscaling_config: dict[str, Any] | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int | None = None  # CPU threads for torch in each replica
    # A streamed response sends its first token at once, then at most one piece per interval
    # (tokens made meanwhile travel together; Ray Serve LLM's default is 50 ms). 0: every token alone.
    stream_interval_ms: float = Field(50.0, ge=0)

    @property
    def max_ongoing_requests(self) -> int:
        """Serve must pass enough requests for the engine's batch and queue to fill; the engine
        itself refuses beyond that, fast."""
        return self.engine.n_slots + self.engine.max_waiting + 8


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    translator: ModelServingConfig = ModelServingConfig(
        name="transformer-en-de", checkpoint=DEFAULT_TRANSLATOR, engine=EngineConfig(n_slots=64)
    )
    # OpenAI's completions default to 16 tokens when max_tokens is omitted.
    generator: ModelServingConfig = ModelServingConfig(
        name="transformer-shakespeare", checkpoint=DEFAULT_GENERATOR, engine=EngineConfig(default_max_tokens=16)
    )
    default_beam_size: int = Field(4, ge=1, le=8)  # translation quality by default; greedy when asked or streaming
    max_prompt_chars: int = Field(2000, ge=1)  # per completion prompt, checked before tokenizing
    max_batch_texts: int = Field(32, ge=1)  # texts (list items) per translation request
    max_translate_chars: int = Field(5000, ge=1)  # characters per translation request, all texts together
    max_translate_sentences: int = Field(64, ge=1)  # sentences per translation request, all texts together
    # A longer sentence is cut at a clause, else between words; 200 characters stay well inside
    # the translator's 256 source tokens (English runs about 4 characters a token).
    max_sentence_chars: int = Field(200, ge=20)
    # Sentences of one request in the translator at once (the rest wait at the ingress): below
    # what a replica's queue holds, so a long text is never refused on its own.
    sentences_in_flight: int = Field(16, ge=1)
    # return_attention: at most this many sentences per request (each map is layers x heads x T x S floats).
    max_attention_sentences: int = Field(4, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    ingress_max_queued_requests: int = 512
    retry_after_seconds: int = 1
