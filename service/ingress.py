"""The ingress deployment: validates and routes HTTP requests to the model deployments through
their handles. It imports no engine and no tensor library (tests/test_layering.py checks it): a
process that only routes HTTP stays small."""

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.api.app import create_api
from service.api.backend import Backends
from service.config import ServiceConfig
from service.metrics import request_failure_counter
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest, Refusal

READY_TIMEOUT_S = 2.0


class RayBackend:
    """A model deployment reached through its DeploymentHandle, streaming."""

    def __init__(self, handle: DeploymentHandle[Any]) -> None:
        self.handle = handle

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        response: Any = self.handle.options(stream=True).generate.remote(request)
        try:
            async for item in response:
                yield item
        finally:
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
        backends = Backends(RayBackend(translator), RayBackend(generator))
        self.failures = request_failure_counter()
        self.config = config
        self.api = create_api(config, backends, self.count_failure)

    def count_failure(self, path: str, reason: str) -> None:
        """Requests refused by the ingress itself (validation), by the model the route serves."""
        model = self.config.generator.name if path.startswith("/v1/completions") else self.config.translator.name
        self.failures.inc(1, tags={"model": model, "reason": reason})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.api
