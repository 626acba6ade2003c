"""A profile-driven GPU cost model: the iteration time of a hybrid batch on A100s (or H100s) at a
given TP x PP layout, for the simulated worker of `sarathi simulate`. Torch-free.

Where each term comes from (all times in seconds; per TP shard, per pipeline stage):

* **linear**: the token-wise operators of one transformer layer (fused QKV, attention output,
  gate/up, down projections; norms, rotary, activation, residual add), *measured* on A100 by
  token count and TP degree (data/gpu/a100_<shape>_linear.csv, provenance in
  data/gpu/PROVENANCE.md), linearly interpolated between profiled token counts and extrapolated
  from the last two above the largest. x layers of the stage.
* **other models** by scaling the closest measured shape: each projection's time x (its weight
  matrix size in the target / in the measured shape), at the same token count and TP degree; the
  elementwise ops x the ratio of their widths. Both regimes scale that way: a small batch reads
  the weights (bytes ~ matrix size), a large one multiplies them (FLOPs ~ tokens x matrix size).
  Checked: Llama-3-8B predicted from the Llama-2-7B profile against its own measured rows (test).
* **attention**: not profiled; from first principles per layer: FLOPs (4 x head_dim x query x key
  pairs per head) at `attn_flops_eff` of the device's stated bf16 peak, and KV bytes read at
  `attn_bw_eff` of its stated memory bandwidth; prefill chunks and decodes are separate kernels,
  each max(compute, memory) + a launch. **Results depend on these two efficiencies.**
* **tp_comm**: two all-reduces per layer of tokens x hidden x 2 bytes (fp16), from the measured
  all-reduce profile (alpha-beta fit per ranks and devices per node).
* **pp_comm**: one send/recv of tokens x hidden x 2 bytes per stage boundary (measured profile).
* **lm_head** (last stage): the sampled rows x hidden x vocab GEMM at the device's effective
  GEMM rate and bandwidth; **embed** (first stage): the profile's embedding op.
* **cpu**: scheduling, input preparation and sampling on the host, a fixed + per-sequence
  overhead (an assumption, stated in the result: `cpu_fixed_s`, `cpu_per_seq_s`).
* **kv_transfer**: moving a prompt's KV to another replica (prefill/decode disaggregation): bytes
  / `kv_link_gbs`; zero for colocated serving (kept as its own term so that issue can add it).

H100: the A100 operator times scaled per operator by the ratio of the two devices' roofline times
(effective GEMM rate and bandwidth as measured on an H100: 650 TFLOP/s, 3.0 TB/s), the
A100 network profiles with their bandwidth term scaled by NVLink 4 / NVLink 3 (900 / 600 GB/s).
"""
from __future__ import annotations

import bisect
import csv
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np

from shared.messages import Batch

DATA = Path(__file__).resolve().parent / "data" / "gpu"
OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
BYTES = 2   # bf16 / fp16 weights, activations and KV

# A chunk shape: (start_pos, num_tokens, is_decode), tokens (as sarathi.measure.costmodel.Shape).
Shape = tuple[int, int, bool]


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family model's shape: layers, widths (elements), heads; `profile`: the measured
    shape whose operator times are scaled to this one."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    profile: str

    def op_size(self, op: str) -> int:
        """Weight elements of a projection, or the width of an elementwise op (elements)."""
        h, q, kv = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"attn_pre_proj": h * (q + 2 * kv), "attn_post_proj": q * h,
                "mlp_up_proj": h * 2 * self.intermediate, "mlp_down_proj": self.intermediate * h,
                "mlp_act": self.intermediate, "attn_rope": q + kv, "emb": h}.get(op, h)

    @property
    def params(self) -> int:
        layer = sum(self.op_size(op) for op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj",
                                                 "mlp_down_proj"))
        return self.num_layers * layer + 2 * self.vocab * self.hidden

    def kv_bytes_per_token(self, layers: int, tp: int) -> int:
        """KV cache bytes one token takes on one rank holding `layers` layers at TP degree tp."""
        return layers * 2 * max(1, self.num_kv_heads // tp) * self.head_dim * BYTES


MODELS = {m.name: m for m in (
    ModelShape("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, "llama-2-7b"),
    ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, "llama-3-8b"),
    ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, "llama-3-8b"),
    ModelShape("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000, "llama-3-8b"),
    ModelShape("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, "llama-3-8b"),
)}


@dataclass(frozen=True)
class Device:
    """A GPU: stated peak (bf16 dense TFLOP/s) and memory bandwidth (TB/s), memory (GiB), the
    effective GEMM rate and bandwidth used to scale operator profiles between devices, and the
    fractions of the stated peak/bandwidth attention kernels reach (assumptions)."""

    name: str
    peak_tflops: float
    mem_tbs: float
    mem_gib: float
    gemm_tflops: float        # effective, large GEMMs
    copy_tbs: float           # effective, streaming reads
    nvlink_gbs: float         # per-GPU NVLink bandwidth (GB/s), scales the network profile
    attn_flops_eff: float = 0.5    # FlashAttention-2 forward reaches 50-73% of A100 peak
    attn_bw_eff: float = 0.82      # decode attention: 2.74 of 3.35 TB/s measured on an H100
    launch_s: float = 5e-6         # one kernel launch


DEVICES = {d.name: d for d in (
    # A100-SXM4-80GB: 312 TFLOP/s bf16, 2.039 TB/s; the profile's 4096-token MLP runs ~233 TFLOP/s
    Device("a100", 312.0, 2.039, 80.0, 233.0, 1.86, 600.0),
    # H100-SXM5-80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s; measured ~650 TFLOP/s, 3.0 TB/s
    Device("h100", 989.0, 3.35, 80.0, 650.0, 3.0, 900.0),
    # H200-SXM-141GB: the H100's compute, 4.8 TB/s stated; copy measured 4.24-4.27 TB/s
    # (bench/results/gpu/), GEMM rate as the H100's (same chip)
    Device("h200", 989.0, 4.8, 141.0, 650.0, 4.25, 900.0),
)}
TOPOLOGIES = ("a100_dgx", "a100_pairwise_nvlink")


# -- profiles -----------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def linear_profile(profile: str) -> dict[int, tuple[list[int], np.ndarray]]:
    """tp -> (token counts ascending, ms per op [rows x (emb + OPS)]) of a measured shape."""
    path = DATA / f"a100_{profile}_linear.csv"
    by_tp: dict[int, list[tuple[int, list[float]]]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            by_tp.setdefault(int(r["tp"]), []).append(
                (int(r["num_tokens"]), [float(r[f"{op}_ms"]) for op in ("emb",) + OPS]))
    out = {}
    for tp, rows in by_tp.items():
        rows.sort()
        out[tp] = ([n for n, _ in rows], np.array([v for _, v in rows]))
    return out


def interpolate(xs: list[int], ys: np.ndarray, x: float) -> np.ndarray:
    """Piecewise-linear in x through (xs, ys) rows; linear extrapolation beyond either end
    (floored at the end row's value below the smallest x)."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == 0:
        return ys[0]
    if i == len(xs):
        i -= 1
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * ((x - x0) / (x1 - x0))


@dataclass(frozen=True)
class AlphaBeta:
    """t = alpha + bytes / bw: a collective's time (s) by message size, fitted to a profile."""

    alpha_s: float
    bw_bytes_s: float
    fit_median_rel: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bw_bytes_s


@lru_cache(maxsize=None)
def network_profile(topology: str, collective: str) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """(ranks, devices per node) -> [(message bytes, median seconds)]."""
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    with (DATA / f"{topology}_{collective}.csv").open() as f:
        for r in csv.DictReader(f):
            out.setdefault((int(r["num_workers"]), int(r["devices_per_node"])), []).append(
                (int(r["size_bytes"]), float(r["median_ms"]) / 1e3))
    return out


@lru_cache(maxsize=None)
def fit_collective(topology: str, collective: str, ranks: int) -> AlphaBeta:
    """Alpha-beta fit (least squares on relative error) to the profile of `ranks` ranks, all on
    one node where the profile has it (the layouts simulated here keep TP inside a node)."""
    prof = network_profile(topology, collective)
    keys = [k for k in prof if k[0] == ranks]
    if not keys:
        raise ValueError(f"the {topology} profile has no {collective} over {ranks} ranks "
                         f"(has {sorted({k[0] for k in prof})})")
    pts = prof[max(keys, key=lambda k: k[1])]
    x = np.array([p[0] for p in pts], float)
    y = np.array([p[1] for p in pts])
    w = 1.0 / y
    A = np.stack([np.ones_like(x), x], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)
    alpha, inv_bw = max(alpha, 1e-6), max(inv_bw, 1e-15)
    rel = np.abs(alpha + x * inv_bw - y) / y
    return AlphaBeta(float(alpha), float(1.0 / inv_bw), float(np.median(rel)))


# -- the model -----------------------------------------------------------------------------------
@dataclass
class GPUCostModel:
    """Iteration time of a batch on one replica: `stage_times(batch)` per pipeline stage (for the
    simulated pipeline), `__call__(batch)` their sum (depth 1), `breakdown(shapes)` the terms.

    model, device: names in MODELS / DEVICES. tp, pp: the replica's layout (stages get
    num_layers // pp layers, the first ones one more when it does not divide). topology: the
    network profile. cpu_fixed_s, cpu_per_seq_s: host overhead per iteration (s, s/sequence).
    kv_link_gbs: the link KV moves over between replicas (GB/s), for disaggregation.
    """

    model: str = "llama-3-8b"
    device: str = "a100"
    tp: int = 1
    pp: int = 1
    topology: str = "a100_dgx"
    cpu_fixed_s: float = 1.0e-3
    cpu_per_seq_s: float = 5e-6
    kv_link_gbs: float = 25.0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"unknown model shape {self.model!r}; choose one of {', '.join(MODELS)}")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; choose one of {', '.join(TOPOLOGIES)}")
        m = self.shape
        if self.tp not in (1, 2, 4, 8):
            raise ValueError(f"--tp must be 1, 2, 4 or 8 (the profiled degrees), got {self.tp}")
        if m.num_heads % self.tp or (m.num_kv_heads % self.tp and self.tp % m.num_kv_heads):
            raise ValueError(f"{m.name}: {m.num_heads} heads / {m.num_kv_heads} kv heads do not split "
                             f"over TP {self.tp}")
        if not 1 <= self.pp <= m.num_layers:
            raise ValueError(f"--pp must be in [1, {m.num_layers}], got {self.pp}")
        base = MODELS[m.profile]
        self._scale = np.array([m.op_size(op) / base.op_size(op) for op in ("emb",) + OPS])
        self._dev, self._a100 = DEVICES[self.device], DEVICES["a100"]
        self._tp_ar = fit_collective(self.topology, "all_reduce", self.tp) if self.tp > 1 else None
        self._pp_sr = fit_collective(self.topology, "send_recv", 2) if self.pp > 1 else None
        q, r = divmod(m.num_layers, self.pp)
        self.stage_layers = [q + (1 if i < r else 0) for i in range(self.pp)]

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    # -- terms ----------------------------------------------------------------------------------
    def _linear_ms(self, tokens: int) -> np.ndarray:
        """ms per op (emb + OPS) of one layer at `tokens` tokens, this model and device."""
        hit = self._cache.get(tokens)
        if hit is not None:
            return hit
        xs, ys = linear_profile(self.shape.profile)[self.tp]
        ms = interpolate(xs, ys, tokens) * self._scale
        if self.device != "a100":
            ms = ms * self._device_ratio(tokens)
        self._cache[tokens] = ms
        return ms

    def _linear_s(self, tokens: int) -> tuple[float, float]:
        """(embedding, one layer's linear ops) in seconds at `tokens` tokens."""
        key = ("s", tokens)
        hit = self._cache.get(key)
        if hit is None:
            ms = self._linear_ms(tokens)
            hit = self._cache[key] = (float(ms[0]) / 1e3, float(ms[1:].sum()) / 1e3)
        return hit

    def _device_ratio(self, tokens: int) -> np.ndarray:
        """Per op: roofline time on this device / on the A100 (effective rates)."""
        m, d, a = self.shape, self._dev, self._a100
        out = []
        for op in ("emb",) + OPS:
            size = m.op_size(op) / (1 if op in ("emb",) else self.tp)
            if op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"):
                flops, nbytes = 2 * tokens * size, BYTES * (size + tokens * m.hidden)
            else:
                flops, nbytes = 0.0, 2 * BYTES * tokens * size
            t_d = max(flops / (d.gemm_tflops * 1e12), nbytes / (d.copy_tbs * 1e12))
            t_a = max(flops / (a.gemm_tflops * 1e12), nbytes / (a.copy_tbs * 1e12))
            out.append(t_d / t_a if t_a > 0 else 1.0)
        return np.array(out)

    def _attention_s(self, shapes: list[Shape]) -> float:
        """One layer's attention on one TP shard: prefill chunks, then decodes (two kernels)."""
        m, d = self.shape, self._dev
        heads = m.num_heads // self.tp
        kv_heads = max(1, m.num_kv_heads // self.tp)
        kv_token = 2 * kv_heads * m.head_dim * BYTES
        peak, bw = d.peak_tflops * 1e12 * d.attn_flops_eff, d.mem_tbs * 1e12 * d.attn_bw_eff
        t = 0.0
        p_pairs = sum(n * (s + (n + 1) / 2) for s, n, dec in shapes if not dec)
        if p_pairs:
            p_kv = sum(s + n for s, n, dec in shapes if not dec)
            t += d.launch_s + max(4 * m.head_dim * heads * p_pairs / peak, p_kv * kv_token / bw)
        d_kv = sum(s + 1 for s, _, dec in shapes if dec)
        if d_kv:
            t += d.launch_s + max(4 * m.head_dim * heads * d_kv / peak, d_kv * kv_token / bw)
        return t

    def _lm_head_s(self, sampled: int) -> float:
        m, d = self.shape, self._dev
        size = m.hidden * m.vocab / self.tp
        return d.launch_s + max(2 * sampled * size / (d.gemm_tflops * 1e12),
                                BYTES * size / (d.copy_tbs * 1e12))

    def breakdown(self, shapes: Iterable[Shape], sampled: int | None = None,
                  kv_transfer_tokens: int = 0) -> dict:
        """Seconds per term of one iteration, summed over the stages ('stages': per stage).
        sampled: rows that sample (default: every decode + every chunk; an upper bound)."""
        shapes = list(shapes)
        tokens = sum(n for _, n, _ in shapes)
        if tokens == 0:
            return {"stages": [0.0] * self.pp, "total": 0.0}
        sampled = len(shapes) if sampled is None else sampled
        embed_s, layer_linear = self._linear_s(tokens)
        attn = self._attention_s(shapes)
        ar = 2 * self._tp_ar(tokens * self.shape.hidden * BYTES) if self._tp_ar else 0.0
        send = self._pp_sr(tokens * self.shape.hidden * BYTES) if self._pp_sr else 0.0
        if self.device != "a100" and (self._tp_ar or self._pp_sr):
            scale = self._a100.nvlink_gbs / self._dev.nvlink_gbs  # bandwidth term only: approximation
            ar *= scale
            send *= scale
        terms = {"linear": 0.0, "attention": 0.0, "tp_comm": 0.0, "pp_comm": 0.0,
                 "embed": embed_s, "lm_head": self._lm_head_s(sampled),
                 "cpu": self.cpu_fixed_s + self.cpu_per_seq_s * len(shapes),
                 "kv_transfer": kv_transfer_tokens * self.shape.kv_bytes_per_token(
                     self.shape.num_layers, 1) / (self.kv_link_gbs * 1e9)}
        stages = []
        for i, layers in enumerate(self.stage_layers):
            t = layers * (layer_linear + attn + ar)
            terms["linear"] += layers * layer_linear
            terms["attention"] += layers * attn
            terms["tp_comm"] += layers * ar
            if i == 0:
                t += terms["embed"] + terms["cpu"] + terms["kv_transfer"]
            if i == self.pp - 1:
                t += terms["lm_head"]
            else:
                t += send
                terms["pp_comm"] += send
            stages.append(t)
        terms["stages"] = stages
        terms["total"] = sum(stages)
        return terms

    def host_s(self, batch: Batch) -> float:
        """The host's share of the batch's first stage (the "cpu" term: scheduling, input
        preparation, sampling launches), seconds; the simulator overlaps it with the batch before
        under async scheduling (SimulatedWorker's overlap_host)."""
        return self.cpu_fixed_s + self.cpu_per_seq_s * len(batch.seqs)

    def stage_times(self, batch: Batch) -> list[float]:
        shapes = [(s.start_pos, len(s.token_ids), s.is_decode) for s in batch.seqs]
        return self.breakdown(shapes, sum(1 for s in batch.seqs if s.sample))["stages"]

    def predict_shapes(self, shapes: Iterable[Shape]) -> float:
        """Seconds of one iteration through every stage (sarathi.measure.plan's interface)."""
        return self.breakdown(shapes)["total"]

    def __call__(self, batch: Batch) -> float:
        """SimExecutor's cost_model interface: the whole iteration (all stages)."""
        return sum(self.stage_times(batch))

    # -- memory ---------------------------------------------------------------------------------
    def kv_blocks(self, block_size: int, memory_utilization: float = 0.9,
                  activation_gib: float = 2.0) -> int:
        """KV blocks of block_size tokens a replica holds: on the fullest rank (first stage),
        memory x utilization - its weights - activations, over its per-token KV bytes."""
        m, d = self.shape, self._dev
        layers = self.stage_layers[0]
        weights = (layers * (m.params - 2 * m.vocab * m.hidden) / m.num_layers
                   + m.vocab * m.hidden) * BYTES / self.tp
        free = d.mem_gib * 2**30 * memory_utilization - weights - activation_gib * 2**30
        per_block = block_size * m.kv_bytes_per_token(layers, self.tp)
        if free <= per_block:
            raise ValueError(f"{m.name} at TP {self.tp} x PP {self.pp} does not fit one "
                             f"{d.name} ({d.mem_gib:g} GiB) per rank")
        return int(free // per_block)

    def describe(self) -> dict:
        """What a result records about the model it was simulated with."""
        d = self._dev
        return {"kind": "gpu", "model": asdict(self.shape), "device": asdict(d), "tp": self.tp,
                "pp": self.pp, "topology": self.topology, "stage_layers": self.stage_layers,
                "cpu_fixed_s": self.cpu_fixed_s, "cpu_per_seq_s": self.cpu_per_seq_s,
                "kv_link_gbs": self.kv_link_gbs,
                "assumptions": (f"attention from FLOPs at {d.attn_flops_eff:.0%} of {d.peak_tflops:g} "
                                f"TFLOP/s and KV bytes at {d.attn_bw_eff:.0%} of {d.mem_tbs:g} TB/s; "
                                f"host overhead {self.cpu_fixed_s * 1e3:g} ms + "
                                f"{self.cpu_per_seq_s * 1e6:g} us/sequence per iteration"),
                "collectives": {k: asdict(v) for k, v in (("all_reduce", self._tp_ar),
                                                          ("send_recv", self._pp_sr)) if v}}

    def with_layout(self, tp: int, pp: int) -> "GPUCostModel":
        return replace(self, tp=tp, pp=pp, _cache={})


def slo_decode_s(model: GPUCostModel, context: int = 4096, batch: int = 32) -> float:
    """The paper's SLO base (Table 3): one decode-only iteration of `batch` at `context` tokens."""
    return model.predict_shapes([(context, 1, True)] * batch)


def _check() -> None:  # pragma: no cover - a quick look: python -m sarathi.measure.gpu_costmodel
    for name in ("llama-3-8b", "llama-2-70b"):
        for tp, pp in ((1, 1), (4, 2)):
            try:
                m = GPUCostModel(name, "a100", tp, pp)
                m.kv_blocks(16)
            except ValueError as e:
                print(e)
                continue
            print(name, tp, pp, f"decode b32@4k {slo_decode_s(m) * 1e3:.1f} ms",
                  f"prefill 2048 {m.predict_shapes([(0, 2048, False)]) * 1e3:.1f} ms",
                  f"blocks {m.kv_blocks(16)}")


if __name__ == "__main__":  # pragma: no cover
    _check()
