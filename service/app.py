"""The Ray Serve application: the ingress (service/ingress.py) holding handles to the Translator
and Generator deployments, which scale independently.

Serve config: `import_path: service.app:app_builder`, `args:` a ServiceConfig as a mapping.
"""

from typing import Any

from ray import serve
from ray.serve import Application

from service.config import ModelServingConfig, ServiceConfig
from service.deployments import ModelDeployment
from service.ingress import Ingress


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
