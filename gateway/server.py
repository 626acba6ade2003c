"""Running the gateway as a service: build tokenizer, model info and queue from a model path and
a Redis URL, then serve with uvicorn. `sarathi gateway` calls run_gateway."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import uvicorn

from gateway.app import create_app
from shared.config import ModelInfo
from shared.model_source import ModelSource, resolve_model
from shared.queue import QueueConfig, make_gateway_queue
from shared.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def model_info_from_source(source: ModelSource, tokenizer, max_model_len: int | None = None) -> ModelInfo:
    """What the gateway needs to know about the model, read from its files (no weights loaded,
    no torch). max_model_len overrides the model's own context length (tokens); set it to the
    scheduler's limit when that is smaller."""
    if source.kind == "gguf":
        from gguf import GGUFReader  # numpy-only

        fields = GGUFReader(source.path).fields
        arch = fields["general.architecture"].contents()
        context = fields[f"{arch}.context_length"].contents()
        layers = fields[f"{arch}.block_count"].contents()
    else:
        cfg = json.loads((Path(source.path) / "config.json").read_text())
        context, layers = cfg.get("max_position_embeddings", 2048), cfg.get("num_hidden_layers", 0)
    return ModelInfo(name=source.name, max_model_len=int(max_model_len or context),
                     vocab_size=tokenizer.vocab_size, eos_token_ids=list(tokenizer.eos_token_ids),
                     num_layers=int(layers))


def build_gateway(model: str | None, redis_url: str, *, max_model_len: int | None = None,
                  queue_prefix: str = "sarathi:", gateway_id: str | None = None, **app_kwargs):
    """The app of a distributed-mode gateway (Redis queue). app_kwargs go to create_app."""
    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    info = model_info_from_source(source, tokenizer, max_model_len)
    queue = make_gateway_queue(redis_url, config=QueueConfig(prefix=queue_prefix), gateway_id=gateway_id)
    log.info("gateway %s: model %s (context %d tokens), queue %s", queue.gateway_id, info.name,
             info.max_model_len, redis_url)
    return create_app(tokenizer, info, queue, **app_kwargs)


def run_gateway(model: str | None = None, *, redis_url: str = "redis://127.0.0.1:6379/0",
                host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                max_queue_depth: int = 1024, max_model_len: int | None = None,
                queue_prefix: str = "sarathi:", log_level: str = "info") -> None:
    """Serve until interrupted. model: as for resolve_model (None = the default SmolLM2)."""
    app = build_gateway(model, redis_url, max_model_len=max_model_len, queue_prefix=queue_prefix,
                        api_key=api_key, max_queue_depth=max_queue_depth)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
