"""The ingress deployment: validates and routes HTTP requests to the model deployments through
their handles. It imports no engine and no tensor library (tests/test_layering.py checks it): a
process that only routes HTTP stays small."""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from service.api.app import ROUTERS, create_api
from service.api.backend import Backends, ModelLoad, model_of_path
from service.config import ModelServingConfig, ServiceConfig
from service.metrics import request_failure_counter
from service.process import process_stats
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest, Refusal

READY_TIMEOUT_S = 2.0


class RayBackend:
    """A model deployment reached through its DeploymentHandle, streaming."""

    def __init__(self, handle: DeploymentHandle[Any], load: ModelLoad, retry_after_s: float, on_failure: Callable[[str], None]) -> None:
        """load: the model's load as this ingress sees it (Backends.load), kept here: requests in
        flight, and a refusal by Serve's queue marked for retry_after_s. on_failure(reason) counts
        what no replica counted: the refusals made here or by Serve ("overloaded"; "internal"
        when no replica is up), and a stream that broke after it began ("internal": its replica
        died or failed)."""
        self.handle, self.load, self.retry_after_s, self.on_failure = handle, load, retry_after_s, on_failure
        self.streaming = handle.options(stream=True)  # made once: options() builds a new handle

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        """The replica's stream. A full model (ModelLoad.full) is refused here without a trip to
        Serve; Serve's own refusals before any item (its queue for the model is full, or no
        replica is up) become protocol Refusals too."""
        if self.load.full():  # a request past the admission middleware, e.g. a long text's next sentence
            self.on_failure("overloaded")
            yield Refusal("overloaded", "the model's queue is full; retry later")
            return
        response: Any = None
        self.load.in_flight += 1
        try:
            response = self.streaming.generate.remote(request)  # may refuse at once
            async for item in response:
                yield item
            self.load.refused_until = 0.0  # one finished: there is room again
        except BackPressureError:
            response = None  # never assigned: nothing to cancel (cancel() would raise it again)
            self.load.refused_until = time.monotonic() + self.retry_after_s
            self.on_failure("overloaded")
            yield Refusal("overloaded", "the model's queue is full; retry later")
        except DeploymentUnavailableError:
            response = None
            self.on_failure("internal")
            yield Refusal("unavailable", "no replica of the model is available; retry later")
        except Exception:
            self.on_failure("internal")  # the client sees the response cut (no [DONE]); the metric says why
            raise
        finally:
            self.load.in_flight -= 1
            if response is not None:
                response.cancel()  # a no-op once finished; stops the replica's work if the client left

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        result: AttentionMap | Refusal = await self.handle.attention.remote(request)
        return result

    async def ready(self) -> bool:
        return bool(await asyncio.wait_for(self.handle.ready.remote(), READY_TIMEOUT_S))


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """Validates and routes HTTP requests; holds only handles to the model deployments."""

    def __init__(self, config: ServiceConfig, translator: DeploymentHandle[Any], generator: DeploymentHandle[Any]) -> None:
        self.failures = request_failure_counter()
        self.config = config
        self.model_of_path = model_of_path(ROUTERS)

        def backend(handle: DeploymentHandle[Any], model: ModelServingConfig) -> RayBackend:
            def failed(reason: str) -> None:
                self.failures.inc(1, tags={"model": model.name, "reason": reason})

            return RayBackend(handle, ModelLoad(model.max_requests_held), config.retry_after_seconds, failed)

        to_translator, to_generator = backend(translator, config.translator), backend(generator, config.generator)
        backends = Backends(to_translator, to_generator, {"translator": to_translator.load, "generator": to_generator.load})
        # Serve's logger: the access lines land in this replica's log file with Serve's request context.
        self.api = create_api(config, backends, self.count_failure, logging.getLogger("ray.serve"))

    def count_failure(self, path: str, reason: str) -> None:
        """Requests refused by the ingress itself (validation, keys, admission), by the model the
        route declares (MODEL_EXTENSION); "none" for a route that reaches no model."""
        kind = self.model_of_path.get(path)
        model = {"translator": self.config.translator.name, "generator": self.config.generator.name}.get(kind or "", "none")
        self.failures.inc(1, tags={"model": model, "reason": reason})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.api

    async def stats(self) -> dict[str, int]:
        """This replica's process: memory, descriptors, asyncio tasks (for soak tests)."""
        return process_stats()
