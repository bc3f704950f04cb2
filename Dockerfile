# The plugin's container image: docs/deploy.md ("The image").
#
#   docker build -t gpu-health-device-plugin:0.1.0 .
#
# Both stages use one base image, a Debian release with Debian's own python3, so the venv built in the first stage
# runs unchanged on the python3 the second installs, and the base can be bootstrapped from Debian packages alone.
# Pin it by digest for reproducible builds: --build-arg BASE_IMAGE=debian:trixie-slim@sha256:<digest>.
ARG BASE_IMAGE=debian:trixie-slim

# Stage 1: build the wheel, then install it and its dependencies into a venv. Dependencies come as binary wheels
# only (--only-binary), so no compiler is needed here and none can reach the runtime stage.
FROM ${BASE_IMAGE} AS build
# Versions come from the Debian release, not pins: a rebuild picks up Debian's security updates.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY api ./api
COPY plugin ./plugin
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/venv/bin/pip install --only-binary=:all: /wheels/*.whl \
 && /opt/venv/bin/gpu-health-plugin --help > /dev/null \
 && /opt/venv/bin/gpu-health-plugin --version

# Stage 2: the runtime. Debian's python3 and the venv; no pip cache, no sources, no build tools.
FROM ${BASE_IMAGE}
# The same release as the build stage, so the same python3 the venv links to.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
# After the install steps, so a new revision or date does not invalidate their cached layers.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="gpu-health-device-plugin" \
      org.opencontainers.image.description="Kubernetes device plugin for NVIDIA GPUs with fine-grained health, recovery and reasons" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.documentation="docs/deploy.md"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Unprivileged by default (the demo, `status` and `watch` need nothing more). The DaemonSet runs the plugin as
# root with every capability dropped, because the kubelet's device-plugin directory and sockets belong to root.
USER 65532:65532
ENTRYPOINT ["gpu-health-plugin"]
CMD ["run"]
