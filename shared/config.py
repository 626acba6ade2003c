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
    """

    policy: str = "sarathi"
    token_budget: int = 512
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    tile_size: int = 0

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("token_budget, max_num_seqs and max_num_batched_tokens must be >= 1")


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
    weight_quant: "auto" (CPU: int8 for small batches where the int8 kernel pays), "none",
        "int8" (weight-only, per output channel; worker_svc/backends/cpu/quant.py) or "int8-bf16" (int8 for
        small batches, bf16 GEMM above; not batch-invariant).
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
