# Rollout: SGLang's CUDA 13 image (the engine; it ships torch 2.14.1, NCCL 2.30.7 and
# sgl-deep-ep 0.1.2.post1), a DeepEP build for EFA, and moerl (the rollout worker): one image for
# both containers of a rollout pod. Versions: images/versions.toml (the build args' defaults below
# equal it; tests/test_images.py checks). Build from the repository root:
#   docker build -f images/rollout.Dockerfile -t <ecr>/moerl/rollout:<tag> .
# checkov:skip=CKV_DOCKER_2: probes on /health_generate live in the pod spec; Docker HEALTHCHECK is ignored there
#
# DeepEP over EFA, as the AWS recipe for SGLang with DeepEP on p5en does
# (awslabs/awsome-distributed-ai, 3.test_cases/pytorch/sglang/dsr1-deepep-efa): the stock deep_ep
# reaches other nodes through NVSHMEM's IBGDA (InfiniBand only) or NCCL GIN, which reaches EFA only
# from NCCL 2.31.2 on; torch 2.14.1 pins 2.30.7. AWS's setup_deepep_efa.sh (downloaded at a pinned
# commit and checked by sha256, not copied here) installs NVSHMEM with its libfabric transport and
# builds DeepEP V1, the deep_ep.Buffer API of SGLang's `--moe-a2a-backend deepep`, with AWS's EFA
# patch. This image has not been built by the project yet: no Docker engine was available.
FROM lmsysorg/sglang:v0.5.23-cu130 AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY infra ./infra
COPY charts8s ./charts8s
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM lmsysorg/sglang:v0.5.23-cu130
ARG TORCH_VERSION=2.14.1
ARG NCCL_VERSION=2.30.7
ARG EFA_INSTALLER_VERSION=1.49.0
ARG EFA_INSTALLER_KEY_FINGERPRINT=4E9091BCBB97A96B26B15E59A05480B1DD2D3CCC
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG GDRCOPY_COMMIT=c91ad9f178e5fb729fc5b6dc62a77c3bb364d6c9
ARG NVSHMEM_EFA_VERSION=3.7.0
ARG DEEPEP_EFA_COMMIT=567632d
ARG AWS_DEEPEP_EFA_SCRIPT_COMMIT=95b939cdc5b24ded03a70da21533964f9354b731
ARG AWS_DEEPEP_EFA_SCRIPT_SHA256=9b1037381a75de72264a9048b0a6d169885912252f0e1dbd41bb3d8473f38654
# Hopper (p5, p5en) and B200 (p6-b200).
ARG TORCH_CUDA_ARCH_LIST="9.0;10.0"
# The base's packages moerl's install may change ("|"-separated): reasoning-gym pins tabulate==0.9.0.
ARG MAY_REPLACE="tabulate"
USER 0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The base must carry the table's stack; stop here if the tag moved it.
RUN python3 -c "import importlib.metadata as m, sys; got = (m.version('torch').split('+')[0], m.version('nvidia-nccl-cu13')); \
    sys.exit(0 if got == ('${TORCH_VERSION}', '${NCCL_VERSION}') else f'base has torch, NCCL {got}, images/versions.toml says ${TORCH_VERSION}, ${NCCL_VERSION}')"
# GDRCopy's library: NVSHMEM's libfabric transport registers GPU memory with EFA through it. NVIDIA
# publishes no checksum of its source archives: the download names the tag's commit, not the tag.
WORKDIR /tmp/gdrcopy
RUN curl -fsSL "https://github.com/NVIDIA/gdrcopy/archive/${GDRCOPY_COMMIT}.tar.gz" | tar -xz --strip-components=1 \
    && make -j"$(nproc)" lib lib_install CUDA=/usr/local/cuda PREFIX=/usr/local \
    && rm -rf /tmp/gdrcopy
# EFA user space only (the node AMI carries the kernel driver), as in the trainer image; gnupg checks
# the installer's signature.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gnupg && rm -rf /var/lib/apt/lists/*
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
# DeepEP for EFA. The stock deep_ep goes first: it would shadow the EFA build. Then torch's pip
# libnvshmem_host.so.3 (3.4.5) is replaced by the EFA build's, so that host and device NVSHMEM agree.
WORKDIR /tmp/deepep-efa
RUN curl -fsSLo setup_deepep_efa.sh "https://raw.githubusercontent.com/awslabs/awsome-distributed-ai/${AWS_DEEPEP_EFA_SCRIPT_COMMIT}/micro-benchmarks/expert-parallelism/deepep-benchmark/setup_deepep_efa.sh" \
    && echo "${AWS_DEEPEP_EFA_SCRIPT_SHA256}  setup_deepep_efa.sh" | sha256sum -c - \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip uninstall -y sgl-deep-ep \
    && PIP_BREAK_SYSTEM_PACKAGES=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" bash setup_deepep_efa.sh \
        --deepep-commit "${DEEPEP_EFA_COMMIT}" --nvshmem-version "${NVSHMEM_EFA_VERSION}" \
        --nvshmem-prefix /opt/amazon/nvshmem --gdrcopy-home /usr/local --gen-ldconfig \
    && pip_nvshmem="$(python3 -c "import importlib.util as u; print(next(iter(u.find_spec('nvidia.nvshmem').submodule_search_locations)) + '/lib')")" \
    && cp -f "$(readlink -f /opt/amazon/nvshmem/lib/libnvshmem_host.so.3)" "${pip_nvshmem}/libnvshmem_host.so.3" \
    && python3 -m pip show deep_ep \
    && rm -rf /tmp/deepep-efa
ENV FI_PROVIDER=efa \
    FI_EFA_USE_DEVICE_RDMA=1 \
    NVSHMEM_REMOTE_TRANSPORT=libfabric \
    NVSHMEM_LIBFABRIC_PROVIDER=efa \
    NVSHMEM_NETDEVS_POLICY=EXTERNAL_SHARING_PCIE_SWITCH_NIC_EXCLUSIVE \
    NCCL_NET_PLUGIN=ofi \
    LD_LIBRARY_PATH=/opt/amazon/nvshmem/lib:/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH}
WORKDIR /opt/moerl
COPY --from=wheel /wheels /wheels
# sglang-router: the router Deployment in front of the engines (rollout.router; app/rollout/router.py).
# --no-deps: the worker needs few of moerl's dependencies (not torchx: it pins urllib3<1.27). The
# rest are installed pinned, constrained to the versions the image already has (except MAY_REPLACE),
# so pip stops rather than replace one of SGLang's packages; tests/test_images.py resolves this
# install against a recorded copy of the base's packages.
RUN python3 -m pip list --format=freeze | grep -viE "^(${MAY_REPLACE})==" > /tmp/base-constraints.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps /wheels/*.whl \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir -c /tmp/base-constraints.txt \
        "redis==5.2.1" "boto3==1.38.0" "reasoning-gym==0.1.25" "math-verify==0.7.0" "websockets==17.4" \
        "sglang-router==${SGLANG_ROUTER_VERSION}" \
    && rm -rf /wheels /tmp/base-constraints.txt
RUN useradd --create-home --uid 10001 --user-group moerl
USER 10001
ENV HOME=/home/moerl
ENTRYPOINT []
CMD ["moerl", "--help"]
