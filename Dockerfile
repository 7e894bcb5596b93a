# syntax=docker/dockerfile:1
# trainmedic images. The default (last) stage, `service`, runs both `trainmedic serve` and
# `trainmedic agent`; `trainer` is the example training job of docker-compose.yml.
#   docker build -t trainmedic .                                  # service and agent
#   docker build --target trainer -t trainmedic-trainer .         # example trainer
# The agent's NVML calls need the driver's libnvidia-ml.so, which the NVIDIA container runtime
# injects at run time (NVIDIA_DRIVER_CAPABILITIES=utility): nothing of the driver is baked in here.

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# An unprivileged user owns the working folder and the checkpoint folder (a named volume mounted
# there starts with this ownership, so trainer and agent can share it).
RUN groupadd --system --gid 10001 trainmedic \
 && useradd --system --uid 10001 --gid trainmedic --home-dir /var/lib/trainmedic --create-home \
        --shell /usr/sbin/nologin trainmedic \
 && mkdir -p /checkpoints \
 && chown trainmedic:trainmedic /checkpoints
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
COPY playbooks ./playbooks


FROM base AS trainer
# CPU torch by default; pass a CUDA index (e.g. https://download.pytorch.org/whl/cu128) to train on GPUs.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" "torch==2.13.0" \
 && pip install . "prometheus-client>=0.20" \
 && rm -rf /src
COPY examples/train.py /app/train.py
USER trainmedic
WORKDIR /var/lib/trainmedic
EXPOSE 8000
CMD ["python", "/app/train.py", "--metrics-port", "8000", "--checkpoint-dir", "/checkpoints"]


FROM base AS service
RUN pip install ".[service]" \
 && rm -rf /src
USER trainmedic
WORKDIR /var/lib/trainmedic
EXPOSE 9095
# serve refuses a non-loopback address without a token: set TRAINMEDIC_WEBHOOK_TOKEN_FILE.
CMD ["trainmedic", "serve", "--host", "0.0.0.0", "--port", "9095", "--no-agent"]
