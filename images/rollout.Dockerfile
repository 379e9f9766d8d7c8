# Rollout: SGLang's CUDA 13 image (the engine) plus moerl (the rollout worker), one image for
# both containers of a rollout pod. Build from the repository root:
#   docker build -f images/rollout.Dockerfile -t <ecr>/moerl/rollout:<tag> .
# checkov:skip=CKV_DOCKER_2: probes on /health_generate live in the pod spec; Docker HEALTHCHECK is ignored there

FROM lmsysorg/sglang:v0.5.23-cu130 AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY infra ./infra
COPY charts8s ./charts8s
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM lmsysorg/sglang:v0.5.23-cu130
WORKDIR /opt/moerl
COPY --from=wheel /wheels /wheels
# --no-deps: SGLang's torch and transformers stay; moerl's own runtime needs are installed pinned.
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && pip install --no-cache-dir "redis==5.2.1" "typer==0.15.2" "boto3==1.38.0" "reasoning-gym==0.1.25" "math-verify==0.7.0" \
    && rm -rf /wheels
RUN useradd --create-home --uid 10001 --user-group moerl
USER 10001
ENV HOME=/home/moerl
ENTRYPOINT []
CMD ["moerl", "--help"]
