"""The service's one configuration object. Parsed from a Serve config file's `args` or built by
`python -m service`; nothing reads the environment at import time."""

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from loading.folder import CheckpointError, ModelKind, inspect_folder
from model.config import Quantization
from model.paths import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, DEFAULT_TRANSLATOR_FR
from service.engine.config import EngineConfig, parse_batch_sizes

# Set for Ray's processes before `ray.init` (and in the Dockerfile): a proxy start timeout for busy
# machines, replicas at Ray's daemons' niceness, two malloc arenas, Serve's gRPC transport, Serve's
# logs to files only. Why each, with the measurements: docs/reliability.md, "Ray's environment".
RAY_ENVIRONMENT = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
    "RAY_worker_niceness": "0",
    "MALLOC_ARENA_MAX": "2",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}
# On Linux, Ray turns a node address of 127.0.0.1 into the machine's own address, and its GCS,
# raylet, agents and metrics export then listen on every interface. Its local-only mode (the
# default on macOS and Windows) keeps the node, and all of them, on 127.0.0.1. Ray reads this
# when it is imported, so it is set before: by `python -m service` and the tests, never by a
# cluster's nodes.
LOCAL_RAY_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# Where this service's defaults differ from Serve's: a replica being replaced or scaled in finishes
# the requests it has for up to a minute (make it at least the longest stream), and a rollout starts
# each replacement before its old replica stops. Serve's router queue for a model holds one
# replica's worth (max_ongoing_requests) unless `max_queued_requests` says otherwise.
DEPLOYMENT_DEFAULTS: dict[str, Any] = {"graceful_shutdown_timeout_s": 60.0, "max_surge_percent": 100}
SET_BY_THE_SERVICE = {"name", "max_ongoing_requests", "backpressure_config"}


def checked_serve_options(options: dict[str, Any]) -> dict[str, Any]:
    """options, if Serve's own DeploymentSchema takes them as a deployment's (and they leave the
    service's own, SET_BY_THE_SERVICE, alone); else ValueError naming what is wrong."""
    from ray.serve.schema import DeploymentSchema  # Serve's own check, where a config is read

    unknown = set(options) - set(DeploymentSchema.model_fields)
    if unknown:
        raise ValueError(f"not an option of a Serve deployment: {', '.join(sorted(unknown))}")
    if set(options) & SET_BY_THE_SERVICE:
        raise ValueError(f"set by the service, not in deployment: {', '.join(sorted(SET_BY_THE_SERVICE))}")
    DeploymentSchema.model_validate({"name": "model", **options})
    return options


class ModelServingConfig(BaseModel):
    """One model deployment: its checkpoint, its engine's limits and defaults (per replica), and
    its replicas. Its kind and a translator's languages are read from the checkpoint folder
    (loading/folder.py) unless the entry sets them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # the model id clients see, and its Serve deployment's name
    checkpoint: Path
    kind: ModelKind = "generator"  # read from the folder (_read_the_folder) when the entry leaves it out
    source_lang: str | None = None  # translators: the languages they translate from and into
    target_lang: str | None = None
    device: str = "auto"  # "auto": cuda when the replica has a GPU, else cpu
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    # Linear layers quantized at load into GGUF's blocks (model/quantize.py): int8 (= q8_0), q8_0, q4_0, q4_1.
    # A GGUF file keeps its own types.
    quantization: Quantization | None = None
    engine: EngineConfig = EngineConfig()
    # Serve's options for this model's deployment, with the names and meanings of Serve's deployment
    # schema (num_replicas, autoscaling_config, ray_actor_options, max_queued_requests, health
    # checks, graceful shutdown, max_surge_percent ...), checked by Serve's own DeploymentSchema.
    # Over DEPLOYMENT_DEFAULTS. The service sets max_ongoing_requests (the engine's slots and queue)
    # and backpressure_config itself.
    deployment: dict[str, Any] = {}
    torch_threads: int | None = None  # CPU threads for torch in each replica
    # check_health fails once the engine loop has not come round for this long (a wedged step).
    heartbeat_timeout_s: float = Field(30.0, gt=0)
    fault_injection: bool = False  # tests only: the engine steps through a FaultInjectingRunner (inject_fault())
    # The replica's threads run at this nice value once its engine's process has started at the
    # replica's own: where the two contend for a CPU (2 cores, hundreds of streams), the engine's
    # step, which every stream waits for, gets it (service/process.py lower_priority). 0: the same.
    replica_niceness: int = Field(10, ge=0, le=19)
    # A streamed response sends its first token at once, then at most one piece per interval
    # (tokens made meanwhile travel together; Ray Serve LLM's default is 50 ms). 0: every token alone.
    stream_interval_ms: float = Field(50.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _read_the_folder(cls, data: Any) -> Any:
        """Fills kind and languages the entry leaves out from the checkpoint folder's JSON files."""
        if not isinstance(data, dict) or "checkpoint" not in data:
            return data
        if "kind" in data and (data["kind"] == "generator" or ("source_lang" in data and "target_lang" in data)):
            return data
        try:
            folder = inspect_folder(Path(data["checkpoint"]))
        except CheckpointError as error:
            raise ValueError(str(error)) from None
        filled = {"kind": folder.kind, "source_lang": folder.source_lang, "target_lang": folder.target_lang} | data
        if filled["kind"] == "translator" and not (filled["source_lang"] and filled["target_lang"]):
            raise ValueError(f"{data['checkpoint']}: the folder names no source_lang and target_lang; set them in the model's entry")
        return filled

    @model_validator(mode="after")
    def _quantization_of_a_folder(self) -> "ModelServingConfig":
        if self.quantization is not None and self.checkpoint.suffix == ".gguf":
            raise ValueError(f"{self.checkpoint}: a GGUF file keeps its own weight types; leave quantization out")
        return self

    @field_validator("engine", mode="before")
    @classmethod
    def _compiled_decode_as_text(cls, engine: Any) -> Any:
        """A config file's compiled_decode may be text: "1-64", "1,2,4", "none" (parse_batch_sizes)."""
        if isinstance(engine, dict) and isinstance(engine.get("compiled_decode"), str):
            return engine | {"compiled_decode": parse_batch_sizes(engine["compiled_decode"])}
        return engine

    @field_validator("deployment")
    @classmethod
    def _serve_deployment_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        return checked_serve_options(options)

    @property
    def serve_options(self) -> dict[str, Any]:
        """The keyword arguments of this model's `serve.deployment(...).options()` (but its name)."""
        return {"max_queued_requests": self.max_ongoing_requests, **DEPLOYMENT_DEFAULTS, **self.deployment} | {
            "max_ongoing_requests": self.max_ongoing_requests
        }

    @property
    def max_ongoing_requests(self) -> int:
        """As many requests as the engine's slots and queue hold (one request a slot, as greedy
        requests take): Serve sends no more to a replica. The ingress sends the model no more
        than all its replicas hold (max_requests_held); past Serve's queue its handle refuses at
        once (BackPressureError, a 429). Beam requests take beam_size slots each; those the
        engine refuses itself, also with a 429."""
        return self.engine.n_slots + self.engine.max_waiting

    @property
    def max_requests_held(self) -> int | None:
        """What all replicas hold at once (max_ongoing_requests each), with a fixed number of
        replicas: the ingress sends the model no more and refuses the rest before reading them
        (service/api/backend.py ModelLoad). None when autoscaled: the number of replicas moves,
        and Serve's backpressure is the limit."""
        replicas = self.deployment.get("num_replicas", 1)
        if "autoscaling_config" in self.deployment or not isinstance(replicas, int):
            return None
        return replicas * self.max_ongoing_requests


def shipped_models() -> tuple[ModelServingConfig, ...]:
    """The checkpoints this repository trained and ships (model/checkpoints)."""
    translators = [("transformer-en-de", DEFAULT_TRANSLATOR), ("transformer-en-fr", DEFAULT_TRANSLATOR_FR)]
    return (
        *(ModelServingConfig(name=name, checkpoint=path, engine=EngineConfig(n_slots=64)) for name, path in translators),
        # OpenAI's completions default to 16 tokens when max_tokens is omitted.
        ModelServingConfig(name="transformer-shakespeare", checkpoint=DEFAULT_GENERATOR, engine=EngineConfig(default_max_tokens=16)),
    )


class ServiceConfig(BaseModel):
    # hide_input_in_errors: a misspelt API key must not be printed back in the validation error.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # One Serve deployment each, autoscaled on its own. Requests name a model (`model`), or a
    # translator by its languages; without either, a route takes the first model of its kind.
    models: tuple[ModelServingConfig, ...] = Field(default_factory=shipped_models, min_length=1)
    default_beam_size: int = Field(4, ge=1, le=8)  # translation quality by default; greedy when asked or streaming
    # Prompts are bounded by the model's context (in tokens, by the engine: 400 past it) and the
    # body by max_body_bytes; an attention map (layers x heads x T x T floats) by this.
    max_attention_chars: int = Field(2000, ge=1)
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
    # Serve's own bound on the ingress's queue, a backstop behind ingress_max_in_flight. With direct
    # ingress a request counts as queued from its arrival until the replica's event loop first runs
    # it, so every request of a burst counts at once: a bound below the burst refused /healthz
    # checks with Serve's undocumented 503 (tests/service/test_overload.py).
    ingress_max_queued_requests: int = 4096
    # The ingress's threads run at this nice value, below the engines' processes (as a model
    # replica's, ModelServingConfig.replica_niceness). 0: unchanged.
    ingress_niceness: int = Field(10, ge=0, le=19)
    # Ray actor options of the ingress replica (Serve's ray_actor_options, over {"num_cpus": 0}), e.g.
    # {"resources": {"head": 0.01}} to keep it on a node that is not lost with a worker.
    ingress_actor_options: dict[str, Any] = {}
    ingress_max_in_flight: int = Field(1024, ge=1)  # HTTP requests in the ingress at once; past it, 503 at once
    retry_after_seconds: int = 1
    # A request whose model replica is lost before any of its answer went out is sent again
    # (service/ingress.py): at most this many sends in all, none later than this after the first.
    lost_replica_tries: int = Field(3, ge=1)
    lost_replica_deadline_s: float = Field(30.0, gt=0)
    # API keys (service/api/auth.py); none: no key needed. SecretStr: never shown by repr or dumps.
    api_keys: tuple[SecretStr, ...] = ()
    # The name of an environment variable holding more keys, comma-separated (on a cluster, one set
    # from a Secret, so that the Serve config holds no key); read by app_builder (service/app.py)
    # and by `python -m service`.
    api_keys_env: str | None = None
    # Origins allowed to call the API from a browser (CORS); none: no CORS headers at all.
    cors_origins: tuple[str, ...] = ()
    # The Responses API's stored responses (`store: true`), per ingress replica: at most this many,
    # none kept longer than this (service/api/response_store.py).
    responses_store_max: int = Field(1000, ge=0)
    responses_store_ttl_s: float = Field(3600.0, gt=0)

    @field_validator("models")
    @classmethod
    def _distinct_names(cls, models: tuple[ModelServingConfig, ...]) -> tuple[ModelServingConfig, ...]:
        names = [m.name for m in models]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"model names must be distinct: {', '.join(repeated)} repeated")
        if "Ingress" in names:
            raise ValueError("Ingress is the name of the service's own deployment")
        return models

    def models_of(self, kind: ModelKind) -> list[ModelServingConfig]:
        return [m for m in self.models if m.kind == kind]

    def model_named(self, name: str) -> ModelServingConfig | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def translator(self) -> ModelServingConfig:
        """The first translator: requests that name no model and no language pair go to it."""
        return self._first("translator")

    @property
    def generator(self) -> ModelServingConfig:
        """The first generator: completions that name no model go to it."""
        return self._first("generator")

    def _first(self, kind: ModelKind) -> ModelServingConfig:
        models = self.models_of(kind)
        if not models:
            raise LookupError(f"no {kind} is served")
        return models[0]

    @field_validator("api_keys")
    @classmethod
    def _header_safe_keys(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        if not all(re.fullmatch(r"[!-~]+", k.get_secret_value()) for k in keys):
            raise ValueError("each API key must be printable ASCII without spaces (it travels in an HTTP header)")
        return keys

    @field_validator("ingress_actor_options")
    @classmethod
    def _ingress_actor_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        checked_serve_options({"ray_actor_options": options})
        return options

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: tuple[str, ...]) -> tuple[str, ...]:
        if not all(o == "*" or re.fullmatch(r"https?://[^/\s]+", o) for o in origins):
            raise ValueError('each CORS origin is "*" or scheme://host[:port], without a path')
        return origins

    def with_environment_keys(self, environ: Mapping[str, str]) -> "ServiceConfig":
        """This config with the keys of the variable `api_keys_env` added. A named variable that is
        unset or holds no key is an error: the service would otherwise run without keys."""
        if self.api_keys_env is None:
            return self
        keys = [k.strip() for k in environ.get(self.api_keys_env, "").split(",") if k.strip()]
        if not keys:
            raise ValueError(f"api_keys_env: the environment variable {self.api_keys_env} holds no API key")
        return ServiceConfig.model_validate({**dict(self), "api_keys": [*self.api_keys, *keys], "api_keys_env": None})
