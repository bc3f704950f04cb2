# The plugin's container image: docs/deploy.md ("The image").
#
#   docker build -t gpu-health-device-plugin:0.1.0 .
#
# Both stages use one base image, so the venv built in the first stage runs unchanged in the second. Pin it by
# digest for reproducible builds: --build-arg PYTHON_IMAGE=python:3.12.12-slim-trixie@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.12.12-slim-trixie

# Stage 1: build the wheel, then install it and its dependencies into a venv. Dependencies come as binary wheels
# only (--only-binary), so no compiler is needed here and none can reach the runtime stage.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY plugin ./plugin
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install --only-binary=:all: /wheels/*.whl \
 && /opt/venv/bin/gpu-health-plugin --help > /dev/null

# Stage 2: the runtime. Python and the venv; no pip cache, no sources, no build tools.
FROM ${PYTHON_IMAGE}
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
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Unprivileged by default (the demo, `status` and `watch` need nothing more). The DaemonSet runs the plugin as
# root with every capability dropped, because the kubelet's device-plugin directory and sockets belong to root.
USER 65532:65532
ENTRYPOINT ["gpu-health-plugin"]
CMD ["run"]
