"""`sarathi`: one console command for every role.

Every option but `generate --prompt` also reads an environment variable SARATHI_<OPTION>
(dashes -> underscores, upper case), so containers are configured without flags. Flags win
over the environment.
"""
from __future__ import annotations

import argparse
import os
import sys

from shared.config import POLICIES


def _env(name: str, default):
    raw = os.environ.get("SARATHI_" + name.upper().replace("-", "_"))
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    return type(default)(raw) if default is not None else raw


def _add(p: argparse.ArgumentParser, name: str, default, help: str, type=None, **kw) -> None:
    if isinstance(default, bool):
        p.add_argument(f"--{name}", default=_env(name, default), action=argparse.BooleanOptionalAction, help=help)
        return
    p.add_argument(f"--{name}", default=_env(name, default), type=type or (type_of(default)), help=help, **kw)


def type_of(default):
    return str if default is None else type(default)


def _model_args(p: argparse.ArgumentParser) -> None:
    _add(p, "model", None, "a GGUF file or HF-style model directory (default: SmolLM2-135M-Instruct)")
    _add(p, "dtype", "auto", "weights/activations dtype", choices=["auto", "float32", "bfloat16"])
    _add(p, "threads", 0, "torch CPU threads (0 = torch default)")
    _add(p, "num-blocks", 0, "KV cache blocks per layer (0 = auto: 2048 on CPU; on CUDA what fits "
         "in --gpu-memory-utilization after a profiling pass)")
    _add(p, "block-size", 16, "tokens per KV block")
    _add(p, "device", "cpu", "torch device: cpu or cuda[:n]")
    _add(p, "gpu-memory-utilization", 0.9, "CUDA: fraction of device memory for weights, activations "
         "and the KV cache (sizes the cache when --num-blocks is 0)")
    _add(p, "cuda-graphs", True, "CUDA: replay captured graphs for decode-only batches")


def _sched_args(p: argparse.ArgumentParser) -> None:
    _add(p, "policy", "sarathi", "batching policy", choices=list(POLICIES))
    _add(p, "token-budget", 512, "tau: tokens per iteration (sarathi, chunked_only)")
    _add(p, "max-num-seqs", 128, "cap on running requests")
    _add(p, "max-num-batched-tokens", 4096, "tokens per iteration for whole-prefill policies")
    _add(p, "prefix-caching", False, "reuse KV blocks of shared prompt prefixes")


def _net_args(p: argparse.ArgumentParser, gateway: bool) -> None:
    _add(p, "redis-url", None, "Redis URL (embedded mode: omit for an in-process queue)")
    _add(p, "queue-prefix", "sarathi:", "Redis key prefix of the queue's streams")
    _add(p, "max-model-len", 0, "context length in tokens (0 = the model's)")
    if gateway:
        _add(p, "host", "127.0.0.1", "HTTP bind address")
        _add(p, "port", 8000, "HTTP port")
        _add(p, "api-key", None, "require 'Authorization: Bearer <key>'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sarathi", description="Stall-free LLM serving (Sarathi-Serve).")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="offline generation: print the completion of a prompt")
    _model_args(p)
    _sched_args(p)
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for several)")
    _add(p, "max-tokens", 64, "tokens to generate at most")
    _add(p, "temperature", 0.0, "0 = greedy")
    _add(p, "top-p", 1.0, "nucleus sampling mass (1 = off)")
    _add(p, "top-k", -1, "keep the k most likely tokens (-1 = off)")
    _add(p, "seed", None, "makes sampling reproducible", type=int)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default: on)")

    p = sub.add_parser("serve", help="embedded mode: gateway + scheduler + worker on localhost")
    _model_args(p)
    _sched_args(p)
    _net_args(p, gateway=True)

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway (needs --redis-url)")
    _add(p, "model", None, "model whose tokenizer and chat template to use")
    _net_args(p, gateway=True)
    _add(p, "max-queue-depth", 1024, "queued requests beyond which new ones get 429")

    p = sub.add_parser("scheduler", help="the scheduler service (Redis queue in, ZeroMQ workers out)")
    _add(p, "model", None, "model (for its limits; weights are loaded by workers)")
    _sched_args(p)
    _net_args(p, gateway=False)
    _add(p, "worker-addr", "tcp://127.0.0.1:5555", "ZeroMQ address of the worker")
    _add(p, "metrics-port", 9100, "Prometheus port of the scheduler")
    _add(p, "consumer", None, "queue consumer name (default: stable per host; a restart replays its pending)")

    p = sub.add_parser("worker", help="a worker service: holds the model, runs batches from ZeroMQ")
    _model_args(p)
    _add(p, "bind", "tcp://0.0.0.0:5555", "ZeroMQ address to bind (rank r of a TP x PP replica: "
         "TCP port + r, or an ipc path + '.rank<r>')")
    _add(p, "max-num-seqs", 128, "CUDA: largest decode batch (graphs are captured up to it)")
    _add(p, "max-num-batched-tokens", 4096, "CUDA: tokens of the profiling pass that sizes the KV cache")
    _parallel_args(p)
    return parser


def _parallel_args(p: argparse.ArgumentParser) -> None:
    _add(p, "tp", 1, "tensor-parallel ranks per pipeline stage")
    _add(p, "pp", 1, "pipeline stages")
    _add(p, "pp-layers", "", "layers per stage, e.g. 16,14 (default: balanced)")
    _add(p, "rank", -1, "this process's rank, one process per rank (default: $RANK; neither: "
         "start all tp x pp ranks here)")
    _add(p, "world-size", 0, "ranks in the replica, checked against tp x pp (default: $WORLD_SIZE)")
    _add(p, "master-addr", "", "torch.distributed rendezvous host (default: $MASTER_ADDR or 127.0.0.1)")
    _add(p, "master-port", 0, "rendezvous port (default: $MASTER_PORT; 29500 with --rank; "
         "a free port when all ranks start here)")
    _add(p, "dist-timeout", 60.0, "seconds a collective waits before a rank is declared lost")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sarathi import commands  # heavy imports only after parsing (fast --help)

    try:
        return getattr(commands, args.cmd)(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"sarathi {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
