"""The service's config: a model's Serve deployment options (one field, checked by Serve's own
schema, passed through), and `python -m service`'s models from the command line."""

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as build_serve_app

from model.paths import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.app import REPLICA_ENVIRONMENT, build_app
from service.config import DEPLOYMENT_DEFAULTS, ModelServingConfig, ServiceConfig
from service.engine.config import EngineConfig


def model(deployment: dict[str, object]) -> ModelServingConfig:
    return ModelServingConfig(name="m", checkpoint=DEFAULT_TRANSLATOR, engine=EngineConfig(n_slots=4, max_waiting=6), deployment=deployment)


@pytest.mark.parametrize(
    ("deployment", "message"),
    [
        ({"num_replica": 2}, "not an option of a Serve deployment: num_replica"),
        ({"max_ongoing_requests": 3}, "set by the service"),
        ({"health_check_period_s": -1}, "health_check_period_s"),  # Serve's schema: greater than 0
        ({"ray_actor_options": {"num_cpus": -1}}, "num_cpus"),  # Serve's schema: not negative
    ],
)
def test_options_serve_would_refuse_are_refused_when_the_config_is_read(deployment: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        model(deployment)


def test_the_options_pass_through_over_the_services_defaults_with_the_engines_request_limit() -> None:
    options = model({"num_replicas": 3, "ray_actor_options": {"num_cpus": 0.25}, "max_surge_percent": 25}).serve_options
    assert options == {
        **DEPLOYMENT_DEFAULTS,
        "num_replicas": 3,
        "ray_actor_options": {"num_cpus": 0.25},
        "max_surge_percent": 25,
        "max_ongoing_requests": 10,  # the engine's slots and queue
        "max_queued_requests": 10,  # one replica's worth, unless set
    }
    assert model({"num_replicas": 3}).max_requests_held == 30
    assert model({"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}).max_requests_held is None


def test_the_ingress_actor_options_are_checked_by_serve_and_keep_it_off_the_cpus() -> None:
    with pytest.raises(ValidationError, match="num_cpus"):
        ServiceConfig(ingress_actor_options={"num_cpus": -1})
    config = ServiceConfig(ingress_actor_options={"resources": {"head": 0.01}})
    built = {d.name: d for d in build_serve_app(build_app(config), name="app").deployments}
    assert built["Ingress"].ray_actor_options == {
        "num_cpus": 0,
        "resources": {"head": 0.01},
        "runtime_env": {"env_vars": REPLICA_ENVIRONMENT},
    }


def test_every_replica_runs_serve_on_one_event_loop_and_keeps_its_own_runtime_env() -> None:
    """REPLICA_ENVIRONMENT reaches the ingress and each model's replicas through their runtime_env,
    under what a config sets there (its own env_vars win), and never this (the deploying) process."""
    own = {"pip": ["numpy"], "env_vars": {"OMP_NUM_THREADS": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}}
    translator, generator = ServiceConfig().translator, ServiceConfig().generator
    config = ServiceConfig(
        models=[translator, generator.model_copy(update={"deployment": {"ray_actor_options": {"num_cpus": 1, "runtime_env": own}}})],
        ingress_actor_options={"runtime_env": {"config": {"setup_timeout_seconds": 60}}},
    )
    built = {d.name: d.ray_actor_options for d in build_serve_app(build_app(config), name="app").deployments}
    assert built["Ingress"]["runtime_env"] == {"config": {"setup_timeout_seconds": 60}, "env_vars": REPLICA_ENVIRONMENT}
    assert built[translator.name]["runtime_env"] == {"env_vars": REPLICA_ENVIRONMENT}
    assert built[generator.name]["num_cpus"] == 1
    assert built[generator.name]["runtime_env"] == {
        "pip": ["numpy"],
        "env_vars": {**REPLICA_ENVIRONMENT, "OMP_NUM_THREADS": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"},
    }
    assert own["env_vars"] == {"OMP_NUM_THREADS": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}  # the config's own left as it was
    assert not REPLICA_ENVIRONMENT.keys() & os.environ.keys()


def test_the_command_lines_config_sets_replicas_and_cpus_through_serves_options() -> None:
    """`python -m service` (the README's `make serve`) builds its config without Ray running."""
    from service.__main__ import parse_args, service_config

    config = service_config(parse_args(["--replicas", "2", "--slots", "8", "--device", "cpu"]))
    assert [m.name for m in config.models] == [m.name for m in ServiceConfig().models]  # the shipped checkpoints
    for model in config.models:
        assert model.deployment == {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.0}}
        assert model.engine.n_slots == 8 and model.max_requests_held == 2 * (8 + model.engine.max_waiting)


def test_model_flags_serve_exactly_those_folders_named_as_told_or_after_the_folder(tmp_path: Path) -> None:
    from service.__main__ import parse_args, service_config

    copy = tmp_path / "my-translator"
    shutil.copytree(DEFAULT_TRANSLATOR, copy)
    config = service_config(parse_args(["--model", f"poet={DEFAULT_GENERATOR}", "--model", str(copy), "--device", "cpu"]))
    assert [(m.name, m.kind, m.checkpoint) for m in config.models] == [
        ("poet", "generator", DEFAULT_GENERATOR),
        ("my-translator", "translator", copy),
    ]
    assert (config.translator.source_lang, config.translator.target_lang) == ("en", "de")
    assert config.generator.engine.default_max_tokens == 16 and config.translator.engine.n_slots == 64
    # Compiled where it measures faster unless told otherwise: up to 64 rows (a translator's slots)
    assert config.generator.engine.compiled_decode == config.translator.engine.compiled_decode == tuple(range(1, 65))
    assert config.generator.engine.compile_in_background and config.translator.engine.compile_in_background
    eager = service_config(parse_args(["--model", str(copy), "--compiled-decode", "none"]))
    assert eager.translator.engine.compiled_decode == ()

    args = ["--model", f"poet={DEFAULT_GENERATOR}", "--model", str(copy), "--compiled-decode", "1,4,100"]
    compiled = service_config(parse_args(args))  # each model's sizes are those its slots hold (256 and 64)
    assert compiled.generator.engine.compiled_decode == (1, 4, 100) and compiled.translator.engine.compiled_decode == (1, 4)
    ranged = service_config(parse_args(["--model", str(copy), "--compiled-decode", "8-10,1,2-3,9"]))
    assert ranged.translator.engine.compiled_decode == (1, 2, 3, 8, 9, 10)
    for bad in ("1,x", "4-2", "1-"):
        with pytest.raises(SystemExit):
            parse_args(["--compiled-decode", bad])
    assert config.generator.engine.num_speculative_tokens == 4  # speculative decoding on unless turned off
    off = service_config(parse_args(["--model", str(DEFAULT_GENERATOR), "--speculative-tokens", "0"]))
    assert off.generator.engine.num_speculative_tokens == 0
    assert config.generator.stream_interval_ms == 50.0  # ServingConfig's default unless told
    every_step = service_config(parse_args(["--model", str(copy), "--model", str(DEFAULT_GENERATOR), "--stream-interval-ms", "0"]))
    assert [m.stream_interval_ms for m in every_step.models] == [0.0, 0.0]
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse_args(["--stream-interval-ms", bad])


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda d: None, "config.json: missing"),
        (
            lambda d: (d / "config.json").write_text('{"architectures": ["T5ForConditionalGeneration"]}'),
            "unknown architecture 'T5ForConditionalGeneration' (not supported yet)",
        ),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    ],
)
def test_a_folder_that_cannot_be_served_stops_the_command_with_one_line(tmp_path: Path, make: Any, problem: str, capsys: Any) -> None:
    from service.__main__ import main

    make(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["--model", f"bad={tmp_path}"])
    message = str(stopped.value.code)
    assert message.startswith(f"python -m service: --model bad={tmp_path}: {tmp_path}") and problem in message, message
    assert "\n" not in message


def test_a_config_files_compiled_decode_may_be_written_as_text() -> None:
    """deploy/serve_config.yaml writes "1-64" as the command line does; "none" is eager; a malformed one is refused."""
    entry = {"name": "gen", "checkpoint": DEFAULT_GENERATOR, "kind": "generator"}
    assert ModelServingConfig(**entry, engine={"compiled_decode": "1-3,8"}).engine.compiled_decode == (1, 2, 3, 8)
    assert ModelServingConfig(**entry, engine={"compiled_decode": "none"}).engine.compiled_decode == ()
    with pytest.raises(ValidationError, match="ascending range"):
        ModelServingConfig(**entry, engine={"compiled_decode": "4-2"})
    from tests.helpers import serve_configs

    models = serve_configs()["serve_config.yaml"]["applications"][0]["args"]["models"]
    engines = [ModelServingConfig(**m).engine for m in models]
    assert all(e.compiled_decode and e.compile_in_background for e in engines)
