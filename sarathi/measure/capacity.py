"""`sarathi capacity`: the highest request rate a deployment serves within its SLO.

Capacity (DESIGN.md, the paper): the highest Poisson QPS at which P99 TBT <= the TBT SLO and
P50 scheduling delay <= 2 s, unfinished requests counting as misses. Each probe is one open-loop
run of the same workload shape (trace, seed, request count) at a given QPS.

Search: from qps_start, double (or halve) until a passing and a failing rate bracket the answer,
then bisect until (hi - lo) / hi <= resolution. The answer is the highest rate that passed,
so it is at most `resolution` (relative) below the true threshold of this workload, assuming
pass/fail is monotone in QPS (noise from one finite run can break that: the probes are all in
the result so a reader can see it).
"""
from __future__ import annotations

from typing import Callable


def search_capacity(probe: Callable[[float], bool], *, qps_start: float = 1.0,
                    resolution: float = 0.05, qps_min: float = 1e-3, qps_max: float = 1e4,
                    max_probes: int = 40) -> dict:
    """probe(qps) -> True if the SLO holds at qps. Returns {"capacity_qps", "resolution",
    "probes": [(qps, ok), ...], "bracket": [lo, hi]}; capacity_qps = 0.0 if even qps_min
    fails, qps_max if qps_max passes."""
    if not qps_start > 0:
        raise ValueError(f"--qps-start must be > 0, got {qps_start}")
    if not 0 < resolution < 1:
        raise ValueError(f"--resolution must be in (0, 1), got {resolution}")
    probes: list[tuple[float, bool]] = []

    def run(q: float) -> bool:
        ok = bool(probe(q))
        probes.append((q, ok))
        return ok

    lo, hi = None, None
    q = min(max(qps_start, qps_min), qps_max)
    if run(q):
        lo = q
        while hi is None and len(probes) < max_probes:
            if lo >= qps_max:
                return _result(qps_max, resolution, probes, qps_max, None)
            q = min(lo * 2, qps_max)
            if run(q):
                lo = q
            else:
                hi = q
    else:
        hi = q
        while lo is None and len(probes) < max_probes:
            if hi <= qps_min:
                return _result(0.0, resolution, probes, None, qps_min)
            q = max(hi / 2, qps_min)
            if run(q):
                lo = q
            else:
                hi = q
    while lo is not None and hi is not None and (hi - lo) / hi > resolution and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return _result(lo or 0.0, resolution, probes, lo, hi)


def _result(cap, resolution, probes, lo, hi) -> dict:
    return {"capacity_qps": cap, "resolution": resolution, "bracket": [lo, hi],
            "probes": [{"qps": q, "ok": ok} for q, ok in probes]}
