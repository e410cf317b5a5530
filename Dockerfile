# GPU image: the CUDA build of the torch version pyproject.toml pins, the service, its shipped
# checkpoints and its Serve configs. deploy/README.md: build, run, push; deploy/docker-compose.yml
# runs it with a GPU beside Prometheus and Grafana; deploy/kuberay/rayservice.yaml on Kubernetes.
# Ubuntu 22.04 packages python3.11 (24.04 has only 3.12, and pyproject.toml wants <3.12). The
# torch wheel brings its own CUDA libraries; the base image's CUDA 12.8 matches its cu128 build.
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Same version as pyproject.toml's pin (tests/test_deploy_configs.py checks), so `pip install .`
# below keeps this build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
WORKDIR /app
COPY pyproject.toml README.md ./
COPY model ./model
COPY decoding ./decoding
COPY loading ./loading
COPY exports ./exports
COPY training ./training
COPY service ./service
COPY benchmarks ./benchmarks
COPY deploy ./deploy
RUN pip install .
# Ray and the replicas run as this user; Ray writes its session (and ~/.ray/auth_token) as it.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray && install -d -o ray /tmp/ray /cache
USER ray
# The C kernels' builds and torch.compile's artifacts (service/engine/compile_cache.py), kept
# between starts where a volume is mounted here (deploy/docker-compose.yml, the KubeRay manifest).
ENV TRANSFORMER_SERVING_CACHE=/cache
VOLUME /cache
ENV RAY_USAGE_STATS_ENABLED=0
# Two malloc arenas per process: with one per thread the ingress's memory crept up (service/config.py).
ENV MALLOC_ARENA_MAX=2
# Deployment handles over Serve's gRPC transport: cheaper per streamed chunk (service/config.py).
ENV RAY_SERVE_USE_GRPC_BY_DEFAULT=1
# Serve logs to files only (/tmp/ray/session_latest/logs/serve/), not also to stderr (service/config.py).
ENV RAY_SERVE_LOG_TO_STDERR=0
# Serve's HTTP proxy (deploy/serve_config.gpu.yaml binds 0.0.0.0 inside the container only) and
# Ray's Prometheus metrics.
EXPOSE 8000 8080
HEALTHCHECK --start-period=120s --interval=30s --timeout=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=5)"]
# `serve run` shuts the application down on SIGINT: replicas drain (graceful_shutdown_timeout_s)
# within the stop timeout (docker stop -t / compose stop_grace_period).
STOPSIGNAL SIGINT
# A head node with Ray's metrics on 8080 (as on Kubernetes), then `serve run` of the GPU config,
# which connects to it. `ray start --head` turns token authentication on (a token in ~/.ray).
CMD ["sh", "-c", "ray start --head --metrics-export-port=8080 --disable-usage-stats && exec serve run deploy/serve_config.gpu.yaml"]
