"""The files in deploy/, the Dockerfile and .dockerignore: every Serve config passes Ray's own schema
and builds the app (Serve checks the deployment options), names shipped checkpoints and the pinned
Ray, and writes each option the models share once (YAML anchors); the RayService serves the GPU
config verbatim and fits its replicas; the image copies what exists and runs the GPU config.
(tests/cluster/ runs the configs and the image's command.)"""

import json
import math
import re
import shlex
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import ray
import yaml
from ray.scripts.scripts import start as ray_start
from ray.serve._private.build_app import build_app
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from service.app import app_builder
from service.config import ModelServingConfig, ServiceConfig
from tests.helpers import DEPLOY, ROOT, load, rayservice, serve_configs

IMAGE_ROOT = Path("/app")  # the Dockerfile's WORKDIR
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pinned(package: str) -> str:
    """The version pyproject.toml pins for `package` (name==version)."""
    (version,) = [
        re.split(r"==", d)[1].strip() for d in PYPROJECT["project"]["dependencies"] if re.match(rf"{re.escape(package)}(\[.*\])?==", d)
    ]
    return version


def test_deploy_configs_parse_into_service_config() -> None:
    for name, config in serve_configs().items():
        (application,) = config["applications"]
        assert application["import_path"] == f"{app_builder.__module__}:{app_builder.__name__}", name
        parsed = ServiceConfig(**application["args"])  # extra="forbid": an unknown or misspelt field raises
        for model in parsed.models:
            # The image copies the repository to IMAGE_ROOT (Dockerfile WORKDIR).
            checkpoint = model.checkpoint.relative_to(IMAGE_ROOT) if model.checkpoint.is_absolute() else model.checkpoint
            assert (DEPLOY.parent / checkpoint / "model.safetensors").is_file(), f"{name}: {model.checkpoint}"


def test_local_serve_config_binds_to_localhost() -> None:
    assert serve_configs()["serve_config.yaml"]["http_options"]["host"] == "127.0.0.1"


def test_every_serve_config_passes_rays_schema_and_builds_with_autoscaling_and_draining() -> None:
    for name, config in serve_configs().items():
        schema = ServeDeploySchema.model_validate(config)
        (application,) = schema.applications
        # ServiceConfig is the one place for Serve's deployment options: no second place here.
        assert not application.deployments, f"{name}: deployment overrides would shadow ServiceConfig"
        built = {d.name: d for d in build_app(app_builder(application.args), name=application.name).deployments}
        models = [m.name for m in ServiceConfig(**application.args).models]
        assert built.keys() == {*models, "Ingress"}, name
        request_timeout_s = config["http_options"]["request_timeout_s"]
        for deployment in models:
            options = built[deployment]._deployment_config
            scaling = options.autoscaling_config
            assert scaling is not None and 1 <= scaling.min_replicas < scaling.max_replicas, f"{name} {deployment}"
            assert scaling.target_ongoing_requests is not None and scaling.target_ongoing_requests < options.max_ongoing_requests
            # A drain outlasts any request the proxy still waits for; rollouts surge first.
            assert options.graceful_shutdown_timeout_s >= request_timeout_s, f"{name} {deployment}"
            assert options.max_surge_percent > 0 and options.max_queued_requests >= 1, f"{name} {deployment}"
        assert built["Ingress"]._deployment_config.graceful_shutdown_timeout_s >= request_timeout_s, name


def serve_config_texts() -> dict[str, str]:
    """The Serve configs as written: the files, and the RayService's serveConfigV2."""
    texts = {name: (DEPLOY / name).read_text() for name in ("serve_config.yaml", "serve_config.gpu.yaml")}
    return {**texts, "rayservice.yaml": rayservice()["spec"]["serveConfigV2"]}


def test_each_option_the_models_share_is_written_once_per_kind() -> None:
    """Serve's options, and the model fields, are written in one entry of each kind at most (the
    others merge it with `<<:`), never once per model: each name as a key, no more often than the
    config serves kinds of model."""
    names = {*DeploymentSchema.model_fields, *AutoscalingConfig.model_fields, *ModelServingConfig.model_fields} - {"name", "checkpoint"}
    for config, text in serve_config_texts().items():
        kinds = {m.kind for m in ServiceConfig(**yaml.safe_load(text)["applications"][0]["args"]).models}
        for name in names:
            written = len(re.findall(rf"^\s*{name}:", text, re.MULTILINE))
            assert written <= len(kinds), f"{config}: {name} written {written} times for {len(kinds)} kinds of model"


def test_the_rayservice_serves_the_gpu_config_verbatim_with_the_pinned_ray() -> None:
    configs, gpu = serve_configs(), (DEPLOY / "serve_config.gpu.yaml").read_text()
    assert configs["rayservice.yaml"] == configs["serve_config.gpu.yaml"]
    assert serve_config_texts()["rayservice.yaml"] == gpu[gpu.index("proxy_location:") :]  # the comments and anchors too
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == pinned("ray") == ray.__version__


def test_the_rayservice_authenticates_autoscales_probes_and_exports_metrics() -> None:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token" and cluster["authOptions"]["secretName"]
    assert cluster["enableInTreeAutoscaling"] is True
    head, (workers,) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no model replica on the head
    for group in (head, workers):
        (container,) = group["template"]["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"] and container["livenessProbe"]["httpGet"], container["name"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]) == 8080
        assert group["template"]["metadata"]["labels"] == {"app.kubernetes.io/name": "transformer-serving"}
    # Room on the GPU workers for every model at max_replicas, plus a rollout's surge replicas.
    gpus_per_worker = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    args = serve_configs()["rayservice.yaml"]["applications"][0]["args"]
    models = ServiceConfig(**args).models
    needed = sum(
        m.deployment["ray_actor_options"]["num_gpus"]
        * m.deployment["autoscaling_config"]["max_replicas"]
        * (1 + m.serve_options["max_surge_percent"] / 100)
        for m in models
    )
    assert workers["maxReplicas"] * gpus_per_worker >= math.ceil(needed) and 1 <= workers["minReplicas"] <= workers["maxReplicas"]
    monitor = load(DEPLOY / "kuberay" / "podmonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"] == head["template"]["metadata"]["labels"]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of every Dockerfile line, continuations joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(maxsplit=1)[0], line.split(maxsplit=1)[1]) for line in lines]


def test_the_image_copies_what_exists_runs_the_gpu_config_as_a_user_with_the_pinned_torch() -> None:
    instructions = dockerfile()
    sources = [shlex.split(args)[:-1] for op, args in instructions if op == "COPY"]
    copied = [source for group in sources for source in group]
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not any(fnmatch(source, pattern) for pattern in ignored), f"{source} is in .dockerignore"
    assert "model" in copied and not any(fnmatch("model/checkpoints", p) or p.startswith("model") for p in ignored)
    assert {".venv", ".git", "runs"} <= set(ignored)
    (torch_install,) = [args for op, args in instructions if op == "RUN" and "torch==" in args]
    assert re.search(r"torch==(\S+)", torch_install)[1] == pinned("torch")  # type: ignore[index]
    (user,) = [args for op, args in instructions if op == "USER"]
    assert user not in ("root", "0")
    (healthcheck,) = [args for op, args in instructions if op == "HEALTHCHECK"]
    assert "http://127.0.0.1:8000/healthz" in healthcheck
    (cmd,) = [json.loads(args) for op, args in instructions if op == "CMD"]
    shell, flag, script = cmd
    start, serve_run = script.split(" && exec ")
    start_args = shlex.split(start)
    assert (shell, flag) == ("sh", "-c") and start_args[:3] == ["ray", "start", "--head"]
    known = {option for param in ray_start.params for option in param.opts}
    assert all(arg.split("=")[0] in known for arg in start_args[2:]), start_args
    assert shlex.split(serve_run) == ["serve", "run", "deploy/serve_config.gpu.yaml"]


def test_compose_runs_the_image_on_a_gpu_beside_prometheus_and_grafana_from_deploy() -> None:
    compose = load(DEPLOY / "docker-compose.yml")
    serving = compose["services"]["serving"]
    assert serving["build"] == {"context": "..", "dockerfile": "Dockerfile"}
    (device,) = serving["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert all(port.startswith("127.0.0.1:") for port in serving["ports"])
    request_timeout_s = serve_configs()["serve_config.gpu.yaml"]["http_options"]["request_timeout_s"]
    assert int(serving["stop_grace_period"].removesuffix("s")) > request_timeout_s  # replicas drain before a kill
    for name in ("prometheus", "grafana"):
        service = compose["services"][name]
        assert service["network_mode"] == "service:serving"  # 127.0.0.1 in deploy/'s files reaches the service
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            assert source in compose["volumes"] or (DEPLOY / source).exists(), volume
