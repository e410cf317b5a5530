# GPU image: CUDA build of the same torch version as the CPU pin in pyproject.toml.
# Ubuntu 22.04 packages python3.11 (24.04 has only 3.12, and pyproject.toml wants <3.12).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv && rm -rf /var/lib/apt/lists/*
WORKDIR /app
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
COPY benchmarks ./benchmarks
COPY deploy ./deploy
RUN pip install --no-cache-dir .
# Binds 0.0.0.0 inside the container only; the default elsewhere is 127.0.0.1.
EXPOSE 8000 8080
CMD ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "8080"]
