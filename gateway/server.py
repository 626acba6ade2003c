"""Running the gateway as a service: build tokenizer, model info and queue from a model path and
a Redis URL, then serve with uvicorn. `sarathi gateway` calls run_gateway.

A gateway reachable from other machines needs an API key: serve_app refuses to bind a
non-loopback address with an app that has none, unless told to (allow_unauthenticated), which it
then logs as a warning at start. The key comes from a flag, SARATHI_API_KEY or a file
(read_api_key; a Kubernetes Secret mounted as a file).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import signal
import threading
import time
from pathlib import Path

import uvicorn

from gateway.app import create_app
from shared.config import GatewayConfig, ModelInfo
from shared.model_source import ModelSource, resolve_model
from shared.queue import QueueConfig, make_gateway_queue
from shared.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def model_info_from_source(source: ModelSource, tokenizer, max_model_len: int | None = None) -> ModelInfo:
    """What the gateway needs to know about the model, read from its files (no weights loaded,
    no torch). max_model_len overrides the model's own context length (tokens); set it to the
    scheduler's limit when that is smaller."""
    if source.kind == "gguf":
        from shared.gguf_file import GgufFile  # numpy-only

        fields = GgufFile(source.path).fields
        arch = fields["general.architecture"]
        context = fields[f"{arch}.context_length"]
        layers = fields[f"{arch}.block_count"]
    else:
        cfg = json.loads((Path(source.path) / "config.json").read_text())
        context, layers = cfg.get("max_position_embeddings", 2048), cfg.get("num_hidden_layers", 0)
    return ModelInfo(name=source.name, max_model_len=int(max_model_len or context),
                     vocab_size=tokenizer.vocab_size, eos_token_ids=list(tokenizer.eos_token_ids),
                     num_layers=int(layers))


def build_gateway(config: GatewayConfig, gateway_id: str | None = None):
    """The app of a distributed-mode gateway (the Redis queue at config.redis_url)."""
    source = resolve_model(config.model)
    tokenizer = load_tokenizer(source)
    info = model_info_from_source(source, tokenizer, config.max_model_len)
    queue = make_gateway_queue(config.redis_url, config=QueueConfig(prefix=config.queue_prefix),
                               gateway_id=gateway_id)
    log.info("gateway %s: model %s (context %d tokens), queue %s", queue.gateway_id, info.name,
             info.max_model_len, config.redis_url)
    return create_app(tokenizer, info, queue, api_key=config.api_key, max_queue_depth=config.max_queue_depth,
                      parse_control_tokens=config.parse_control_tokens)


class UnauthenticatedBindError(ValueError):
    """A non-loopback bind without an API key and without the explicit opt-out (a ValueError:
    the command line prints it as one line)."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only. A host name
    other than localhost counts as reachable from outside (it is not resolved here)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_api_key(key: str | None, key_file: str | None) -> str | None:
    """The API key: `key` as given, or the first line of `key_file` (surrounding whitespace
    dropped), or None when neither is set. Both set, or an empty key, is a ValueError."""
    if key and key_file:
        raise ValueError("give the API key either directly or as a file, not both")
    if key_file:
        lines = Path(key_file).read_text().strip().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"the API key file {key_file} is empty")
    return key or None


def check_exposure(host: str, has_api_key: bool, allow_unauthenticated: bool = False) -> None:
    """Raise UnauthenticatedBindError when a server without an API key would bind `host`
    (non-loopback); with allow_unauthenticated, log a warning instead."""
    if is_loopback(host) or has_api_key:
        return
    if not allow_unauthenticated:
        raise UnauthenticatedBindError(
            f"refusing to serve on {host} without an API key: anyone who reaches the port could use "
            "the model. Set --api-key or --api-key-file (or SARATHI_API_KEY / SARATHI_API_KEY_FILE), "
            "bind 127.0.0.1, or pass --allow-unauthenticated to accept the risk")
    log.warning("SECURITY: serving on %s WITHOUT an API key (--allow-unauthenticated): anyone who can "
                "reach this port can generate and read /metrics", host)


class DrainingServer(uvicorn.Server):
    """uvicorn, with Kubernetes' shutdown: the first SIGTERM starts draining (new generation
    requests get 503, /ready answers 503, the port stays open so clients get that answer), the
    requests already started run to their end for up to drain_timeout_s seconds, then the server
    exits normally. A second SIGTERM, or SIGINT (Ctrl-C), exits at once, as plain uvicorn does."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float = 30.0):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        serving = getattr(getattr(self.config.app, "state", None), "serving", None)
        if sig == signal.SIGTERM and not self.draining and serving is not None:
            self.draining = serving.draining = True
            threading.Thread(target=self._drain, args=(serving,), name="drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self, serving) -> None:
        t0 = time.monotonic()
        log.info("SIGTERM: draining %d requests (up to %.0f s)", len(serving.active), self.drain_timeout_s)
        while serving.active and time.monotonic() - t0 < self.drain_timeout_s:
            time.sleep(0.05)
        if serving.active:
            log.warning("drain timeout: %d requests still running are cut off", len(serving.active))
        else:
            log.info("drained in %.1f s; exiting", time.monotonic() - t0)
        self.should_exit = True


def serve_app(app, *, host: str, port: int, log_level: str = "info", drain_timeout_s: float = 30.0,
              allow_unauthenticated: bool = False) -> None:
    """Run `app` (from create_app) with uvicorn until SIGTERM (drained) or SIGINT. Refuses a
    non-loopback host without an API key unless allow_unauthenticated (check_exposure)."""
    check_exposure(host, getattr(app.state, "has_api_key", True), allow_unauthenticated)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    DrainingServer(config, drain_timeout_s).run()


def run_gateway(config: GatewayConfig) -> None:
    """Serve until interrupted (SIGTERM drains: see DrainingServer)."""
    if not config.allow_unauthenticated:  # fail before loading anything (serve_app warns otherwise)
        check_exposure(config.host, bool(config.api_key))
    app = build_gateway(config)
    serve_app(app, host=config.host, port=config.port, log_level=config.log_level,
              drain_timeout_s=config.drain_timeout_s, allow_unauthenticated=config.allow_unauthenticated)
