"""The paper's GPU results, simulated (bench/results/sim/): the unchanged scheduler against the
profile-driven A100 cost model (`sarathi simulate`), every number from a `sarathi` command kept in
commands.json.

  python -m bench.sim_paper run [--jobs 2] [--only r1,r2,r3,r4]   the simulations (virtual time, nothing
                                                                   is timed; results already there are kept)
  python -m bench.sim_paper windows                                r4 at the best fixed tau's capacity
  python -m bench.sim_paper record                                 commands.json from the results there
  python -m bench.sim_paper figures                                summary.json + PNGs

Results (the issue's numbering):
  r1  Llama-3-8B (Mistral-7B's layer shapes), one A100, ShareGPT: capacity at P99 TBT 100 ms
      (strict) and 500 ms (relaxed) for sarathi tau 512 / 2048, vllm, orca, faster_transformer
  r2  Llama-2-70B, TP4 x PP2 (8 A100s, one DGX): capacity (the model's strict SLO, the paper's
      rule) for sarathi, vllm, orca, and the pipeline-bubble fraction at a common load (1 QPS)
  r3  tau sweep (the paper's Figure 9) at both SLOs, and the Table 4 ablation (hybrid_only,
      chunked_only, sarathi) at one load
r1 probes are 1,000 requests; r2-r4 probes 500 (CPU time on a shared 2-core machine).
  r4  adaptive tau against fixed taus under a workload whose prompts grow 8x mid-run
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from bench.sim_figures import figures
from bench.sim_runs import (
    OUT,
    PROBE,
    R1,
    R1_CONFIGS,
    R1_SLOS,
    R2,
    R2_POLICIES,
    R3_ABLATION_QPS,
    R3_TAUS,
    R4,
    R4_TAUS,
    SMALL,
    load,
)


def cmd(*args: str) -> list[str]:
    return ["sarathi", "simulate", *args, "--no-progress"]


def plan() -> dict[str, list[str]]:
    """name -> sarathi command, for every simulation of r1-r4."""
    c: dict[str, list[str]] = {}
    for slo, s in R1_SLOS.items():
        for pol, tau in R1_CONFIGS:
            name = f"r1_{slo}_{pol}" + (f"_tau{tau}" if pol == "sarathi" else "")
            c[name] = cmd(*R1, "--policy", pol, "--token-budget", tau, "--tbt-slo", s, "--capacity",
                          "--qps-start", "2", *PROBE, "--out", str(OUT / name))
    for slo in ("strict",):
        for pol, tau in R2_POLICIES:
            name = f"r2_{slo}_{pol}"
            c[name] = cmd(*R2, "--policy", pol, "--token-budget", tau, "--slo", slo, "--capacity",
                          "--qps-start", "1", *SMALL, "--out", str(OUT / name))
    for pol, tau in R2_POLICIES:
        name = f"r2_bubbles_{pol}"
        c[name] = cmd(*R2, "--policy", pol, "--token-budget", tau, "--qps", "1.0", "--num-requests", "500",
                      "--drain", "120", "--seed", "0", "--out", str(OUT / name))
    for pol in ("sarathi", "hybrid_only", "chunked_only"):
        name = f"r3_ablation_{pol}"
        c[name] = cmd(*R1, "--policy", pol, "--token-budget", "512", "--qps", R3_ABLATION_QPS,
                      "--num-requests", "500", "--drain", "120", "--seed", "0", "--tbt-slo", "0.1",
                      "--out", str(OUT / name))
    for slo, s in R1_SLOS.items():
        for tau in R3_TAUS:
            if tau in ("512", "2048"):
                continue   # r1 has them
            name = f"r3_{slo}_sarathi_tau{tau}"
            c[name] = cmd(*R1, "--policy", "sarathi", "--token-budget", tau, "--tbt-slo", s, "--capacity",
                          "--qps-start", "2", *SMALL, "--out", str(OUT / name))
    for tau in R4_TAUS + ("adaptive",):
        name = f"r4_capacity_{tau}"
        c[name] = cmd(*R4, "--token-budget", tau, "--capacity", "--qps-start", "2", *SMALL,
                      "--out", str(OUT / name))
    return c


_record_lock = threading.Lock()


def run_one(name: str, args: list[str], skip_done: bool = False) -> None:
    """Run one `sarathi` command; record it in commands.json once it wrote its result."""
    line = " ".join(shlex.quote(a) for a in args)
    if not (skip_done and (OUT / f"{name}.json").is_file()):
        print("$ " + line, file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "sarathi.cli", *args[1:]], check=True, stdout=subprocess.DEVNULL)
    with _record_lock:
        path = OUT / "commands.json"
        done = json.loads(path.read_text()) if path.is_file() else {}
        done[name] = line
        path.write_text(json.dumps(done, indent=1, sort_keys=True))


def run(jobs: int, only: set[str] | None, todo: dict[str, list[str]] | None = None,
        skip_done: bool = True) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    todo = todo or {k: v for k, v in plan().items() if only is None or k.split("_")[0] in only}
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda kv: run_one(*kv, skip_done=skip_done), todo.items()))


def r4_windows() -> dict[str, list[str]]:
    """After r4's searches: each config at the best fixed tau's capacity, P99 TBT in 8 windows."""
    caps = {t: load(f"r4_capacity_{t}")["capacity_qps"] for t in R4_TAUS}
    best = max(caps, key=caps.get)
    qps = f"{caps[best]:.3g}"
    return {f"r4_windows_{t}": cmd(*R4, "--token-budget", t, "--qps", qps, "--num-requests", "500",
                                   "--drain", "120", "--seed", "0", "--windows", "8",
                                   "--out", str(OUT / f"r4_windows_{t}"))
            for t in (best, "adaptive")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "windows", "record", "figures"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="")
    a = ap.parse_args(argv)
    if a.what == "run":
        run(a.jobs, set(a.only.split(",")) if a.only else None)
    elif a.what == "record":   # commands.json from plan() for every result there (after parallel runs)
        path = OUT / "commands.json"
        done = json.loads(path.read_text()) if path.is_file() else {}
        done.update({k: " ".join(shlex.quote(x) for x in v) for k, v in plan().items()
                     if (OUT / f"{k}.json").is_file()})
        path.write_text(json.dumps(done, indent=1, sort_keys=True))
    elif a.what == "windows":
        run(a.jobs, None, r4_windows(), skip_done=False)
    else:
        figures()


if __name__ == "__main__":
    main()
