"""Configuration shared by more than one service. Units are at each field. Torch-free."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelInfo:
    """What the scheduler and the gateway need to know about the model a worker loaded."""

    name: str
    max_model_len: int            # tokens: the context window (prompt + generated)
    vocab_size: int
    eos_token_ids: list[int]
    num_layers: int = 0
    block_size: int = 16          # tokens per KV block
    num_blocks: int = 0           # KV blocks the worker allocated (per layer)
    backend: str = ""             # what runs (DeviceBackend.describe()), e.g. "device cpu: attention
                                  # native avx2, kv bfloat16, linear int8 for <= 16 tokens"


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler.

    policy: a policy name, one of scheduler_svc.policies.POLICIES (the registry: this layer
        cannot see it; the Scheduler refuses an unknown name when it is built).
    token_budget: tau, tokens per iteration (decode tokens count too); sarathi and chunked_only.
    max_num_batched_tokens: tokens per iteration for policies with whole prefills (vllm, orca).
    max_num_seqs: cap on the running set (all policies).
    max_model_len: tokens; a request whose prompt + max_tokens exceed it is rejected.
    enable_prefix_caching: reuse full KV blocks with the same token prefix across requests.
    watermark: fraction of KV blocks kept free at admission so running decodes can grow.
    tile_size: if > 0, sarathi cuts the last chunk so the batch's token count is a multiple of
        tile_size when that drops fewer than tile_size tokens (paper section 4.3).
    adaptive_tbt_slo_s: if > 0 (seconds), sarathi's tau is set online from the observed
        iteration times to keep them under this TBT SLO (scheduler_svc/token_budget.py), between
        one tile (tile_size, or 32) and max_num_batched_tokens; token_budget is where it starts.
    speculative: "off", or the draft proposer of speculative decoding (scheduler_svc.speculative):
        draft tokens ride in the budget the decodes and prefills leave over.
    num_speculative_tokens: the most draft tokens one decode may carry per iteration (tokens).
    draft_model: with speculative "draft": the draft model (a GGUF file or model directory with the
        served model's tokenizer), run by the scheduler's process.
    kv_events_config: None, or JSON of the KV-cache event publisher (scheduler_svc/kv_events.py:
        endpoint, replay_endpoint, topic, hash_seed, connect), as vLLM's --kv-events-config.
    async_scheduling: plan batch n + 1 while batch n runs on the worker (one worker or one TP
        group; not with pipeline stages or disaggregation): a request whose chunk in
        batch n samples a token gets its next decode in batch n + 1 with that token still
        pending (shared.messages.PENDING_TOKEN), so the worker finds its next batch waiting
        when it finishes one, and scheduling, the wire and the worker's input preparation
        overlap the forward pass. Outputs are the same as without it: a request that finishes
        in batch n drops the token batch n + 1 computed for it. Requests with a grammar or
        penalties need each token on the host before their next step, and a decode with draft
        tokens (speculative decoding) must be verified before the next: while one is in
        flight the loop plans one batch at a time (speculation drafts at low load, where
        budget is left over; planning ahead takes over as drafts give way).
    """

    policy: str = "sarathi"
    token_budget: int = 512
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    tile_size: int = 0
    adaptive_tbt_slo_s: float = 0.0
    speculative: str = "off"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    kv_events_config: str | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("token_budget, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.adaptive_tbt_slo_s < 0:
            raise ValueError(f"the adaptive token budget's TBT SLO must be > 0 s, got {self.adaptive_tbt_slo_s}")

    @property
    def max_tokens_per_iteration(self) -> int:
        """Tokens one iteration may hold under any policy (tau or the whole-prefill cap): what a
        worker's profiling pass must cover (WorkerConfig.max_num_batched_tokens)."""
        return max(self.max_num_batched_tokens, self.token_budget)


DEFAULT_PLAN_FILE = "sarathi-plan.json"    # what `sarathi plan` writes and `--token-budget auto` reads


def read_plan(path: str | Path) -> int:
    """tau (tokens per iteration) from a plan file written by `sarathi plan`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"plan file not found: {p} (write one with `sarathi plan`)")
    try:
        tau = int(json.loads(p.read_text())["token_budget"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{p} is not a plan file (no integer token_budget)") from None
    if tau < 1:
        raise ValueError(f"{p}: token_budget must be >= 1, got {tau}")
    return tau


def resolve_token_budget(value: str | int) -> int:
    """--token-budget: an integer, `auto` (the plan file ./sarathi-plan.json), or a plan file."""
    if isinstance(value, int):
        return value
    v = str(value).strip()
    if v == "auto":
        return read_plan(DEFAULT_PLAN_FILE)
    try:
        return int(v)
    except ValueError:
        return read_plan(v)


@dataclass
class CacheConfig:
    """The paged KV cache: num_blocks blocks of block_size tokens, per layer."""

    block_size: int = 16
    num_blocks: int = 1024


@dataclass
class WorkerConfig:
    """How a worker loads and runs the model.

    model: a GGUF file or a Hugging Face-style directory; None = the default SmolLM2 GGUF.
    dtype: "auto" picks by measurement for the device; else "float32" or "bfloat16".
    num_threads: torch intra-op threads on CPU; 0 = leave torch's default.
    cache.num_blocks: 0 = auto: DEFAULT_CPU_BLOCKS on a CPU; on a GPU what fits in
        gpu_memory_utilization x its memory after a profiling pass of max_num_batched_tokens.
    attention: "auto" or a backend's named kernel (CPU: native, torch; CUDA: flashinfer, torch).
    cuda_graphs: capture CUDA graphs for decode-only batches of up to max_num_seqs (CUDA with
        FlashInfer only).
    kv_cache_dtype: "auto" (the device's default: 16-bit on CPU, the compute dtype on CUDA),
        "float32", "bfloat16" or "float16"; independent of dtype (exactness tests use float32).
    weight_quant: "auto" (the model as its files define it; CPU: a GGUF's quantized matrices on the file's
        own blocks for small batches, worker_svc/backends/cpu/gguf.py), "none" (float weights),
        "int8" (weight-only, a scale per 32 columns as Q8_0 blocks; worker_svc/backends/cpu/gguf.py) or
        "int8-bf16" (per-row int8 for small batches, bf16 GEMM above; not batch-invariant;
        worker_svc/backends/cpu/quant.py).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention: str = "auto"
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    kv_cache_dtype: str = "auto"
    weight_quant: str = "auto"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, e.g. the blocks that hold `a` tokens in blocks of `b`."""
    return -(-a // b)


def single_rank_layout() -> dict:
    """The replica layout of a worker that is one process (no TP, no PP): what its "info" reply
    names and what the scheduler assumes of a worker that names none. A fresh dict each call."""
    return {"rank": 0, "world_size": 1, "tp": 1, "pp": 1}


DEFAULT_CPU_BLOCKS = 2048      # KV blocks per layer when a CPU worker is asked for "auto" (0)


def rank_address(base: str, rank: int) -> str:
    """The ZeroMQ address of rank `rank` of a worker replica whose rank 0 is at `base`: TCP ports
    count up from base's (tcp://h:5555 -> rank 2 at tcp://h:5557); ipc paths and inproc names
    get a ".rank<N>" suffix. Rank 0 keeps `base`, so a one-rank worker is where it always was."""
    if rank == 0:
        return base
    if base.startswith("tcp://"):
        host, _, port = base.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"worker address {base!r} needs an explicit port for several ranks")
        return f"{host}:{int(port) + rank}"
    if base.startswith(("ipc://", "inproc://")):
        return f"{base}.rank{rank}"
    raise ValueError(f"unsupported ZeroMQ address {base!r}; use tcp://, ipc:// or inproc://")


@dataclass(frozen=True)
class ParallelConfig:
    """One rank's place in a tensor x pipeline parallel replica. rank: global rank 0 .. tp * pp - 1.
    pp_layers: layers per stage (sums to the model's layer count; None = balanced, earlier stages
    get the remainder). master_addr/master_port: the TCP rendezvous of torch.distributed (rank 0
    listens there unless store_hosted; port 0 = a free one, chosen by the launcher that starts
    every rank here).
    store_hosted: the launcher that starts every rank on this machine already listens there, on
    loopback (worker_svc.launcher.host_store), and every rank joins as a client: no rank binds
    the port, so no other process can take it between its choice and its use, and nothing off
    this machine reaches it. timeout_s: seconds a collective or recv may wait before the peer
    is declared lost."""

    tp: int = 1
    pp: int = 1
    rank: int = 0
    pp_layers: tuple[int, ...] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0
    store_hosted: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp}, stage {self.stage}/{self.pp})"


# -- one config object per process: what `sarathi worker | scheduler | gateway | serve` run --------
@dataclass
class WorkerServiceConfig:
    """A worker process: the engine it loads and where it listens.

    address: the ZeroMQ address to bind (tcp://host:port, ipc://path, inproc://name); rank r of a
    replica binds rank_address(address, r). parallel: None for a one-rank worker; with tp x pp > 1
    and no rank of its own (`sarathi worker --tp 2`) every rank is started on this machine.
    role: mixed | prefill | decode (prefill/decode disaggregation; reported in "info").
    kv_address: where this worker receives KV blocks from other workers, as they reach it
    (tcp://host:port listens on every interface on that port; tcp://host:0 binds host on any free
    port; kvstore.link.KvReceiver); None: no receiver (it cannot be a handoff target). It can
    always send KV blocks."""

    engine: WorkerConfig = field(default_factory=WorkerConfig)
    address: str = "tcp://0.0.0.0:5555"
    parallel: ParallelConfig | None = None
    role: str = "mixed"
    kv_address: str | None = None


@dataclass
class DisaggConfig:
    """Worker pools and prefill/decode disaggregation (scheduler_svc.pools, scheduler_svc.router).

    prefill_worker_addrs / decode_worker_addrs: one ZeroMQ address per prefill / decode worker
    (each a pool of its own; SchedulerServiceConfig.worker_addrs are then mixed workers, one pool
    each, when `separate_mixed` is set, else one replica as before).
    mode: off | all | auto. threshold_tokens: auto disaggregates a prompt whose uncached length on
    the decode worker is at least this. backlog_margin_tokens: auto keeps a long prompt colocated
    when the prefill pool's queued prefill tokens exceed the decode pool's by more than this.
    kv_transfer_timeout_s: the lease of one KV send (seconds). kv_transfer_failure: recompute | fail.
    """

    prefill_worker_addrs: list[str] = field(default_factory=list)
    decode_worker_addrs: list[str] = field(default_factory=list)
    separate_mixed: bool = False
    mode: str = "off"
    threshold_tokens: int = 256
    backlog_margin_tokens: int = 2048
    kv_transfer_timeout_s: float = 10.0
    kv_transfer_failure: str = "recompute"

    def __post_init__(self) -> None:
        if self.mode not in ("off", "all", "auto"):
            raise ValueError(f"--disaggregation must be off, all or auto, not {self.mode!r}")
        if self.kv_transfer_failure not in ("recompute", "fail"):
            raise ValueError(f"--kv-transfer-failure must be recompute or fail, not {self.kv_transfer_failure!r}")
        if self.mode != "off" and not self.prefill_worker_addrs:
            raise ValueError(f"--disaggregation {self.mode} needs at least one prefill worker")
        if self.prefill_worker_addrs and not self.decode_worker_addrs:
            raise ValueError("prefill workers need at least one decode worker to hand requests to")

    @property
    def enabled(self) -> bool:
        """True when the scheduler runs pools (several workers) instead of one replica."""
        return bool(self.prefill_worker_addrs or self.decode_worker_addrs or self.separate_mixed)


@dataclass
class SchedulerServiceConfig:
    """A scheduler process: its policy and limits, its queue, its workers, its HTTP endpoint.

    max_model_len: tokens, None = the model's (what the workers report); scheduler.max_model_len
        is replaced by min(this, the model's) once the workers answer.
    redis_url: the Redis queue; None = a queue object handed to run_scheduler (embedded mode).
    queue_prefix: Redis key prefix. consumer: the queue consumer name (None: stable per host; a
        restarted scheduler with the same name replays its own pending requests).
    worker_addrs: ZeroMQ addresses of every rank of this replica in rank order, or rank 0's alone.
    worker_timeout_s: seconds to wait for a batch's reply. worker_restart_timeout_s: seconds to
        hold the requests of a lost worker for a worker to answer again (then they fail).
    stall_timeout_s: seconds without a finished loop turn, with requests unfinished, after which
        /health answers 503 (0: worker_timeout_s + 60; never below worker_timeout_s).
    metrics_port: HTTP port of /metrics /health /ready /stats (None: no server; 0: any free port).
    disagg: worker pools and prefill/decode disaggregation (DisaggConfig); when enabled,
        worker_addrs are mixed workers, one pool each (with separate_mixed).
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    redis_url: str | None = None
    queue_prefix: str = "sarathi:"
    consumer: str | None = None
    worker_addrs: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    worker_timeout_s: float = 120.0
    worker_restart_timeout_s: float = 30.0
    stall_timeout_s: float = 0.0
    metrics_port: int | None = 9100
    metrics_host: str = "0.0.0.0"
    disagg: DisaggConfig = field(default_factory=DisaggConfig)


@dataclass
class GatewayConfig:
    """A gateway process. model: whose tokenizer and chat template (None: the default SmolLM2).
    max_model_len: tokens, None = the model's. max_queue_depth: queued requests beyond which new
    ones get 429. api_key: require `Authorization: Bearer <key>` on /v1/* and /metrics (required
    on a non-loopback host unless allow_unauthenticated). parse_control_tokens: control tokens
    spelled in chat messages count as control tokens (trusted clients only). drain_timeout_s: on
    SIGTERM, seconds for started requests to finish (new ones get 503)."""

    model: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    queue_prefix: str = "sarathi:"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_unauthenticated: bool = False
    parse_control_tokens: bool = False
    max_queue_depth: int = 1024
    max_model_len: int | None = None
    drain_timeout_s: float = 30.0
    log_level: str = "info"


@dataclass
class ServeConfig:
    """Embedded mode (`sarathi serve`): gateway, scheduler and one worker in one process tree.

    worker: the engine (worker.model is the model served). scheduler: the policy and limits.
    redis_url: None = the in-process queue. worker_mode: "process" (a child process, restarted
    when it dies) or "thread". The rest as in GatewayConfig / SchedulerServiceConfig.

    Worker pools (each worker a process of its own, every one with worker.num_threads threads):
    workers: colocated mixed workers (1 with no prefill/decode workers = one worker, as always);
    prefill_workers / decode_workers: prefill/decode disaggregation (scheduler_svc.pools);
    disaggregation: off | all | auto; disagg_threshold (tokens), disagg_backlog_margin (tokens),
    kv_transfer_timeout_s, kv_transfer_failure: see DisaggConfig. scheduler_port: also serve the
    scheduler's /metrics, /stats (per-request KV transfers) and /ready on this port (None: no)."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None
    queue_prefix: str = "sarathi:"
    max_model_len: int | None = None
    api_key: str | None = None
    allow_unauthenticated: bool = False    # as in GatewayConfig
    parse_control_tokens: bool = False     # as in GatewayConfig
    drain_timeout_s: float = 30.0
    worker_restart_timeout_s: float = 30.0
    worker_mode: str = "process"
    log_level: str = "info"
    workers: int = 1
    prefill_workers: int = 0
    decode_workers: int = 0
    disaggregation: str = "off"
    disagg_threshold: int = 256
    disagg_backlog_margin: int = 2048
    kv_transfer_timeout_s: float = 10.0
    kv_transfer_failure: str = "recompute"
    scheduler_port: int | None = None


    def __post_init__(self) -> None:
        if self.worker_mode not in ("process", "thread"):
            raise ValueError(f"worker_mode must be 'process' or 'thread', not {self.worker_mode!r}")
        if min(self.workers, self.prefill_workers, self.decode_workers) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.disaggregation not in ("off", "all", "auto"):
            raise ValueError(f"--disaggregation must be off, all or auto, not {self.disaggregation!r}")
        if self.prefill_workers and not self.decode_workers:
            raise ValueError("--prefill-workers needs --decode-workers >= 1 to hand requests to")
        if self.disaggregation != "off" and not self.prefill_workers:
            raise ValueError(f"--disaggregation {self.disaggregation} needs --prefill-workers >= 1")
        if self.prefill_workers and self.disaggregation == "off":
            raise ValueError("prefill workers run only with --disaggregation all or auto")
        if self.pools and self.worker_mode != "process":
            raise ValueError("several workers run as processes only (worker_mode 'process')")
        if not (self.workers or self.prefill_workers or self.decode_workers):
            raise ValueError("no worker to run")

    @property
    def pools(self) -> bool:
        """True when the scheduler runs worker pools rather than the one worker of before."""
        return self.workers != 1 or bool(self.prefill_workers or self.decode_workers)

    def worker_roles(self) -> list[str]:
        """One role per worker process, mixed first."""
        return ["mixed"] * (self.workers if self.pools else 1) + ["prefill"] * self.prefill_workers \
            + ["decode"] * self.decode_workers
