"""What the benchmark scripts share, so that none imports another: the record of the machine a
result was measured on, a process's resident memory (rss_mb), and the engine benchmarks' batches
and model runners (SmolLM2-135M on the real ModelRunner, KV cache of zeros: attention cost
depends on lengths, not on values).

Batches in the KV cache (a Layout): `decodes` sequences of CONTEXT cached tokens, each on its own
blocks (CONTEXT // BLOCK_SIZE + 1 of them: room for the decoded token), then one prompt chunk of
up to `chunk` tokens on the blocks after them. The model runner's cache holds exactly those blocks.
"""
from __future__ import annotations

import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sarathi.measure.env import machine  # the one record of the machine; scripts import it from here
from shared.config import CacheConfig, WorkerConfig
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from worker_svc.model_runner import ModelRunner

CONTEXT = 1024                       # tokens already cached per decode
SHORT_CONTEXT = 128                  # a second decode series isolates the linear layers' cost
BLOCK_SIZE = 16                      # tokens per KV block
HYBRID_DECODES = 32                  # decodes beside the chunk of a "hybrid" batch
GREEDY = SamplingParams(temperature=0.0)

# SmolLM2-135M's linear layers (hidden, intermediate, heads, kv heads, head dim, layers, vocab)
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server a benchmark starts (another process could
    take it before the server binds it: fine for a benchmark, never what the product does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_line() -> str:
    """The machine record as one line, "CPU model, N CPUs, platform" (the engine scripts' field)."""
    m = machine()
    return f"{m['cpu']}, {m['cpus']} CPUs, {m['platform']}"


@dataclass(frozen=True)
class Layout:
    """Room in the KV cache for `decodes` decode sequences and one chunk of `chunk` tokens."""

    decodes: int
    chunk: int

    @property
    def blocks_per_decode(self) -> int:
        return CONTEXT // BLOCK_SIZE + 1

    @property
    def num_blocks(self) -> int:
        return self.decodes * self.blocks_per_decode + self.chunk // BLOCK_SIZE

    def decode_tables(self) -> list[list[int]]:
        n = self.blocks_per_decode
        return [list(range(i * n, (i + 1) * n)) for i in range(self.decodes)]

    def chunk_table(self) -> list[int]:
        first = self.decodes * self.blocks_per_decode
        return list(range(first, first + self.chunk // BLOCK_SIZE))


FULL = Layout(decodes=128, chunk=2048)       # engine_iteration's whole sweep: 8,448 blocks
SMALL = Layout(decodes=32, chunk=512)        # the target cases: 2,112 blocks (1.6 GB fp32 KV)


def make_batch(series: str, size: int, layout: Layout = FULL) -> Batch:
    """One batch of a series: "decode" (size decodes at CONTEXT), "decode_short" (at SHORT_CONTEXT),
    "prefill" (a chunk of size tokens, empty prefix) or "hybrid" (HYBRID_DECODES decodes + that
    chunk)."""
    decodes = [SeqChunk(f"d{i}", [100 + i], CONTEXT, t, True, GREEDY, 1)
               for i, t in enumerate(layout.decode_tables())]
    if series == "decode":
        return Batch(0, decodes[:size])
    if series == "decode_short":
        return Batch(0, [SeqChunk(d.req_id, d.token_ids, SHORT_CONTEXT, d.block_table, True, GREEDY, 1)
                         for d in decodes[:size]])
    prefill = SeqChunk("p", [200] * size, 0, layout.chunk_table(), True, GREEDY)
    if series == "prefill":
        return Batch(0, [prefill])
    return Batch(0, decodes[:HYBRID_DECODES] + [prefill])


def make_executor(spec: str, layout: Layout = FULL) -> ModelRunner:
    """DTYPE[:KV[:WEIGHTS[:ATTENTION]]] -> a ModelRunner with the layout's cache. A bare DTYPE (the
    --dtypes runs) keeps the KV cache in the compute dtype and float weights (the exact path).
    The name stays: ENGINE_PROCESS calls it by name inside older source trees."""
    from worker_svc.model_runner import ModelRunner  # torch: only for scripts that build an engine

    dtype, kv, wq, attn = (spec.split(":") + ["auto", "auto", "auto"])[:4]
    if kv == "auto" and ":" not in spec:
        kv = dtype
    ex = ModelRunner(WorkerConfig(dtype=dtype, kv_cache_dtype=kv, weight_quant=wq if ":" in spec else "none",
                                  cache=CacheConfig(BLOCK_SIZE, layout.num_blocks)))
    if attn == "torch":                   # the torch decode path (SARATHI_NATIVE_ATTENTION=0)
        from worker_svc.backends.torch_attention import TorchAttention
        ex.backend.attention = TorchAttention()
        for layer in ex.model.layers:
            layer.attention = ex.backend.attention
    return ex


def step_bytes(ex: ModelRunner, series: str, size: int) -> int:
    """Bytes one step must read at least: every linear weight once (int8 + scales when the
    variant's int8 path runs at this token count, else the dense weight it multiplies), the LM head for the
    sampled rows, and the K and V of every cached token attended over."""
    from worker_svc.model.linear import ReplicatedLinear

    batch = make_batch(series, size)      # lengths only count here, not which blocks: any layout
    T = batch.num_tokens
    method = ex.backend.linear
    weights = 0
    for m in ex.model.modules():
        if hasattr(m, "method") and hasattr(m, "weight"):
            n, k = m.weight.shape
            rows = sum(s.sample for s in batch.seqs) if isinstance(m, ReplicatedLinear) else T
            int8 = hasattr(m, "qweight") and rows <= getattr(method, "max_tokens", -1)
            dense = m.weight_large if hasattr(m, "weight_large") else m.weight   # bf16 copy for large T
            weights += n * k + 4 * n if int8 else n * k * dense.element_size()
    cfg = ex.model_cfg
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * ex.cache.k[0].element_size()
    kv = sum(s.start_pos + len(s.token_ids) for s in batch.seqs) * per_token
    return weights + kv


def layer_shapes() -> list[tuple[int, int]]:
    """(out, in) of every linear layer of one SmolLM2-135M step, in execution order."""
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    per_layer = [(qkv, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * LAYERS + [(VOCAB, HIDDEN)]


def kernel_sources_at(rev: str, dest: Path) -> Path:
    """The native CPU kernels' sources (the .c and .h files of csrc/) of git revision rev, written
    into the folder dest (created); returns dest. csrc/ was worker_svc/csrc/ before it moved under
    worker_svc/backends/cpu/; until the split of gguf_linear.c it held one .c file per kernel and
    no headers."""
    for folder in ("worker_svc/backends/cpu/csrc", "worker_svc/csrc"):
        listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{folder}"], capture_output=True, text=True)
        if listed.returncode == 0:
            break
    listed.check_returncode()
    dest.mkdir(parents=True, exist_ok=True)
    for name in listed.stdout.split():
        if name.endswith((".c", ".h")):
            shown = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], capture_output=True, text=True,
                                   check=True)
            (dest / name).write_text(shown.stdout)
    return dest


# -- the engine in a process of its own: A/B of two source trees (or two settings) interleaved ---
ENGINE_PROCESS = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
spec = sys.argv[2]
try:
    from bench import common as c
    ex = c.make_executor(spec, c.SMALL)
    machine, make_batch = c.machine_line(), lambda s, n: c.make_batch(s, n, c.SMALL)
except ImportError:   # a tree from before bench/common.py: the helpers were engine_iteration's
    import bench.engine_iteration as ei
    ei.DECODE_SIZES, ei.PREFILL_SIZES = [32], [512]
    ei.NUM_BLOCKS = 32 * (ei.CONTEXT // ei.BLOCK_SIZE + 1) + 512 // ei.BLOCK_SIZE
    ex = ei.make_executor(spec)
    machine, make_batch = ei.machine(), ei.make_batch
print(json.dumps({"ready": ex.backend.describe(), "machine": machine}), flush=True)
batches = {}
for line in sys.stdin:
    series, n = line.split()
    batch = batches.get((series, n)) or batches.setdefault((series, n), make_batch(series, int(n)))
    t0 = time.perf_counter()
    out = ex.execute(batch)
    dt = time.perf_counter() - t0
    print(json.dumps({"s": dt, **{k: out.timings[k] for k in ("prepare_s", "forward_s", "sample_s")}}),
          flush=True)
"""


def rss_mb(pid: int) -> float:
    """Resident set of pid and its descendants, MiB (from /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, AttributeError):
            continue
    return total / 1024


def start_order_sessions(names: list[str], rounds: int) -> list[tuple[list[str], int]]:
    """[(start order, rounds)]: engine processes compared in turn run in two sessions, the arms
    started in the given order for the first half of the rounds and in reverse for the rest.

    Why: on the 2-vCPU guests here the order processes start in shows in their speed, whatever
    they run: in A/A runs (every arm the same settings) the first one started stepped slowest,
    the last fastest, by more than the differences measured (bench/results/kernels/README.md,
    "Start order"). Reversing it halfway gives each arm both places; per-round ratios stay paired
    within a session."""
    first = (rounds + 1) // 2
    return [(list(names), first)] + ([(list(names)[::-1], rounds - first)] if rounds - first else [])


class EngineProcess:
    """One model runner (`make_executor(spec, SMALL)`) of the source tree `tree` in a process of its own,
    stepped on request: `step("decode:32")` runs that batch once and returns {"s": seconds around
    ModelRunner.execute, "prepare_s", "forward_s", "sample_s"}. `info`: its backend line and machine.
    Several of them asked in turn (A, B, A, B, ...) see the same load drifts."""

    def __init__(self, tree: Path, threads: int, spec: str = "float32:auto:auto:auto",
                 env: dict | None = None):
        import json
        import os
        import subprocess
        import sys

        self._json = json
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS, str(threads), spec], cwd=tree,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process of {tree} ({spec}) exited: {self.proc.wait()}")
        self.info = json.loads(line)

    def step(self, case: str) -> dict:
        self.proc.stdin.write(case.replace(":", " ") + "\n")
        self.proc.stdin.flush()
        return self._json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# -- agreement with Hugging Face (bench.weight_quant_agreement; the tests import these too) ---------

def hf_model_from_gguf(path: str):
    """transformers' GGUF path without `accelerate` (which from_pretrained(gguf_file=) needs)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = load_gguf_checkpoint(path, return_tensors=False)["config"]
    with no_init_weights():
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert missing == ["lm_head.weight"]          # tied to the embedding
    model.tie_weights()
    return model.eval()


def hf_greedy_reference(hf, prompt: list[int], new_tokens: int):
    """(prompt + HF's greedy continuation of new_tokens tokens, HF's logits [new_tokens + 1, V] after
    the prompt's last token and each generated one): the reference teacher_forced_logits is compared with."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=2)[0].tolist()
        return seq, hf(torch.tensor([seq])).logits[0, len(prompt) - 1:]


def teacher_forced_logits(ex, prompt: list[int], prefix: int = 8, block_size: int = 16):
    """Logits [positions, V] after each position >= prefix - 1 of `prompt`: the first `prefix`
    tokens as one chunk, then one decode per token (so decode kernels are what is compared)."""
    import torch

    table = list(range(-(-len(prompt) // block_size)))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    got = [ex.compute_logits(Batch(0, [SeqChunk("r", prompt[:prefix], 0, table, True, greedy, 0)]))["r"]]
    for pos in range(prefix, len(prompt)):
        got.append(ex.compute_logits(Batch(0, [SeqChunk("r", [prompt[pos]], pos, table, True, greedy, 0)]))["r"])
    return torch.stack(got)


def agreement(a, b) -> tuple[float, float]:
    """(top-1 agreement, max |logit error| / logit range of b) of two logit tensors [positions, V]."""
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return top1, ((a - b).abs().max() / (b.max() - b.min())).item()
