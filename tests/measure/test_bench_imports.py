"""Every benchmark script imports cleanly (no work at import time, every name it imports
exists): a script that breaks when a product module changes fails here, not in a benchmark run
hours later."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import bench

MODULES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name):
    importlib.import_module(f"bench.{name}")


def test_merge_runs_merges_points_in_qps_order(tmp_path):
    import json

    from bench.merge_runs import main

    for name, qps in (("a", [2.0, 0.5]), ("b", [1.0])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"command": name, "machine": "m", "runs": [
            {"qps": q} for q in qps]}))
    main([str(tmp_path / "out.json"), str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["qps"] for r in out["runs"]] == [0.5, 1.0, 2.0] and out["command"] == ["a", "b"]
