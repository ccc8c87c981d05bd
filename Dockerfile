# syntax=docker/dockerfile:1
# kvroute: one image for the gateway (`kvroute gateway`) and the worker agent (`kvroute agent`).
#
#   docker build -t <registry>/kvroute:0.1.0 .
#   docker run --rm -p 8000:8000 -v $PWD/gateway.yaml:/etc/kvroute/gateway.yaml:ro \
#     <registry>/kvroute:0.1.0 gateway --config /etc/kvroute/gateway.yaml --host 0.0.0.0
#
# The Helm chart in deploy/helm/kvroute runs it with a read-only root file system as UID 10001.

# The Python the test suite runs on (3.11: pyproject's mypy/ruff targets, scripts/setup's
# .venv). Pin by digest for reproducible builds, e.g.
#   --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:<digest>
# (`docker buildx imagetools inspect python:3.11-slim-bookworm` prints it; no registry was
# reachable where this file was written, so no digest is filled in here).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: install kvroute and its dependencies into a virtualenv -------------------------
FROM ${PYTHON_IMAGE} AS build
# gcc builds the compiled key function (gateway/routing/_keys.c -> gateway.routing._ckeys), the
# untracked id tuples (gateway/tokenization/_ids.c -> gateway.tokenization._ids) and the
# routing core mypyc compiles (setup.py); the python image ships the headers. Only this
# stage has it: the runtime copies the venv.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvroute
WORKDIR /src
# Dependencies first (a layer that survives source edits): exactly the locked files
# (scripts/lock-requirements), hashes checked; then the package itself.
COPY requirements.lock ./
RUN /opt/kvroute/bin/pip install --require-hashes --no-deps --only-binary=:all: -r requirements.lock
COPY pyproject.toml setup.py README.md ./
COPY gateway/ gateway/
COPY worker_agent/ worker_agent/
COPY loadtest/ loadtest/
# the extensions are optional to setuptools; the image must have them (checked by the imports:
# the C keys, and the routing core compiled by mypyc, which the build environment installs)
RUN /opt/kvroute/bin/pip install --no-deps . \
    && cd / && /opt/kvroute/bin/python -c "import gateway.routing._ckeys, gateway.tokenization._ids" \
    && /opt/kvroute/bin/python -c "import sys, gateway.routing.policy as m; sys.exit(not m.__spec__.origin.endswith('.so'))" \
    && /opt/kvroute/bin/kvroute gateway --help > /dev/null \
    && /opt/kvroute/bin/kvroute agent --help > /dev/null

# ---- runtime --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.description="Cache-aware routing gateway for LLM inference (gateway and worker agent)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvroute \
    && useradd --system --uid 10001 --gid kvroute --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/kvroute /opt/kvroute
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 10001:10001
# 8000: gateway API and /metrics; 9400: agent /metrics (as the Helm chart configures them)
EXPOSE 8000 9400
ENTRYPOINT ["kvroute"]
CMD ["--help"]
