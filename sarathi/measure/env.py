"""What every result records about where and when it was measured: CPU model and ISA flags
that matter for matmuls (avx2 / avx512 / amx), core count, load average, UTC date, command."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path


def cpu_model() -> str:
    """lscpu's model name with its family and model numbers: virtual machines often report only
    "AMD EPYC", and Zen 2, Zen 3 and Zen 4 differ (e.g. family 25 model 17 is Zen 4)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip(): v.strip() for k, _, v in (l.partition(":") for l in out.splitlines())}
        name = fields["Model name"]
        if fields.get("CPU family") and fields.get("Model"):
            name += f" (family {fields['CPU family']} model {fields['Model']})"
        return name
    except Exception:
        return platform.processor() or "unknown"


def isa_flags() -> str:
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return "unknown"
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return " ".join(keep) or "no avx2/avx512/amx"


def loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    """The record attached to every result."""
    return {"cpu": cpu_model(), "isa": isa_flags(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "loadavg": loadavg(), "date": utc_now()}


def command_line(argv: list[str] | None = None, prog: str = "sarathi") -> str:
    args = sys.argv[1:] if argv is None else argv
    return " ".join([prog] + [shlex.quote(a) for a in args])
