"""The paper's simulated GPU results (bench/results/sim/): which runs there are (r1-r4, the
issue's numbering; see bench.sim_paper), their configurations, where their results go (OUT) and
how one is read back (load). The runner (bench.sim_paper) and the figures (bench.sim_figures)
both read this module; it imports neither.
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path("bench/results/sim")
PROBE = ["--num-requests", "1000", "--drain", "120", "--resolution", "0.04", "--seed", "0"]
SMALL = ["--num-requests", "500", "--drain", "120", "--resolution", "0.05", "--seed", "0"]   # r2-r4: half the CPU
R1 = ["--model", "llama-3-8b", "--device", "a100"]
R1_SLOS = {"strict": "0.1", "relaxed": "0.5"}
R1_CONFIGS = [("sarathi", "512"), ("sarathi", "2048"), ("vllm", "512"), ("orca", "512"),
              ("faster_transformer", "512")]
R2 = ["--model", "llama-2-70b", "--device", "a100", "--tp", "4", "--pp", "2"]
R2_POLICIES = [("sarathi", "512"), ("vllm", "512"), ("orca", "512")]
R3_TAUS = ("256", "512", "1024", "2048", "4096")
R3_ABLATION_QPS = "2.0"
R4 = R1 + ["--length-scale", "0.5", "--shift-prompt-scale", "4", "--tbt-slo", "0.1"]
R4_TAUS = ("256", "512", "1024", "2048")


def load(name: str) -> dict:
    return json.loads((OUT / f"{name}.json").read_text())
