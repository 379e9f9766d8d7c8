# Env pool: slim CPU-only Python serving the run's environment over OpenEnv (`moerl env`) or the
# verifier (`moerl reward`). Build from the root:
#   docker build -f images/env.Dockerfile -t <ecr>/moerl/env:<tag> .
# checkov:skip=CKV_DOCKER_2: the Deployment's probes check the port; Docker HEALTHCHECK is ignored there
# Versions: images/versions.toml (the build args' defaults below equal it; tests/test_images.py checks).
FROM python:3.11.11-slim-bookworm@sha256:081075da77b2b55c23c088251026fb69a7b2bf92471e491ff5fd75c192fd38e5 AS build
ARG TORCH_CPU_VERSION=2.9.1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# CPU build of torch first so nothing later pulls a CUDA build.
RUN python -m venv /venv \
    && /venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_CPU_VERSION}"
COPY pyproject.toml README.md ./
COPY app ./app
COPY infra ./infra
COPY charts8s ./charts8s
# openenv: `moerl env` (the extra `env` of pyproject.toml, pinned here like every install).
RUN /venv/bin/pip install . "openenv==0.10.0"

FROM python:3.11.11-slim-bookworm@sha256:081075da77b2b55c23c088251026fb69a7b2bf92471e491ff5fd75c192fd38e5
COPY --from=build /venv /venv
RUN useradd --create-home --uid 10001 --user-group moerl
USER 10001
ENV PATH=/venv/bin:${PATH} HOME=/home/moerl
CMD ["moerl", "--help"]
