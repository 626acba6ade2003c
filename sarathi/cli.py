"""`sarathi`: one console command for every role.

Every option but `generate --prompt` also reads an environment variable SARATHI_<OPTION>
(dashes -> underscores, upper case), so containers are configured without flags. Flags win
over the environment.
"""
from __future__ import annotations

import argparse
import os
import sys

from scheduler_svc.policies import POLICIES
from scheduler_svc.speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS


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
    _add(p, "kv-cache-dtype", "auto", "KV cache dtype, independent of --dtype (auto: 16-bit on CPU, "
         "--dtype on CUDA)", choices=["auto", "float32", "bfloat16", "float16"])
    _add(p, "weight-quant", "auto", "how the linear layers' weights are kept (auto: as the model's files "
         "define them: a GGUF on its own quantized blocks, equal to Hugging Face on the same file; a float "
         "checkpoint in its precision; none: float weights, a GGUF exactly dequantized; int8: re-quantized "
         "to int8 with a scale per 32 columns (Q8_0 blocks), near-lossless; int8-bf16: per-row int8 for small "
         "batches, bf16 GEMM above: "
         "~2x faster prefill on CPUs with bf16 dot products, but outputs then depend on batch composition)",
         choices=["auto", "none", "int8", "int8-bf16"])


def _sched_args(p: argparse.ArgumentParser) -> None:
    _add(p, "policy", "sarathi", "batching policy", choices=list(POLICIES))
    _add(p, "token-budget", "512", "tau: tokens per iteration (sarathi, chunked_only): a number, "
         "a plan file written by `sarathi plan`, auto (= ./sarathi-plan.json), or adaptive (sarathi: tau "
         "follows the observed iteration times to stay under --tbt-slo, within [32, --max-num-batched-tokens])")
    _add(p, "tbt-slo", 0.0, "P99 TBT SLO in seconds: what --token-budget adaptive keeps iterations under, "
         "and the capacity criterion of bench / capacity / simulate")
    _add(p, "max-num-seqs", 128, "cap on running requests")
    _add(p, "max-num-batched-tokens", 4096, "tokens per iteration for whole-prefill policies")
    _add(p, "prefix-caching", False, "reuse KV blocks of shared prompt prefixes")
    _add(p, "speculative", "off", "speculative decoding: draft tokens verified in the same forward pass, "
         "only from the token budget that decodes and prefills leave over (so never at saturation): off, "
         "ngram (prompt lookup over the request's own tokens), suffix (also over recent outputs), draft "
         "(a smaller model with the same tokenizer: --draft-model)", choices=list(SPECULATIVE_METHODS))
    _add(p, "num-speculative-tokens", 4, f"with --speculative: the most draft tokens per decode and "
         f"iteration, 1 to {MAX_SPECULATIVE_TOKENS} (each request's own number follows its acceptance rate)")
    _add(p, "draft-model", None, "with --speculative draft: the draft model (same tokenizer)")
    _add(p, "kv-events-config", None, "publish KV-cache events in vLLM's format (with --prefix-caching), "
         "JSON: endpoint (default tcp://127.0.0.1:5557), replay_endpoint (tcp://127.0.0.1:5558), topic, "
         "hash_seed (\"0\"), connect (false: bind); see docs/scale-out.md")
    _add(p, "async-scheduling", False, "plan the next batch while the worker runs this one (outputs "
         "unchanged; not with pipeline stages or disaggregation); see docs/architecture.md")


def _net_args(p: argparse.ArgumentParser, gateway: bool) -> None:
    _add(p, "redis-url", None, "Redis URL (embedded mode: omit for an in-process queue); rediss:// for TLS")
    _add(p, "redis-password-file", None, "a file holding the Redis password (e.g. a mounted Secret)")
    _add(p, "redis-tls-ca-file", None, "rediss://: the CA certificate that signed the Redis server's")
    _add(p, "queue-prefix", "sarathi:", "Redis key prefix of the queue's streams")
    _add(p, "max-model-len", 0, "context length in tokens (0 = the model's)")
    if gateway:
        _add(p, "host", "127.0.0.1", "HTTP bind address")
        _add(p, "port", 8000, "HTTP port")
        _add(p, "api-key", None, "require 'Authorization: Bearer <key>' on /v1/* and /metrics (needed to "
             "bind a non-loopback --host)")
        _add(p, "api-key-file", None, "read the API key from the first line of this file (a mounted Secret)")
        _add(p, "allow-unauthenticated", False, "serve a non-loopback --host without an API key (anyone who "
             "reaches the port can use it; logged as a warning)")
        _add(p, "parse-control-tokens", False, "control tokens spelled in chat messages (<|im_start|>...) count "
             "as control tokens, not text: for trusted clients only, it lets them forge turns and roles")
        _add(p, "drain-timeout", 30.0, "on SIGTERM: seconds for started requests to finish (new ones get 503)")


def _disagg_args(p: argparse.ArgumentParser) -> None:
    _add(p, "disaggregation", "off", "prefill/decode disaggregation: off (colocated), all (every prompt is "
         "prefilled on a prefill worker, its KV sent to a decode worker), auto (only prompts whose uncached "
         "length is >= --disagg-threshold, while the prefill workers are not the bottleneck)",
         choices=["off", "all", "auto"])
    _add(p, "disagg-threshold", 256, "auto: the shortest uncached prompt (tokens) sent to a prefill worker")
    _add(p, "disagg-backlog-margin", 2048, "auto: a long prompt stays colocated when the prefill worker's "
         "queued prefill tokens exceed the decode worker's by more than this (the prefill pool is the bottleneck)")
    _add(p, "kv-transfer-timeout", 10.0, "seconds one KV send (prefill worker to decode worker) may take: the "
         "lease on the prefill side's blocks")
    _add(p, "kv-transfer-failure", "recompute", "a failed or timed-out KV send: recompute the request "
         "colocated, or fail it", choices=["recompute", "fail"])


def _liveness_args(p: argparse.ArgumentParser) -> None:
    _add(p, "worker-restart-timeout", 30.0,
         "seconds to hold a lost worker's requests for a worker to answer again (then they fail)")


def _link_args(p: argparse.ArgumentParser) -> None:
    _add(p, "link-keys", None, "directory of internal-link keys made by `sarathi keys` (ZeroMQ CURVE on "
         "tcp:// links); the keys can also come in SARATHI_LINK_SECRET_KEY and friends (docs/internal-links.md)")
    _add(p, "insecure-links", False, "allow plain (unauthenticated) internal links on a non-loopback "
         "address: only on a network where everyone who can reach it may drive the workers")


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
    _liveness_args(p)
    _add(p, "workers", 1, "colocated (mixed) worker processes, one scheduler pool each (with "
         "--prefill-workers: mixed workers beside them, default 0 then)", type=int)
    _add(p, "prefill-workers", 0, "prefill worker processes (prefill/decode disaggregation)")
    _add(p, "decode-workers", 0, "decode worker processes (prefill/decode disaggregation)")
    _disagg_args(p)
    _add(p, "scheduler-port", None, "also serve the scheduler's /metrics, /ready and /stats (JSON; "
         "kv_transfers: per handed-off request kv_bytes, kv_transfer_s, queue_s, prefill_s) on this port",
         type=int)

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway (needs --redis-url)")
    _add(p, "model", None, "model whose tokenizer and chat template to use")
    _net_args(p, gateway=True)
    _add(p, "max-queue-depth", 1024, "queued requests beyond which new ones get 429")

    p = sub.add_parser("scheduler", help="the scheduler service (Redis queue in, ZeroMQ workers out)")
    _add(p, "model", None, "accepted for symmetry with the other services: the scheduler serves what its "
         "workers loaded")
    _sched_args(p)
    _net_args(p, gateway=False)
    _add(p, "worker-addr", "tcp://127.0.0.1:5555", "ZeroMQ address of the worker (comma-separated: the "
         "ranks of one TP x PP replica; with prefill/decode workers: mixed workers, one pool each)")
    _add(p, "prefill-worker-addrs", "", "comma-separated ZeroMQ addresses of prefill workers (one pool each)")
    _add(p, "decode-worker-addrs", "", "comma-separated ZeroMQ addresses of decode workers (one pool each; "
         "started with --kv-address)")
    _disagg_args(p)
    _add(p, "metrics-port", 9100, "Prometheus port of the scheduler")
    _add(p, "stall-timeout", 0.0, "seconds the scheduling loop may go without finishing a turn while "
         "requests are unfinished before /health answers 503 (0: the worker reply timeout + 60)")
    _add(p, "consumer", None, "queue consumer name (default: stable per host; a restart replays its pending)")
    _liveness_args(p)
    _link_args(p)

    p = sub.add_parser("worker", help="a worker service: holds the model, runs batches from ZeroMQ")
    _model_args(p)
    _add(p, "bind", "tcp://127.0.0.1:5555", "ZeroMQ address to bind (rank r of a TP x PP replica: "
         "TCP port + r, or an ipc path + '.rank<r>'); another interface than loopback needs --link-keys "
         "(or --insecure-links)")
    _add(p, "max-num-seqs", 128, "CUDA: largest decode batch (graphs are captured up to it)")
    _add(p, "max-num-batched-tokens", 4096, "CUDA: tokens of the profiling pass that sizes the KV cache")
    _add(p, "role", "mixed", "mixed (prefill and decode), prefill or decode (prefill/decode "
         "disaggregation)", choices=["mixed", "prefill", "decode"])
    _add(p, "kv-address", None, "ZeroMQ address where this worker receives KV blocks from prefill workers "
         "(decode workers), as prefill workers reach it, e.g. tcp://decode-0:5600 (tcp: every interface of this "
         "host listens on that port; ipc://path also works on one machine)")
    _parallel_args(p)
    _link_args(p)

    p = sub.add_parser("keys", help="write a key set for the internal links (ZeroMQ CURVE): the workers' "
                       "and the scheduler's keypairs and the allow-lists")
    p.add_argument("out", help="directory to write (created, mode 0700; secret files 0600)")
    p.add_argument("--force", action="store_true", help="replace a key set already there")

    _measure_parsers(sub)
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


def _executor_args(p: argparse.ArgumentParser) -> None:
    _add(p, "executor", "real", "real: the torch engine in this process; sim: a simulated worker "
         "whose iteration time comes from --profile's cost model (a synthetic one without it)",
         choices=["real", "sim"])
    _add(p, "profile", None, "profile JSON from `sarathi profile` (cost model, SLOs, model limits)")


def _workload_args(p: argparse.ArgumentParser, http: bool = True) -> None:
    _add(p, "trace", None, "CSV of request lengths (default: the ShareGPT-4 length trace shipped in "
         "sarathi/measure/data)")
    _add(p, "prompt-column", "num_prefill_tokens", "trace column of prompt lengths (tokens)")
    _add(p, "output-column", "num_decode_tokens", "trace column of output lengths (tokens)")
    _add(p, "length-scale", 1.0, "multiply every trace length by this (e.g. 0.125 on a CPU)")
    _add(p, "num-requests", 100, "requests per run (per probe for capacity)")
    _add(p, "duration", 0.0, "> 0: a run is this many seconds of arrivals (qps x duration requests; overrides "
         "--num-requests)")
    _add(p, "arrival", "poisson", "arrival process", choices=["poisson", "gamma", "burst"])
    _add(p, "cv", 1.0, "coefficient of variation of gamma inter-arrival times")
    _add(p, "burst-size", 8, "requests per burst (--arrival burst)")
    _add(p, "seed", 0, "workload seed (lengths, arrivals, prompt ids)")
    _add(p, "drain", 60.0, "seconds to wait after the last arrival; unfinished requests are misses")
    if http:
        _add(p, "url", None, "an OpenAI-compatible server to load over streamed HTTP instead of in-process")
        _add(p, "api-key", None, "bearer key for --url")
        _add(p, "served-model", None, "model name to request at --url (default: the first /v1/models lists)")
        _add(p, "vocab-size", 32000, "prompt token ids are drawn below this (--url; in-process: the model's)")
    _add(p, "out", None, "output prefix: writes <out>.json and <out>.png")
    _add(p, "progress", True, "show a progress bar")


def _sim_device_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    from sarathi.measure.gpu_costmodel import DEVICES, MODELS, TOPOLOGIES

    _add(p, "device", "a100" if required else None, "simulated GPU (operator profiles measured on A100; "
         "H100 and H200 scaled by roofline from measured GEMM rates and copy bandwidths)", choices=list(DEVICES))
    _add(p, "model", "llama-3-8b", "model shape (others than the profiled Llama-2-7B / Llama-3-8B are "
         "scaled from them by weight size)", choices=list(MODELS))
    _add(p, "tp", 1, "tensor-parallel degree (1, 2, 4, 8)")
    _add(p, "pp", 1, "pipeline stages (the scheduler keeps this many micro-batches in flight)")
    _add(p, "topology", "a100_dgx", "network profile for TP all-reduce and PP send/recv",
         choices=list(TOPOLOGIES))
    if required:
        _add(p, "profile", None, "instead of a GPU: a profile JSON from `sarathi profile` (its fitted CPU "
             "cost model, one stage)")


def _slo_args(p: argparse.ArgumentParser, tbt: bool = False) -> None:
    if tbt:   # commands with _sched_args have --tbt-slo from there
        _add(p, "tbt-slo", 0.0, "P99 TBT SLO in seconds (or take --slo from --profile)")
    _add(p, "slo", None, "strict or relaxed: the SLO from --profile (5x / 25x a batch-32 decode)",
         choices=["strict", "relaxed"])


def _measure_parsers(sub) -> None:
    p = sub.add_parser("bench", help="open-loop load generator: latency metrics at one or more QPS")
    _model_args(p)
    _sched_args(p)
    _executor_args(p)
    _workload_args(p)
    _add(p, "qps", "1.0", "mean request rate(s), comma-separated for a latency-throughput curve")
    _add(p, "details", True, "keep the per-request token times and per-iteration log in the JSON")
    _slo_args(p)

    p = sub.add_parser("capacity", help="binary search for the highest QPS within the TBT SLO")
    _model_args(p)
    _sched_args(p)
    _executor_args(p)
    _workload_args(p)
    _slo_args(p)
    _add(p, "qps-start", 1.0, "first QPS probed")
    _add(p, "resolution", 0.05, "stop when (hi - lo) / hi <= this")
    _add(p, "max-sched-delay", 2.0, "P50 scheduling delay bound (s), the paper's 2 s")
    _add(p, "max-ttft-p50", 0.0, "optional P50 TTFT bound in seconds (0 = none)")

    p = sub.add_parser("simulate", help="the real scheduler against a simulated GPU (or profiled) worker "
                       "on a virtual clock: latency at QPS, or a capacity search")
    _sim_device_args(p)
    _add(p, "replicas", 1, "independent replicas (each its own scheduler and worker); --routing says how "
         "arrivals reach them")
    _add(p, "routing", "least-unfinished", "with --replicas: least-unfinished (the fewest unfinished requests), "
         "shared-queue (the shared queue's pull: an idle replica takes a request at once, a busy one at its next "
         "iteration), or the inference gateway's endpoint picker: least-queue (queue + KV-usage scorers), prefix "
         "(prefix-cache scorer from the KV-cache events; needs --prefix-caching), mix (prefix 3 + queue 1 + KV 1), "
         "mix-lowq (mix after the picker's low-queue filter: replicas with at most 4 requests waiting), "
         "mix-fc (mix behind the picker's flow control: requests wait in the picker while the pool is saturated), "
         "kv-cost (NVIDIA Dynamo's KV router: the lowest cost of prefill blocks to compute + KV blocks held), "
         "cache-aware (SGLang's router: the longest prefix match unless the loads are imbalanced)",
         choices=["least-unfinished", "shared-queue", "least-queue", "prefix", "mix", "mix-lowq", "mix-fc",
                  "kv-cost", "cache-aware"])
    _add(p, "workload", "trace", "trace: one request per trace row; chat: multi-turn conversations (turns share "
         "a growing prefix, system prompts shared across users; lengths from the trace)", choices=["trace", "chat"])
    _add(p, "chat-system-prompts", 4, "chat: distinct system prompts, shared across conversations")
    _add(p, "chat-system-len", 512, "chat: tokens of a system prompt")
    _add(p, "chat-turns", "2,8", "chat: min,max turns per conversation (uniform)")
    _add(p, "chat-user-scale", 0.25, "chat: a user turn's length = a trace prompt length x this")
    _add(p, "chat-think", 5.0, "chat: mean seconds between an answer and the next turn (exponential)")
    _add(p, "chat-wait-for-answer", False, "chat: send a turn no earlier than its think time after the answer "
         "before it ended, as users reply (default: at its scheduled time, open loop, even while that answer "
         "is still being generated)")
    _add(p, "block-size", 16, "tokens per KV block")
    _add(p, "num-blocks", 0, "KV blocks per replica (0 = what fits the device's memory after the weights)")
    _add(p, "gpu-memory-utilization", 0.9, "fraction of device memory for weights, activations and KV")
    _sched_args(p)
    _workload_args(p, http=False)
    _slo_args(p)
    _add(p, "qps", "1.0", "mean request rate(s), comma-separated (ignored with --capacity)")
    _add(p, "capacity", False, "binary search for the highest QPS within the SLO instead")
    _add(p, "qps-start", 1.0, "first QPS probed (--capacity)")
    _add(p, "resolution", 0.05, "stop when (hi - lo) / hi <= this (--capacity)")
    _add(p, "max-sched-delay", 2.0, "P50 scheduling delay bound (s), the paper's 2 s")
    _add(p, "details", False, "keep the per-request token times and per-iteration log in the JSON")
    _add(p, "shift-prompt-scale", 0.0, "> 0: requests of the run's second half get prompts this many times "
         "longer (a step change in the workload)")
    _add(p, "windows", 0, "> 0: also report P99 TBT in this many equal time windows of each run")
    _add(p, "spec-acceptance", 0.6, "with --speculative: the probability that a draft token is accepted "
         "(given the ones before it were); the simulated worker draws acceptances with it")
    _add(p, "noise-sigma", 0.0, "> 0: each iteration's time x a lognormal factor (mean 1, this sigma; seeded): "
         "the iteration-to-iteration variation a fitted cost model leaves out")
    _add(p, "prefill-replicas", 0, "prefill/decode disaggregation: simulated prefill workers (with "
         "--decode-replicas; all pools under one scheduler: the real PoolSet + Router)")
    _add(p, "decode-replicas", 0, "simulated decode workers (with --prefill-replicas)")
    _add(p, "disaggregation", "off", "with --prefill-replicas/--decode-replicas: off (colocated on the decode "
         "workers), all, auto (prompts >= --disagg-threshold uncached tokens while the prefill pool is not the "
         "bottleneck)", choices=["off", "all", "auto"])
    _add(p, "disagg-threshold", 256, "auto: the shortest uncached prompt (tokens) sent to a prefill worker "
         "(`sarathi plan` proposes one)")
    _add(p, "disagg-backlog-margin", 2048, "auto: a long prompt stays colocated when the prefill worker's queued "
         "prefill tokens exceed the decode worker's by more than this")
    _add(p, "prefill-token-budget", 0, "token budget of the prefill workers (0 = --token-budget)")
    _add(p, "kv-link-gbs", 25.0, "KV transfer link between workers in GB/s (assumption; 25 = a 200 Gb/s RDMA NIC): "
         "a transfer takes prompt blocks x block size x the model's KV bytes per token / this")
    _add(p, "kv-bytes-per-token", 0, "KV bytes per token a transfer moves (0 = the --device model's; with --profile "
         "and pools it must be given: a profile does not record its model's KV size; SmolLM2-135M's bf16 KV: 23040)")
    _add(p, "kv-tier-blocks", 0, "> 0: with --replicas and --prefix-caching, a KV tier of this many blocks shared by "
         "all replicas (host memory or a KV store, as LMCache or Mooncake run one): every block computed is written "
         "to it, and a replica loads from it the blocks after its own cached prefix over --kv-link-gbs")
    _add(p, "kv-tier-overlap", False, "--kv-tier-blocks: load layer by layer beside the forward pass (LMCache's "
         "layerwise mode) instead of before it (its default)")

    p = sub.add_parser("profile", help="iteration-time table, SLOs and cost model of this machine")
    _model_args(p)
    _add(p, "executor", "real", "real: time the torch engine; sim: the synthetic cost model (quick test)",
         choices=["real", "sim"])
    _add(p, "length-scale", 1.0, "the trace scale the SLO context follows: 4096 x this")
    _add(p, "slo-context", 0, "context (tokens) of the SLO's batch-32 decode (0 = 4096 x --length-scale)")
    _add(p, "rounds", 3, "timed rounds per case (median kept)")
    _add(p, "quick", False, "fewer cases")
    _add(p, "out", "sarathi-profile", "output prefix: writes <out>.json and <out>.png")
    _add(p, "progress", True, "show a progress bar")

    p = sub.add_parser("plan", help="token budget tau for a TBT SLO, from a profile or a simulated GPU")
    _add(p, "profile", "sarathi-profile.json", "profile JSON from `sarathi profile` (not read with --device)")
    _slo_args(p, tbt=True)
    _add(p, "decode-batch", 32, "decodes expected in an iteration (ignored with --qps)")
    _add(p, "qps", 0.0, "expected load: derive the decode batch from it and the trace (0 = use --decode-batch)")
    _add(p, "trace", None, "trace for the mean output length with --qps (default: ShareGPT)")
    _add(p, "output-column", "num_decode_tokens", "trace column of output lengths")
    _add(p, "length-scale", 1.0, "trace length scale with --qps")
    _add(p, "context", 0, "decode context in tokens (0 = the profile's SLO context)")
    _add(p, "tile", 32, "tau is a multiple of this many tokens")
    _add(p, "max-num-seqs", 128, "cap on running requests")
    _add(p, "kv-link-gbs", 25.0, "KV link between prefill and decode workers (GB/s) for the transfer time "
         "reported beside the disaggregation threshold")
    _add(p, "kv-bytes-per-token", 0, "KV bytes per token moved by a transfer (0 = the --device model's; with a "
         "profile, no transfer time unless given)")
    _add(p, "out", "sarathi-plan.json", "plan file (JSON; a PNG is written next to it)")
    _sim_device_args(p, required=False)


MEASUREMENT_COMMANDS = ("bench", "capacity", "simulate", "profile", "plan")   # sarathi.measure.commands


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "link_keys", None) or getattr(args, "insecure_links", False):
        # flags win over the environment; processes started from here (ranks) inherit them
        from shared.link_auth import use_settings
        use_settings(args.link_keys, args.insecure_links)
    for flag, var in (("redis_password_file", "SARATHI_REDIS_PASSWORD_FILE"),
                      ("redis_tls_ca_file", "SARATHI_REDIS_TLS_CA_FILE")):
        if getattr(args, flag, None):  # the queue's Redis clients read them from the environment
            os.environ[var] = getattr(args, flag)
    # heavy imports only after parsing (fast --help)
    if args.cmd in MEASUREMENT_COMMANDS:
        from sarathi.measure import commands
    else:
        from sarathi import commands

    try:
        return getattr(commands, args.cmd)(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"sarathi {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
