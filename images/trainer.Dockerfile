# Trainer: CUDA 13.0 devel (nvcc: DeepEP compiles its kernels on first use), PyTorch with the
# NCCL and NVSHMEM wheels it pins, the EFA installer (libfabric and aws-ofi-nccl), DeepEP
# (sgl-deep-ep) and moerl. Versions: images/versions.toml (the build args' defaults below equal
# it; tests/test_images.py checks). Build from the repository root:
#   docker build -f images/trainer.Dockerfile -t <ecr>/moerl/trainer:<tag> .
# checkov:skip=CKV_DOCKER_2: Kubernetes restarts the gang on failure; Docker HEALTHCHECK is ignored there
#
# Not an NGC PyTorch base: those carry their own torch build and a pip constraints file, while
# sgl-deep-ep requires torch==2.14.1 exactly (its Requires-Dist) and the NCCL that release pins
# (its _C accepts only 2.30.7), so pip would refuse or replace the base's torch. Here torch, NCCL
# and NVSHMEM come from PyPI at the table's versions and a constraints file keeps them there.
FROM nvidia/cuda:13.0.3-devel-ubuntu24.04@sha256:b7ae301dea2c162444795462ce17a05f6a516e5a75944b57af5b88540a1a2266 AS wheel
# Apt pins would go stale with every Ubuntu security update; the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY infra ./infra
COPY charts8s ./charts8s
RUN python3.12 -m venv /tmp/build && /tmp/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM nvidia/cuda:13.0.3-devel-ubuntu24.04@sha256:b7ae301dea2c162444795462ce17a05f6a516e5a75944b57af5b88540a1a2266
ARG EFA_INSTALLER_VERSION=1.49.0
ARG EFA_INSTALLER_KEY_FINGERPRINT=4E9091BCBB97A96B26B15E59A05480B1DD2D3CCC
ARG TORCH_VERSION=2.14.1
ARG NCCL_VERSION=2.30.7
ARG NVSHMEM_VERSION=3.4.5
ARG SGL_DEEP_EP_VERSION=0.1.2.post1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Python for the venv, g++ for nvcc's host passes (DeepEP's JIT), curl and gnupg for the EFA installer.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3.12-venv g++ curl ca-certificates gnupg \
    && rm -rf /var/lib/apt/lists/* \
    && nvcc --version | grep -q "release 13\.0"
# EFA user space only (the node AMI carries the kernel driver); -g adds GPUDirect support and the
# installer's bundled aws-ofi-nccl plugin lands in /opt/amazon/ofi-nccl. The installer runs apt
# itself, hence the update in the same step.
# The tarball's GPG signature is checked against the key whose fingerprint AWS publishes (EC2 user
# guide, "Get started with EFA and NCCL"; images/versions.toml): only that key's signature passes.
WORKDIR /tmp/efa
RUN curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
    && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz.sig" \
    && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer.key" \
    && GNUPGHOME="$(mktemp -d)" && export GNUPGHOME \
    && gpg --batch --quiet --import aws-efa-installer.key \
    && gpg --batch --status-fd 1 --verify "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz.sig" "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
        | grep -Eq "^\[GNUPG:\] VALIDSIG .* ${EFA_INSTALLER_KEY_FINGERPRINT}$" \
    && rm -rf "${GNUPGHOME}" \
    && tar -xzf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
WORKDIR /tmp/efa/aws-efa-installer
RUN apt-get update && ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify \
    && (dpkg-query -W 'libnccl-ofi*' || true) \
    && rm -rf /tmp/efa /var/lib/apt/lists/*
# NCCL_NET_PLUGIN=ofi: NCCL loads libnccl-net-ofi.so (found through ldconfig) instead of silently
# using TCP sockets; the short name works with every NCCL 2.x (AWS SGLang + DeepEP over EFA recipe).
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/venv/bin:/opt/amazon/efa/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    NCCL_NET_PLUGIN=ofi
WORKDIR /opt/moerl
COPY --from=wheel /wheels /wheels
# The stack first, at the table's versions, then DeepEP and moerl under a constraints file of those
# pins: a later requirement that would replace torch, NCCL or NVSHMEM stops the build instead.
RUN python3.12 -m venv /opt/venv \
    && printf '%s\n' "torch==${TORCH_VERSION}" "nvidia-nccl-cu13==${NCCL_VERSION}" \
        "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" > /opt/venv/constraints.txt \
    && pip install --no-cache-dir -c /opt/venv/constraints.txt "torch==${TORCH_VERSION}" \
        "nvidia-nccl-cu13==${NCCL_VERSION}" "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" \
    && pip install --no-cache-dir -c /opt/venv/constraints.txt "sgl-deep-ep==${SGL_DEEP_EP_VERSION}" /wheels/*.whl \
    && rm -rf /wheels \
    && python -c "import torch; assert torch.version.cuda.startswith('13.'), torch.version.cuda"
RUN useradd --create-home --uid 10001 --user-group moerl
USER 10001
ENV HOME=/home/moerl
ENTRYPOINT []
CMD ["moerl", "--help"]
