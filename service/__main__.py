"""`python -m service`: start a local Ray, deploy both models, serve until Ctrl-C.

Listens on 127.0.0.1:8000 and exports metrics on 127.0.0.1:8080 unless told otherwise. API keys,
if any, come from the environment variable SERVING_API_KEYS (comma-separated), read at startup.
"""

import argparse
import json
import logging
import os
import signal
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from model.paths import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.config import LOCAL_RAY_ENVIRONMENT, RAY_ENVIRONMENT, ServiceConfig
from service.engine.config import EngineConfig

API_KEYS_ENV = "SERVING_API_KEYS"  # not a flag: a process's arguments are visible to every user


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus metrics export port")
    parser.add_argument("--translator-checkpoint", type=Path, default=DEFAULT_TRANSLATOR)
    parser.add_argument("--generator-checkpoint", type=Path, default=DEFAULT_GENERATOR)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--translator-replicas", type=int, default=1)
    parser.add_argument("--generator-replicas", type=int, default=1)
    parser.add_argument("--slots", type=int, default=None, help="concurrent sequences per replica (default: 64 translator, 32 generator)")
    parser.add_argument("--torch-threads", type=int, default=None, help="CPU threads per replica")
    parser.add_argument("--cors-origin", action="append", default=[], help="an origin browsers may call the API from (repeatable)")
    return parser.parse_args(argv)


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """ServiceConfig's defaults, with what the command line sets."""
    import torch

    # Both models share this machine's GPU, if it has one.
    gpus = 0.5 if args.device != "cpu" and torch.cuda.is_available() else 0.0
    defaults = ServiceConfig()
    common = {"device": args.device, "torch_threads": args.torch_threads}

    def deployment(replicas: int) -> dict[str, Any]:
        return {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": gpus}}

    def slots(engine: EngineConfig) -> EngineConfig:
        return engine if args.slots is None else replace(engine, n_slots=args.slots)

    translator, generator = defaults.translator, defaults.generator
    return ServiceConfig(
        cors_origins=args.cors_origin,
        translator=translator.model_copy(
            update={
                "checkpoint": args.translator_checkpoint,
                "deployment": deployment(args.translator_replicas),
                "engine": slots(translator.engine),
                **common,
            }
        ),
        generator=generator.model_copy(
            update={
                "checkpoint": args.generator_checkpoint,
                "deployment": deployment(args.generator_replicas),
                "engine": slots(generator.engine),
                **common,
            }
        ),
    )


def wait_ready(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the service at {url} was not ready after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = service_config(args)
    if API_KEYS_ENV in os.environ:  # set but holding no key: refused, rather than serving without keys
        config = config.model_copy(update={"api_keys_env": API_KEYS_ENV}).with_environment_keys(os.environ)
    os.environ.update(LOCAL_RAY_ENVIRONMENT)  # before Ray is imported
    import ray
    from ray import serve

    from service.app import build_app

    os.environ.update(RAY_ENVIRONMENT)
    ray.init(
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=args.metrics_port,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(config), name="transformers", route_prefix="/")
    url = f"http://{args.host}:{args.port}"
    wait_ready(url)
    keys = f"{len(config.api_keys)} configured (send Authorization: Bearer <key>)" if config.api_keys else "none required"
    example = json.dumps({"q": "A man is riding a bike.", "source": "en", "target": "de"})
    print(
        f"\nServing on {url}  (OpenAPI: {url}/docs)\n"
        f"Metrics for Prometheus: http://127.0.0.1:{args.metrics_port}/metrics\n"
        f"API keys: {keys}\n\n"
        f"Try:\n  curl -s {url}/translate -H 'Content-Type: application/json' -d '{example}'\n"
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "transformer-shakespeare", "prompt": "ROMEO:", "max_tokens": 40}}'\n\n"""
        "Ctrl-C stops the service.",
        flush=True,
    )
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while not stopping:
        time.sleep(0.5)
    print("Shutting down...", flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
