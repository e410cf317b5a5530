"""The Ray Serve application: the ingress (service/ingress.py) holding handles to one deployment
per served model (named as the model), each scaled on its own.

Serve config: `import_path: service.app:app_builder`, `args:` a ServiceConfig as a mapping.
"""

import os
from typing import Any

from ray import serve
from ray.serve import Application

from service.config import ModelServingConfig, ServiceConfig
from service.deployments import ModelDeployment
from service.ingress import Ingress

# Serve's settings for the service's replicas alone (through their runtime_env), not for the
# process that deploys them: a replica runs its user code and its handles' router on its one event
# loop, so a streamed chunk crosses no thread on its way (docs/reliability.md, "Ray's environment").
# A driver keeps Serve's defaults: it may call handles from synchronous code.
REPLICA_ENVIRONMENT = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def in_replica_environment(actor_options: dict[str, Any]) -> dict[str, Any]:
    """Ray actor options with REPLICA_ENVIRONMENT among their runtime_env's env_vars (theirs win)."""
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = REPLICA_ENVIRONMENT | runtime_env.get("env_vars", {})
    return actor_options | {"runtime_env": runtime_env}


def model_deployment(name: str, config: ModelServingConfig, retry_after_s: int) -> Application:
    # Past max_queued_requests the ingress's handle raises BackPressureError at once (no hop to a
    # replica); RayBackend answers it as a 429 with Retry-After.
    backpressure = {"status_code": 429, "retry_after_s": retry_after_s}
    deployment: Any = serve.deployment(ModelDeployment)
    options = config.serve_options
    options["ray_actor_options"] = in_replica_environment(options.get("ray_actor_options", {}))
    return deployment.options(name=name, backpressure_config=backpressure, **options).bind(config)


def build_app(config: ServiceConfig) -> Application:
    deployments = {m.name: model_deployment(m.name, m, config.retry_after_seconds) for m in config.models}
    ingress: Any = Ingress
    # Every stream passes through the ingress: it drains as long as the slowest model does. It
    # holds no model, so a rollout always starts the new ingress before stopping the old one.
    models = config.models
    return ingress.options(
        max_ongoing_requests=4096,
        max_queued_requests=config.ingress_max_queued_requests,
        # The proxy's own 503 past that queue (a backstop: the ingress refuses first, past
        # ingress_max_in_flight, with the documented body) tells clients when to come back.
        backpressure_config={"status_code": 503, "retry_after_s": config.retry_after_seconds},
        graceful_shutdown_timeout_s=max(m.serve_options["graceful_shutdown_timeout_s"] for m in models),
        graceful_shutdown_wait_loop_s=min(m.serve_options.get("graceful_shutdown_wait_loop_s", 2.0) for m in models),
        max_surge_percent=100,
        ray_actor_options=in_replica_environment({"num_cpus": 0, **config.ingress_actor_options}),
        # The ingress writes its own access line (service/api/app.py: request id, sizes, timing);
        # Serve's would be a second line per request.
        logging_config={"enable_access_log": False},
    ).bind(config, deployments)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for Serve config files (`import_path: service.app:app_builder`). The keys of
    `api_keys_env`, if named, are read here from this process's environment."""
    return build_app(ServiceConfig.model_validate(args).with_environment_keys(os.environ))
