"""The scheduler service's Prometheus metrics and its small HTTP endpoint.

Names start with `sarathi_scheduler_`. Units: seconds, tokens, blocks, as in each name.
Gauges mirror `Scheduler.stats()` after every iteration; the iteration histograms observe every
batch the workers answered, through the engine loop's on_batch callback (the loop, not the
metrics, knows which batches are in flight).

Beside them, the model-server protocol of Kubernetes' inference gateway (what its endpoint picker
scrapes to score a replica), under vLLM's names and with vLLM's semantics (ModelServerMetrics).

HTTP (one port): /metrics (Prometheus text), /health (200 while the process runs), /ready (200
once the workers answered and the loop runs, else 503), /stats (JSON: the last stats snapshot,
e.g. num_free_blocks, for tests and operators).
"""
from __future__ import annotations

import json
import threading
import time
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from shared.messages import Batch

ITERATION_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)   # seconds
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)      # tokens
KV_SECONDS_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)   # seconds
KV_BYTES_BUCKETS = tuple(float(2 ** e) for e in range(16, 33, 2))            # 64 KiB .. 4 GiB


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        p, r = "sarathi_scheduler_", registry
        self.running = Gauge(p + "running_requests", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge(p + "waiting_requests", "Requests queued in the scheduler", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.free_blocks = Gauge(p + "kv_free_blocks", "KV blocks in the free pool", registry=r)
        self.total_blocks = Gauge(p + "kv_total_blocks", "KV blocks in the cache", registry=r)
        self.preemptions = Counter(p + "preemptions", "Requests preempted (recompute)", registry=r)
        self.iteration = Histogram(p + "iteration_seconds", "Time of one iteration on the workers",
                                   buckets=ITERATION_BUCKETS, registry=r)
        self.iter_tokens = Histogram(p + "iteration_tokens", "Tokens per iteration by kind",
                                     ["kind"], buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter(p + "tokens", "Tokens computed, by kind (prefill, decode, draft)",
                              ["kind"], registry=r)
        self.finished = Counter(p + "requests_finished", "Requests ended, by finish reason",
                                ["reason"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused at admission", registry=r)
        self.failed_iterations = Counter(p + "failed_iterations", "Iterations that failed (worker error, "
                                         "worker restart or internal error)", registry=r)
        self.worker_up = Gauge(p + "worker_up", "1 while the workers' links are up, 0 while "
                               "one is lost and its requests wait for it", registry=r)
        self.worker_up.set(1)
        self.worker_lost = Counter(p + "worker_lost", "Times a worker was lost (died or restarted) "
                                   "and the running requests were replayed", registry=r)
        self.policy = Gauge(p + "policy_info", "The batching policy (value 1)", ["policy"], registry=r)
        self.token_budget = Gauge(p + "token_budget", "tau: tokens per iteration", registry=r)
        self.worker_backend = Gauge(p + "worker_backend_info", "What the workers run: attention "
                                    "kernel, KV cache dtype, linear method (value 1)",
                                    ["model", "backend"], registry=r)
        self._preemptions_seen = 0
        # speculative decoding (scheduler_svc.speculative): drafts verified, drafts accepted
        self.spec_drafts = Counter(p + "spec_draft_tokens", "Draft tokens scheduled for verification "
                                   "(speculative decoding)", registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "Draft tokens the model accepted", registry=r)
        self.spec_acceptance = Gauge(p + "spec_acceptance_ratio", "Accepted / scheduled draft tokens since "
                                     "start", registry=r)
        self.spec_tokens_per_step = Gauge(p + "spec_tokens_per_step", "Tokens a decode with drafts "
                                          "produced per iteration, on average since start", registry=r)
        self._spec_seen = (0, 0)
        # worker pools and prefill/decode disaggregation (scheduler_svc.pools)
        self.kv_transfer = Histogram(p + "kv_transfer_seconds", "Per handed-off request: seconds of "
                                     "its KV send, prefill worker to decode worker, until the ack",
                                     buckets=KV_SECONDS_BUCKETS, registry=r)
        self.kv_bytes = Histogram(p + "kv_transfer_bytes", "Per handed-off request: KV bytes sent",
                                  buckets=KV_BYTES_BUCKETS, registry=r)
        self.ttft_phase = Histogram(p + "disagg_ttft_phase_seconds", "TTFT of handed-off requests split "
                                    "into queueing (arrival to first scheduled), prefill (to the first "
                                    "token) and transfer (the KV send)", ["phase"],
                                    buckets=ITERATION_BUCKETS, registry=r)
        self.pool_free_blocks = Gauge(p + "pool_kv_free_blocks", "KV blocks free on each worker pool",
                                      ["pool", "role"], registry=r)
        self.pool_total_blocks = Gauge(p + "pool_kv_total_blocks", "KV blocks of each worker pool",
                                       ["pool", "role"], registry=r)
        self.pool_up = Gauge(p + "pool_up", "1 while the pool's worker answers (its role as a label)",
                             ["pool", "role"], registry=r)
        self.pool_running = Gauge(p + "pool_running_requests", "Requests running on each pool",
                                  ["pool", "role"], registry=r)
        self.model_server = ModelServerMetrics(registry)

    def set_config(self, policy: str, token_budget: int) -> None:
        self.policy.labels(policy=policy).set(1)
        self.token_budget.set(token_budget)

    def set_worker(self, model: str, backend: str, block_size: int | None = None) -> None:
        """Once the workers answered: their ModelInfo.name, .backend (DeviceBackend.describe())
        and .block_size (tokens per KV block)."""
        self.worker_backend.labels(model=model, backend=backend or "unknown").set(1)
        self.model_server.set_model(model, block_size)

    def observe_stats(self, stats: dict) -> None:
        """Mirror a Scheduler.stats() snapshot (counters advance by the delta since the last)."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["kv_usage"])
        self.free_blocks.set(stats["num_free_blocks"])
        self.total_blocks.set(stats["num_total_blocks"])
        delta = stats["num_preemptions"] - self._preemptions_seen
        if delta > 0:
            self.preemptions.inc(delta)
        self._preemptions_seen = stats["num_preemptions"]
        if "spec_proposed_tokens" in stats:
            drafts, accepted = stats["spec_proposed_tokens"], stats["spec_accepted_tokens"]
            self.spec_drafts.inc(max(0, drafts - self._spec_seen[0]))
            self.spec_accepted.inc(max(0, accepted - self._spec_seen[1]))
            self._spec_seen = (drafts, accepted)
            self.spec_acceptance.set(accepted / drafts if drafts else 0.0)
            self.spec_tokens_per_step.set(stats["spec_tokens_per_step"])
        self.model_server.observe_stats(stats)

    def observe_pools(self, pools: list[dict]) -> None:
        """One PoolSet.stats()["pools"] snapshot: each pool's blocks, requests and liveness."""
        for ps in pools:
            labels = dict(pool=ps["name"], role=ps["role"])
            self.pool_free_blocks.labels(**labels).set(ps["num_free_blocks"])
            self.pool_total_blocks.labels(**labels).set(ps["num_total_blocks"])
            self.pool_up.labels(**labels).set(1 if ps["up"] else 0)
            self.pool_running.labels(**labels).set(ps["running"])

    def observe_transfer(self, rec) -> None:
        """One handed-off request (scheduler_svc.pools.TransferRecord)."""
        self.kv_transfer.observe(rec.kv_transfer_s)
        self.kv_bytes.observe(rec.kv_bytes)
        for phase, seconds in (("queueing", rec.queue_s), ("prefill", rec.prefill_s),
                               ("transfer", rec.kv_transfer_s)):
            self.ttft_phase.labels(phase=phase).observe(seconds)

    def observe_batch(self, batch: Batch, seconds: float) -> None:
        """One batch the workers answered: seconds from submit to collect, its tokens by kind."""
        decode = sum(1 for s in batch.seqs if s.is_decode or s.num_draft_tokens)
        drafts = sum(s.num_draft_tokens for s in batch.seqs)
        prefill = batch.num_tokens - decode - drafts
        self.iteration.observe(seconds)
        for kind, n in (("prefill", prefill), ("decode", decode)) + ((("draft", drafts),) if drafts else ()):
            self.iter_tokens.labels(kind=kind).observe(n)
            self.tokens.labels(kind=kind).inc(n)


class ModelServerMetrics:
    """The metrics the inference gateway's endpoint picker reads from a model server (its
    model-server protocol), named and meant as vLLM's, labelled model_name and engine as vLLM's:

    vllm:num_requests_waiting   gauge: requests queued on this replica, not yet running: the
                                scheduler's waiting queue (preempted ones included, as vLLM's) plus
                                what `backlog` reports queued in front of it on this replica
    vllm:num_requests_running   gauge: requests in the running set (holding KV blocks)
    vllm:kv_cache_usage_perc    gauge: fraction (0..1, not percent, as vLLM's) of KV blocks held by
                                requests; cached blocks no request holds count as free (evictable)
    vllm:gpu_cache_usage_perc   the same value under the older name (older pickers read it)
    vllm:num_preemptions        counter: requests preempted
    vllm:prefix_cache_queries   counter: tokens looked up in the prefix cache at admission
    vllm:prefix_cache_hits      counter: of those, tokens found cached
    vllm:cache_config_info      gauge 1 with labels block_size and num_gpu_blocks (the picker's
                                prefix-cache scorer sizes its index from them)
    vllm:lora_requests_info     gauge: a timestamp (s) with labels max_lora="0" and no running or
                                waiting adapters: this server loads no LoRA adapters

    Samples appear once the model is known (set_model: the workers answered).
    """

    def __init__(self, registry: CollectorRegistry, engine: str = "0"):
        r, labels = registry, ["model_name", "engine"]
        self.engine = engine
        self.model: str | None = None
        self.block_size: int | None = None
        self.backlog: Callable[[], int] = lambda: 0
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              labels, registry=r)
        self.gpu_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                               "(older name of vllm:kv_cache_usage_perc).", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of "
                                      "number of queried tokens.", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                   "cached tokens.", labels, registry=r)
        self.cache_info = Gauge("vllm:cache_config_info", "Information of the KV cache configuration "
                                "(value 1).", labels + ["block_size", "num_gpu_blocks"], registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                               registry=r)
        self._seen = {"num_preemptions": 0, "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0}
        self._cache_labels: tuple | None = None

    def set_model(self, model: str, block_size: int | None = None) -> None:
        """The served model (the model_name label) and the KV block size (tokens): the samples
        appear from now on, at 0 until the first stats snapshot."""
        self.model, self.block_size = model, block_size
        lab = dict(model_name=model, engine=self.engine)
        for metric in (self.waiting, self.running, self.kv_usage, self.gpu_usage, self.preemptions,
                       self.prefix_queries, self.prefix_hits):
            metric.labels(**lab)

    def observe_stats(self, stats: dict) -> None:
        """Mirror a Scheduler.stats() snapshot (or a PoolSet's: its totals)."""
        if self.model is None:
            return
        lab = dict(model_name=self.model, engine=self.engine)
        self.waiting.labels(**lab).set(stats["waiting"] + max(0, int(self.backlog())))
        self.running.labels(**lab).set(stats["running"])
        self.kv_usage.labels(**lab).set(stats["kv_usage"])
        self.gpu_usage.labels(**lab).set(stats["kv_usage"])
        for key, counter in (("num_preemptions", self.preemptions),
                             ("prefix_cache_query_tokens", self.prefix_queries),
                             ("prefix_cache_hit_tokens", self.prefix_hits)):
            value = stats.get(key, 0)
            if value > self._seen[key]:
                counter.labels(**lab).inc(value - self._seen[key])
            self._seen[key] = value
        cache = (str(self.block_size or ""), str(stats["num_total_blocks"]))
        if cache != self._cache_labels:
            if self._cache_labels is not None:
                self.cache_info.remove(self.model, self.engine, *self._cache_labels)
            self.cache_info.labels(**lab, block_size=cache[0], num_gpu_blocks=cache[1]).set(1)
            self._cache_labels = cache
        self.lora_info.labels(**lab, max_lora="0", running_lora_adapters="",
                              waiting_lora_adapters="").set(time.time())


def queue_backlog(queue) -> Callable[[], int]:
    """Requests queued on this replica that its scheduler has not pulled yet: the in-process
    queue's (embedded mode: the replica's own queue). A shared Redis stream's backlog belongs to
    no one replica, so it counts 0 there."""
    broker = getattr(queue, "broker", None)
    waiting = getattr(broker, "waiting", None)
    if waiting is None:
        return lambda: 0
    return lambda: len(broker.waiting)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # probes every few seconds would flood the log
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def start_http(port: int, host: str, registry: CollectorRegistry, is_ready: Callable[[], bool],
               stats: Callable[[], dict], health: Callable[[], tuple[bool, str]] | None = None
               ) -> tuple[WSGIServer, threading.Thread]:
    """Serve /metrics, /health, /ready and /stats on host:port in a daemon thread (port 0:
    any free port; read it from server.server_port). health: (healthy, reason) for /health
    (200 or 503 with the reason; default: always healthy)."""
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path == "/health":
            ok, reason = health() if health is not None else (True, "ok")
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable", reason)
        if path == "/ready":
            ok = is_ready()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable",
                         "ready" if ok else "not ready")
        if path == "/stats":
            body = json.dumps(stats()).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        return metrics_app(environ, start_response)

    server = make_server(host, port, app, _ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="scheduler-http", daemon=True)
    thread.start()
    return server, thread


def _text(start_response, status: str, body: str):
    start_response(status, [("Content-Type", "text/plain")])
    return [body.encode()]
