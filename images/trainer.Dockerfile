# Trainer: CUDA 13 PyTorch (NGC 25.10: PyTorch, CUDA 13.0, NCCL), the EFA installer (libfabric
# and aws-ofi-nccl), DeepEP kernels (sgl-deep-ep), and moerl. Build from the repository root:
#   docker build -f images/trainer.Dockerfile -t <ecr>/moerl/trainer:<tag> .
# checkov:skip=CKV_DOCKER_2: Kubernetes restarts the gang on failure; Docker HEALTHCHECK is ignored there

FROM nvcr.io/nvidia/pytorch:25.10-py3 AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY infra ./infra
COPY charts8s ./charts8s
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM nvcr.io/nvidia/pytorch:25.10-py3
ARG EFA_INSTALLER_VERSION=1.43.3
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# EFA user space only (the node AMI carries the kernel driver); -g adds GPUDirect support and the
# installer's bundled aws-ofi-nccl plugin lands in /opt/amazon/ofi-nccl.
WORKDIR /tmp/efa
RUN curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
    && tar -xzf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
WORKDIR /tmp/efa/aws-efa-installer
RUN ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify \
    && rm -rf /tmp/efa /var/lib/apt/lists/*
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH}
WORKDIR /opt/moerl
COPY --from=wheel /wheels /wheels
# The base image's torch and NCCL stay (pinned by the NGC tag; pip sees torch installed).
RUN pip install --no-cache-dir "sgl-deep-ep==0.1.2.post1" /wheels/*.whl \
    && rm -rf /wheels
RUN useradd --create-home --uid 10001 --user-group moerl
USER 10001
ENV HOME=/home/moerl
ENTRYPOINT []
CMD ["moerl", "--help"]
