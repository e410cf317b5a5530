"""The Serve configs in deploy/ parse into the service's own config, so a typo fails here, not at deploy time."""

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from service.app import app_builder
from service.config import ServiceConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
IMAGE_ROOT = Path("/app")


def serve_configs() -> dict[str, dict[str, Any]]:
    local = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    kuberay = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    return {"serve_config.yaml": local, "rayservice.yaml": yaml.safe_load(kuberay["spec"]["serveConfigV2"])}


def test_deploy_configs_parse_into_service_config() -> None:
    for name, config in serve_configs().items():
        (application,) = config["applications"]
        assert application["import_path"] == f"{app_builder.__module__}:{app_builder.__name__}", name
        parsed = ServiceConfig(**application["args"])  # extra="forbid": an unknown or misspelt field raises
        for model in (parsed.translator, parsed.generator):
            # The image copies the repository to IMAGE_ROOT (Dockerfile WORKDIR).
            checkpoint = model.checkpoint.relative_to(IMAGE_ROOT) if model.checkpoint.is_absolute() else model.checkpoint
            assert (DEPLOY.parent / checkpoint / "model.safetensors").is_file(), f"{name}: {model.checkpoint}"


def test_local_serve_config_binds_to_localhost() -> None:
    assert serve_configs()["serve_config.yaml"]["http_options"]["host"] == "127.0.0.1"
