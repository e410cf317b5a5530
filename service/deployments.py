"""The model deployment: one engine per replica on one device. Thin: it turns text into token ids,
streams the engine's deltas as plain dicts and reports health; all policy lives in the engine."""

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve

from model.sampling import SamplingParams
from service.config import ModelServingConfig
from service.engine.async_engine import AsyncEngine, paced
from service.engine.engine import Engine, EngineConfig
from service.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from service.engine.request import GenerationParams, Request
from service.metrics import ServingMetrics

log = logging.getLogger("ray.serve")  # Serve writes it to the replica logs

HEARTBEAT_TIMEOUT_S = 30.0


def resolve_device(config: ModelServingConfig) -> tuple[str, torch.dtype]:
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return device, getattr(torch, dtype_name)


def error_item(kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    """kind: invalid | overloaded | unavailable | internal (the HTTP layer maps each to a status)."""
    return {"error": {"kind": kind, "message": message, "param": param}}


class ModelDeployment:
    """A Serve replica holding one AsyncEngine. `generate` yields dicts: either one error item, or
    deltas ending with one whose finish_reason is set."""

    def __init__(self, config: ModelServingConfig) -> None:
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        device, dtype = resolve_device(config)
        engine_config = EngineConfig(
            n_slots=config.n_slots,
            max_waiting=config.max_waiting,
            max_prefill_tokens=config.max_prefill_tokens,
            max_tokens_cap=config.max_tokens_cap,
        )
        engine = Engine.from_checkpoint(config.checkpoint, engine_config, device, dtype)
        self._warm_up(engine)
        self.metrics = ServingMetrics(config.name)
        engine.on_step = self.metrics.record_step
        self.engine = AsyncEngine(engine)
        self.runner = engine.runner
        log.info(
            "%s ready on %s (%s, %d torch threads), KV cache %.1f MB",
            config.name, device, dtype, torch.get_num_threads(), self.runner.kv_cache_bytes / 1e6,
        )  # fmt: skip

    @staticmethod
    def _warm_up(engine: Engine) -> None:
        """One short request end to end, so the first user request does not pay for lazy init."""
        engine.add_request(Request("warm-up", engine.runner.encode_prompt("A"), GenerationParams(max_tokens=2)))
        while engine.has_work:
            engine.step()

    def _params(self, payload: dict[str, Any], prompt_length: int) -> GenerationParams:
        max_tokens = payload.get("max_tokens")  # checked against the limit by the engine, after the prompt
        sampling = SamplingParams(
            temperature=float(payload.get("temperature", 0.0)),
            top_k=int(payload.get("top_k", 0)),
            top_p=float(payload.get("top_p", 1.0)),
            seed=payload.get("seed"),
        )
        return GenerationParams(
            max_tokens=max_tokens
            if max_tokens is not None
            else min(
                self.engine.engine.max_tokens_limit(prompt_length),
                payload.get("default_max_tokens") or self.runner.default_max_tokens(prompt_length),
            ),
            sampling=sampling,
            stop=tuple(payload.get("stop") or ()),
            beam_size=int(payload.get("beam_size", 1)),
            n_best=int(payload.get("n_best", 1)),
            length_penalty=float(payload.get("length_penalty", 1.0)),
        )

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """payload: {"text", "stream"?, "max_tokens"?, "temperature"?, "top_k"?, "top_p"?, "seed"?,
        "stop"?, "beam_size"?, "n_best"?, "length_penalty"?}. Yields the first delta at once, then
        (stream) at most one per `stream_interval_ms`, or (not stream) one with the rest."""
        try:
            prompt_ids = self.runner.encode_prompt(payload["text"])
            params = self._params(payload, len(prompt_ids))
            stream = await self.engine.submit(prompt_ids, params)
        except InvalidRequestError as error:
            self.metrics.record_failure("validation")
            yield error_item("invalid", str(error), error.param)
            return
        except QueueFullError as error:
            self.metrics.record_failure("overloaded")
            yield error_item("overloaded", str(error))
            return
        except EngineDeadError as error:
            self.metrics.record_failure("internal")
            yield error_item("unavailable", str(error))
            return
        interval_s = self.config.stream_interval_ms / 1000 if payload.get("stream") else None
        async for delta in paced(stream, interval_s):
            yield {
                "text": delta.text,
                "finish_reason": delta.finish_reason,
                "alternatives": delta.alternatives,
                "prompt_tokens": delta.prompt_tokens,
                "completion_tokens": delta.completion_tokens,
                "error": delta.error,
            }

    async def ready(self) -> bool:
        return self.engine.alive

    async def stats(self) -> dict[str, Any]:
        """The engine's state, for tests and debugging."""
        counters = self.engine.engine.counters
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "running": self.engine.num_running(),
            "waiting": self.engine.num_waiting(),
            "free_slots": self.engine.engine.scheduler.slots.num_free,
            "steps": counters.steps,
            "batch_size_sum": counters.batch_size_sum,
            "max_batch_size": counters.max_batch_size,
            "finished": dict(counters.finished),
        }

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the loop died or is wedged in a step."""
        if not self.engine.alive:
            raise RuntimeError("engine loop is not running")
        if time.monotonic() - self.engine.last_heartbeat > HEARTBEAT_TIMEOUT_S:
            raise RuntimeError(f"engine loop has not completed a step in {HEARTBEAT_TIMEOUT_S:.0f} s")
