"""The scheduler is torch-free: importing all of scheduler_svc must not import torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES = ["scheduler_svc.request", "scheduler_svc.prefix_cache", "scheduler_svc.block_manager",
           "scheduler_svc.policies", "scheduler_svc.scheduler", "scheduler_svc.engine_loop",
           "scheduler_svc.sim_executor"]


def test_scheduler_modules_do_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES) +
            "from scheduler_svc.sim_executor import sim_engine\n"
            "sim_engine().generate([[1, 2, 3]])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
