"""Helpers for the tensor/pipeline-parallel tests: a replica of real ranks (`sarathi worker --tp T
--pp P`, one process per rank, gloo) and the scheduler driving it over ZeroMQ, or the same
scheduler driving one in-process executor with the same number of micro-batches in flight."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.remote_executor import RemoteExecutor
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.support.e2e_stack import ROOT, spawn, stop

BS = 16


class Replica:
    """`sarathi worker --tp --pp` on ipc sockets under tmp; rank 0 at `address`."""

    def __init__(self, tmp: Path, model: str | None, tp: int, pp: int, num_blocks: int,
                 timeout_s: float = 30, **extra):
        self.address = f"ipc://{tmp}/w{tp}x{pp}.sock"
        self.log = tmp / f"replica{tp}x{pp}.log"
        # exactness against one rank is a property of the float path: fp32 KV, float weights (int8
        # per-channel scales of a row-parallel shard differ from the whole weight's)
        opts = dict(bind=self.address, tp=tp, pp=pp, threads=1, dtype="float32",
                    kv_cache_dtype="float32", weight_quant="none",
                    num_blocks=num_blocks, block_size=BS, dist_timeout=timeout_s, **extra)
        if model is not None:
            opts["model"] = model
        self.proc = spawn("worker", opts, self.log)
        self.remote = RemoteExecutor(self.address, timeout_s=timeout_s)
        deadline = time.monotonic() + 240
        while True:
            try:
                self.remote.wait_ready(2.0)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replica did not start:\n{self.log.read_text()[-3000:]}")

    def rank_pids(self) -> list[int]:
        """Pids of the ranks, in rank order (from the launcher's log line)."""
        m = re.search(r"pids \[([\d, ]+)\]", self.log.read_text())
        return [int(x) for x in m.group(1).split(",")]

    def close(self) -> None:
        self.remote.close()
        stop(self.proc)


def make_scheduler(num_blocks: int, token_budget: int, policy: str = "sarathi",
                   model_info=None) -> Scheduler:
    cfg = SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=16,
                          max_model_len=model_info.max_model_len)
    return Scheduler(cfg, CacheConfig(BS, num_blocks), model_info)


def run(executor, depth: int, prompts: list[list[int]], max_tokens: int, num_blocks: int,
        token_budget: int, model_info, record: bool = False):
    """Greedy outputs of prompts through an EngineLoop with `depth` batches in flight, over a
    remote replica (submit/collect) or an in-process executor; (outputs, scheduler, loop)."""
    sched = make_scheduler(num_blocks, token_budget, model_info=model_info)
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     ignore_eos=True))
    reqs = [sched.requests[f"r{i}"] for i in range(len(prompts))]
    loop = EngineLoop(sched, executor, depth, record=record)
    loop.run_until_done()
    return [r.output_token_ids for r in reqs], sched, loop


def make_wide_checkpoint(root: Path) -> Path:
    """A random Llama wide enough (hidden 256, 4 layers) that a 128-token chunk takes
    milliseconds per stage: long enough for stage overlap to show in timestamps."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=256, intermediate_size=1024,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=1024, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    path = root / "wide"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def children_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}") and
            "zombie" not in _status(p)]


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


__all__ = ["Replica", "run", "make_scheduler", "children_alive", "subprocess", "BS"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sarathi.cli", "worker", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("SARATHI_")},
                               **(env or {})})
