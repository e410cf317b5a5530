"""`python -m service`: start a local Ray, deploy the models, serve until Ctrl-C.

    python -m service                                  # the shipped checkpoints
    python -m service --model opus=/models/opus-mt-en-fr --model pythia=/models/pythia-70m

`--model NAME=PATH` (repeatable; `--model PATH` names it after its folder) serves exactly those
folders: ours (model/checkpoints) or Hugging Face's (MarianMT, GPT-NeoX, the Llama family), or GGUF
files (`--model NAME=FILE.gguf`). A folder or file that cannot be served stops the command with one
line naming the file and the problem.

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
from typing import Any, get_args

from pydantic import ValidationError

from model.config import Quantization
from service.config import LOCAL_RAY_ENVIRONMENT, RAY_ENVIRONMENT, ModelServingConfig, ServiceConfig
from service.engine.config import DEFAULT_COMPILED_DECODE, EngineConfig, parse_batch_sizes
from service.ports import free_port

API_KEYS_ENV = "SERVING_API_KEYS"  # not a flag: a process's arguments are visible to every user


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus metrics export port")
    parser.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH", help="a checkpoint folder to serve (repeatable)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of each model")
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        help="concurrent sequences per replica (default: 64 translators; 256 generators, the KV pool deciding)",
    )
    parser.add_argument("--torch-threads", type=int, default=None, help="CPU threads per replica")
    parser.add_argument(
        "--quantization",
        choices=get_args(Quantization),
        default=None,
        help="linear layers quantized at load into GGUF's block types (int8 = q8_0; a GGUF file keeps its own)",
    )
    parser.add_argument(
        "--compiled-decode",
        type=batch_sizes,
        default=DEFAULT_COMPILED_DECODE,
        metavar="B[-B][,...]|none",
        help="batch sizes (rows: a sequence's, or each token a verification of drafts computes) at which decode steps run "
        "torch.compile'd on the CPU: compiled and timed once per power-of-two bucket while the replica serves eagerly, each "
        "bucket kept where it measures faster; the compiled code is kept in $TRANSFORMER_SERVING_CACHE/torch-compile for "
        "later starts (default 1-64; none: every step eager)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding by prompt lookup: up to K tokens proposed per decoding sequence "
        f"(0: off; default {EngineConfig.num_speculative_tokens})",
    )
    parser.add_argument(
        "--stream-interval-ms",
        type=milliseconds,
        default=None,
        metavar="MS",
        help="a stream's first token at once, then at most one event per MS, carrying the tokens made meanwhile "
        f"(0: each step's tokens as they come, as vLLM streams; default {ModelServingConfig.model_fields['stream_interval_ms'].default})",
    )
    parser.add_argument("--cors-origin", action="append", default=[], help="an origin browsers may call the API from (repeatable)")
    parser.add_argument(
        "--through-proxy",
        action="store_true",
        help="answer HTTP through Serve's proxy, as a Serve config deploys it, instead of the ingress replica itself",
    )
    return parser.parse_args(argv)


def direct_ingress_environment(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress: the ingress replica answers HTTP on `port` itself, and a token
    crosses one Ray hop (model replica -> ingress) instead of two (-> the proxy): 1.2x the tokens/s
    at 256 streams and half the time to first token (docs/performance.md). Serve's proxy still
    runs, on a port of its own: Serve starts direct ingress only beside one."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive: the one ingress replica gets exactly this port
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",  # no external load balancer to leave: stop as the proxy would
    }


def batch_sizes(text: str) -> tuple[int, ...]:
    """--compiled-decode's value (parse_batch_sizes)."""
    try:
        return parse_batch_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def milliseconds(text: str) -> float:
    """--stream-interval-ms's value: a number of milliseconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds (0 or more)")
    return value


def model_entries(specs: list[str]) -> list[ModelServingConfig]:
    """--model NAME=PATH or PATH (named after the folder), each read from its folder; a folder that
    cannot be served is a ValueError of one line."""
    entries = []
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        folder = Path(path).expanduser()
        name = name or folder.resolve().name
        try:
            entries.append(ModelServingConfig(name=name, checkpoint=folder))
        except ValidationError as error:
            raise ValueError(f"--model {spec}: {error.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return entries


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """ServiceConfig's defaults, with what the command line sets."""
    import torch

    models = model_entries(args.model) if args.model else list(ServiceConfig().models)
    # The models share this machine's GPU, if it has one.
    gpus = round(1 / len(models), 3) if args.device != "cpu" and torch.cuda.is_available() else 0.0
    deployment: dict[str, Any] = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": gpus}}

    def configured(model: ModelServingConfig) -> ModelServingConfig:
        engine = model.engine
        if model.kind == "translator" and args.slots is None:
            engine = replace(engine, n_slots=64)
        if model.kind == "generator" and engine.default_max_tokens is None:
            engine = replace(engine, default_max_tokens=16)  # OpenAI's default for completions
        if args.slots is not None:
            engine = replace(engine, n_slots=args.slots)
        if args.speculative_tokens is not None:
            engine = replace(engine, num_speculative_tokens=args.speculative_tokens)
        if args.compiled_decode:  # the sizes a model's decode steps have (a generator's verifications: a row per token)
            # compiled on a thread of its own while the replica serves eagerly
            sizes = engine.decode_sizes(args.compiled_decode, decoder_only=model.kind == "generator")
            engine = replace(engine, compiled_decode=sizes, compile_in_background=True)
        update = {"deployment": deployment, "engine": engine, "device": args.device, "torch_threads": args.torch_threads}
        if args.stream_interval_ms is not None:
            update["stream_interval_ms"] = args.stream_interval_ms
        if args.quantization is not None and model.checkpoint.suffix != ".gguf":
            update["quantization"] = args.quantization
        return model.model_copy(update=update)

    return ServiceConfig(cors_origins=args.cors_origin, models=tuple(configured(m) for m in models))


def model_line(model: ModelServingConfig) -> str:
    what = f"translator {model.source_lang} -> {model.target_lang}" if model.kind == "translator" else "generator"
    return f"{model.name}: {what} ({model.checkpoint})"


def examples(config: ServiceConfig, url: str) -> str:
    lines = []
    for model in config.models_of("translator")[:1]:
        body = json.dumps({"q": "A man is riding a bike.", "source": model.source_lang, "target": model.target_lang})
        lines.append(f"  curl -s {url}/translate -H 'Content-Type: application/json' -d '{body}'\n")
    for model in config.models_of("generator")[:1]:
        body = json.dumps({"model": model.name, "prompt": "ROMEO:", "max_tokens": 40})
        lines.append(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n")
    return "".join(lines)


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
    try:
        config = service_config(args)
    except ValueError as error:
        raise SystemExit(f"python -m service: {error}") from None
    if API_KEYS_ENV in os.environ:  # set but holding no key: refused, rather than serving without keys
        config = config.model_copy(update={"api_keys_env": API_KEYS_ENV}).with_environment_keys(os.environ)
    # Before Ray is imported: Serve reads its settings when imported, and the handles this process
    # builds keep the transport it read (RAY_SERVE_USE_GRPC_BY_DEFAULT).
    os.environ.update(LOCAL_RAY_ENVIRONMENT | RAY_ENVIRONMENT)
    import ray
    from ray import serve

    from service.app import build_app

    proxy_port = None if args.through_proxy else free_port(args.host)
    if proxy_port is not None:
        os.environ.update(direct_ingress_environment(args.port))
    ray.init(
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=args.metrics_port,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    serve.start(http_options={"host": args.host, "port": args.port if proxy_port is None else proxy_port})
    serve.run(build_app(config), name="transformers", route_prefix="/")
    url = f"http://{args.host}:{args.port}"
    wait_ready(url)
    keys = f"{len(config.api_keys)} configured (send Authorization: Bearer <key>)" if config.api_keys else "none required"
    print(
        f"\nServing on {url}  (OpenAPI: {url}/docs)\n"
        f"Metrics for Prometheus: http://127.0.0.1:{args.metrics_port}/metrics\n"
        f"API keys: {keys}\nModels:\n" + "".join(f"  {model_line(m)}\n" for m in config.models) + f"\nTry:\n{examples(config, url)}\n"
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
