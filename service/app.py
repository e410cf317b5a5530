"""The Ray Serve application: an ingress (FastAPI) holding handles to the Translator and Generator
deployments, which scale independently.

Serve config: `import_path: service.app:app_builder`, `args:` a ServiceConfig as a mapping.
"""

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from service.api.app import create_api
from service.api.backend import Backends
from service.config import ModelServingConfig, ServiceConfig
from service.deployments import ModelDeployment
from service.metrics import request_failure_counter

READY_TIMEOUT_S = 2.0


class RayBackend:
    """A model deployment reached through its DeploymentHandle, streaming."""

    def __init__(self, handle: DeploymentHandle[Any]) -> None:
        self.handle = handle

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        response: Any = self.handle.options(stream=True).generate.remote(payload)
        try:
            async for item in response:
                yield item
        finally:
            response.cancel()  # a no-op once finished; stops the replica's work if the client left

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


def model_deployment(name: str, config: ModelServingConfig) -> Application:
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        "health_check_period_s": 10,
        "graceful_shutdown_timeout_s": 60,
    }
    if config.autoscaling_config is not None:
        options["autoscaling_config"] = config.autoscaling_config
    else:
        options["num_replicas"] = config.num_replicas
    deployment: Any = serve.deployment(ModelDeployment)
    return deployment.options(**options).bind(config)


def build_app(config: ServiceConfig) -> Application:
    translator = model_deployment("Translator", config.translator)
    generator = model_deployment("Generator", config.generator)
    ingress: Any = Ingress
    return ingress.options(max_ongoing_requests=4096, max_queued_requests=config.ingress_max_queued_requests).bind(
        config, translator, generator
    )


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for Serve config files (`import_path: service.app:app_builder`)."""
    return build_app(ServiceConfig.model_validate(args))
