# syntax=docker/dockerfile:1
# kvrouter gateway image (also runs the emulated engine: `kvrouter-loadtest emulate`). Runtime deps only:
# the core dependencies of pyproject.toml, no dev/loadtest extras, no compiler, no curl.
# Build: docker build -t kvrouter:dev .     Run: docker run -p 8080:8080 kvrouter:dev --backend sglang=http://h:30000
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/kvrouter
# README* may not exist: the glob keeps the COPY valid either way.
COPY pyproject.toml README* ./
COPY router ./router
COPY loadtest ./loadtest
# A regular (non-editable) install, then bytecode compiled here because the runtime filesystem is read-only.
RUN /opt/kvrouter/bin/pip install --no-cache-dir --no-compile /src \
    && /opt/kvrouter/bin/python -m compileall -q -j 0 /opt/kvrouter/lib

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvrouter" \
      org.opencontainers.image.description="KV-aware DP-rank router for MLA models (SGLang, vLLM)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvrouter \
    && useradd --system --uid 10001 --gid kvrouter --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvrouter
COPY --from=build /opt/kvrouter /opt/kvrouter
ENV PATH=/opt/kvrouter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVROUTER_HOST=0.0.0.0 \
    KVROUTER_PORT=8080
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
# Liveness without curl: the image's own Python asks /health on the configured port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTER_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["kvrouter", "serve"]
