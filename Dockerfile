# syntax=docker/dockerfile:1
# trainmedic images. The default (last) stage, `service`, runs both `trainmedic serve` and
# `trainmedic agent`; `trainer` is the example training job of docker-compose.yml.
#   docker build -t trainmedic .                                  # service and agent
#   docker build --target trainer -t trainmedic-trainer .         # example trainer
# Each image is built in two steps: a build stage installs the pinned packages (deploy/docker/constraints.txt)
# into a virtualenv, and the final stage copies only that virtualenv onto the slim base, without pip, caches or
# sources. A mirror or a local wheel index: --build-arg PIP_INDEX_URL=... (and TORCH_INDEX=... for torch).
# The agent's NVML calls need the driver's libnvidia-ml.so, which the NVIDIA container runtime
# injects at run time (NVIDIA_DRIVER_CAPABILITIES=utility): nothing of the driver is baked in here.

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
# An unprivileged user owns the working folder and the checkpoint folder (a named volume mounted
# there starts with this ownership, so trainer and agent can share it).
RUN groupadd --system --gid 10001 trainmedic \
 && useradd --system --uid 10001 --gid trainmedic --home-dir /var/lib/trainmedic --create-home \
        --shell /usr/sbin/nologin trainmedic \
 && mkdir -p /checkpoints \
 && chown trainmedic:trainmedic /checkpoints


# What the images install from the repository.
FROM scratch AS source
COPY pyproject.toml README.md /
COPY client /client
COPY service /service
COPY playbooks /playbooks
# The links that install those three as the one package trainmedic (pyproject's package-dir).
COPY src /src


# The build stages: a virtualenv of pinned packages, then pip itself taken out of it (the final images copy
# the virtualenv and install nothing).
FROM base AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/etc/trainmedic-constraints.txt
COPY deploy/docker/constraints.txt /etc/trainmedic-constraints.txt
RUN python3 -m venv /opt/venv

FROM build AS service-build
ARG PIP_INDEX_URL=https://pypi.org/simple
COPY --from=source / /src/
RUN pip install "/src[service]" \
 && pip uninstall -q -y pip setuptools

FROM build AS trainer-build
ARG PIP_INDEX_URL=https://pypi.org/simple
# CPU torch by default; pass a CUDA index (e.g. https://download.pytorch.org/whl/cu128) to train on GPUs.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# torch alone from that index, what it needs pinned from PIP_INDEX_URL; before the sources, so that a change
# to them does not install torch again.
RUN pip install --index-url "${TORCH_INDEX}" --no-deps "torch==2.13.0" \
 && pip install "torch==2.13.0" prometheus-client
COPY --from=source / /src/
# cryptography: the client verifies the service's signed commands (TRAINMEDIC_VERIFY_KEY_FILE) with it.
RUN pip install /src cryptography \
 && pip uninstall -q -y pip setuptools


FROM base AS trainer
COPY --from=trainer-build /opt/venv /opt/venv
COPY examples/train.py /app/train.py
USER trainmedic
WORKDIR /var/lib/trainmedic
EXPOSE 8000
CMD ["python", "/app/train.py", "--metrics-port", "8000", "--checkpoint-dir", "/checkpoints"]


FROM base AS service
COPY --from=service-build /opt/venv /opt/venv
USER trainmedic
WORKDIR /var/lib/trainmedic
EXPOSE 9095
# Ready: Redis reachable and the playbooks loaded. The agent runs this image too and serves no HTTP
# (docker-compose.yml turns the check off for it).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=6 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9095/readyz', timeout=3)"]
# serve refuses a non-loopback address without a token: set TRAINMEDIC_WEBHOOK_TOKEN_FILE.
CMD ["trainmedic", "serve", "--host", "0.0.0.0", "--port", "9095", "--no-agent"]
