"""Copy the A100 operator and network profiles the simulated GPU worker uses into the package
(sarathi/measure/data/gpu/), trimmed to the medians it reads, with their provenance.

Source: the open Vidur project's profiling data (its data/profiling folder: A100 runs by
Microsoft, MIT licence), given with --src. Each output CSV keeps,
per (token count, TP degree) or (ranks, devices per node, message bytes), the median time in
milliseconds (duplicated rows: the median of their medians). PROVENANCE.md records the source
files' sha256, row counts and this command, so the copy can be checked and redone:

    python -m bench.import_gpu_profiles --src VIDUR/data/profiling
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import statistics
from collections import defaultdict
from pathlib import Path

OUT = Path("sarathi/measure/data/gpu")
MODELS = {"Llama-2-7b-hf": "llama-2-7b", "Meta-Llama-3-8B": "llama-3-8b"}
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
TOPOLOGIES = ("a100_dgx", "a100_pairwise_nvlink")


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def compute(src: Path, name: str, short: str) -> tuple[Path, Path, int]:
    path = src / "compute/a100/meta-llama" / name / "mlp.csv"
    rows = list(csv.DictReader(path.open()))
    groups = defaultdict(list)
    for r in rows:
        groups[(int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))].append(r)
    out = OUT / f"a100_{short}_linear.csv"
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_tokens", "tp"] + [f"{op}_ms" for op in OPS])
        for (n, tp), rs in sorted(groups.items()):
            w.writerow([n, tp] + [f"{statistics.median(float(r[f'time_stats.{op}.median']) for r in rs):.5g}"
                                  for op in OPS])
    return path, out, len(rows)


def network(src: Path, topo: str, coll: str) -> tuple[Path, Path, int]:
    path = src / "network" / topo / f"{coll}.csv"
    rows = list(csv.DictReader(path.open()))
    groups = defaultdict(list)
    for r in rows:
        groups[(int(r["num_workers"]), int(r["devices_per_node"]), int(r["size"]))].append(
            float(r[f"time_stats.{coll}.median"]))
    out = OUT / f"{topo}_{coll}.csv"
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_workers", "devices_per_node", "size_bytes", "median_ms"])
        for (k, d, s), ts in sorted(groups.items()):
            w.writerow([k, d, s, f"{statistics.median(ts):.5g}"])
    return path, out, len(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="Vidur's data/profiling folder (compute/, network/)")
    a = ap.parse_args(argv)
    src = Path(a.src)
    OUT.mkdir(parents=True, exist_ok=True)
    done = [compute(src, n, s) for n, s in MODELS.items()]
    done += [network(src, t, c) for t in TOPOLOGIES for c in ("all_reduce", "send_recv")]
    lines = [
        "# Provenance of the GPU profiles in this folder",
        "",
        "Measured on NVIDIA A100 GPUs by the open **Vidur** project's profiling runs (Microsoft,",
        "MIT licence), from its data/profiling folder.",
        "Trimmed copies: the median time (ms) per (token count, TP degree) of each per-layer",
        "operator (`*_linear.csv`: one transformer layer's token-wise operators, times per TP",
        "shard), and per (ranks, devices per node, message bytes) of each collective (fp16",
        "messages; `size_bytes` as Vidur records it). Written by",
        "`python -m bench.import_gpu_profiles --src VIDUR/data/profiling`.",
        "",
        "| copy | source (under data/profiling) | source rows | source sha256 |",
        "|---|---|---|---|",
    ]
    for path, out, n in done:
        lines.append(f"| `{out.name}` | `{path.relative_to(src)}` | {n} | `{sha256(path)[:16]}...` |")
    lines += ["", "Attention is not profiled here: the cost model (sarathi/measure/gpu_costmodel.py)",
              "derives it from FLOPs and KV bytes at the device's stated peak and bandwidth."]
    (OUT / "PROVENANCE.md").write_text("\n".join(lines) + "\n")
    print("wrote", ", ".join(str(o) for _, o, _ in done))


if __name__ == "__main__":
    main()
