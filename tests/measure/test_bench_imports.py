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


def test_kernel_variants_compares_each_arm_with_llama_cpp_by_the_name_its_rounds_carry():
    """The rounds come back keyed by bench.gguf_kernels.LLAMA; the ratios against llama.cpp must
    be computed under that name (they were silently left out when the two names differed)."""
    from bench import kernel_variants as kv
    from bench.gguf_kernels import LLAMA

    times = {"avx2-only": {"decode:1": [0.008, 0.010], "decode:32": [0.1, 0.12], "prefill:512": [0.8, 0.9]},
             "best": {"decode:1": [0.007, 0.007], "decode:32": [0.08, 0.08], "prefill:512": [0.5, 0.5]},
             LLAMA: {"decode:1": [0.016, 0.020], "decode:32": [0.25, 0.24], "prefill:512": [1.6, 1.5]}}
    res = kv.summarize(times)
    assert res["ratios"]["avx2_only_over_llama"]["decode:1"] == 0.5
    assert res["ratios"]["best_over_llama"]["prefill:512"] == round(500 / 1550, 3)
    assert res["paired_ratios"]["avx2_only_over_llama"]["decode:1"]["median"] == 0.5
    assert res["paired_ratios"]["avx2_only_over_llama"]["prefill:512"]["rounds"] == 2


def test_kernel_variants_takes_verification_sized_prefills_and_refuses_other_cases():
    """--cases: the default engine cases and prefill:N up to 16 tokens (a decode verifying drafts);
    anything else is refused by name, and the summary and its ratios cover exactly those cases."""
    from bench import kernel_variants as kv

    assert kv.parse_cases("decode:1,prefill:4,prefill:16") == ["decode:1", "prefill:4", "prefill:16"]
    for bad in ("prefill:17", "prefill:0", "decode:2", "prefill:x", ","):
        with pytest.raises(ValueError):
            kv.parse_cases(bad)
    times = {"best": {"decode:1": [0.006, 0.007], "prefill:4": [0.010, 0.011]},
             "rows16-from5": {"decode:1": [0.006, 0.007], "prefill:4": [0.011, 0.012]}}
    res = kv.summarize(times, ["decode:1", "prefill:4"])
    assert set(res["ratios"]["best_over_rows16_from5"]) == {"decode:1", "prefill:4"}
    assert res["ratios"]["best_over_rows16_from5"]["prefill:4"] == round(10.5 / 11.5, 3)


def test_engine_comparisons_start_their_arms_in_both_orders():
    """The process started first steps slower on these guests (bench.start_order), so a comparison
    runs half its rounds with the arms started in each order, and no round is lost or added."""
    from bench.common import start_order_sessions

    assert start_order_sessions(["a", "b"], 12) == [(["a", "b"], 6), (["b", "a"], 6)]
    assert start_order_sessions(["a", "b", "c"], 7) == [(["a", "b", "c"], 4), (["c", "b", "a"], 3)]
    assert start_order_sessions(["a", "b"], 1) == [(["a", "b"], 1)]
    for arms, rounds in ((["x", "y"], 5), (["x"], 9), (["p", "q", "r"], 2)):
        sessions = start_order_sessions(arms, rounds)
        assert sum(n for _, n in sessions) == rounds
        assert all(sorted(order) == sorted(arms) for order, _ in sessions)
