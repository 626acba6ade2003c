"""The scheduler is torch-free: importing every module of scheduler_svc must not import torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import importlib, pkgutil, sys
import scheduler_svc
for m in pkgutil.walk_packages(scheduler_svc.__path__, "scheduler_svc."):
    importlib.import_module(m.name)
from scheduler_svc.sim_executor import sim_engine
sim_engine().generate([[1, 2, 3]])
assert "torch" not in sys.modules, "torch was imported"
"""


def test_no_scheduler_svc_module_imports_torch():
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
