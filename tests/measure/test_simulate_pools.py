"""`sarathi simulate` with worker pools (sarathi.measure.simulate.run_pools): the real PoolSet +
Router on the virtual clock. Deterministic; the KV transfer is its own term, grows with the
prompt and lands in the TTFT; `all` prefills every prompt on the prefill pool, `auto` below its
threshold none; colocated pools share the load."""
from __future__ import annotations

import json

import pytest

from sarathi.cli import main
from sarathi.measure.gpu_costmodel import GPUCostModel
from sarathi.measure.simulate import pool_target
from sarathi.measure.tools import Workload, run_once
from sarathi.measure.trace import load_trace

MODEL = GPUCostModel("llama-3-8b", "a100")
KV = MODEL.shape.kv_bytes_per_token(MODEL.shape.num_layers, 1)   # 131072 B: 32 layers x K,V x 8 x 128 x 2


def fixed_trace(tmp_path, prompt: int, output: int, rows: int = 40):
    path = tmp_path / f"trace_{prompt}.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + f"{prompt},{output}\n" * rows)
    return load_trace(path)


def pd(mode="all", threshold=256, **kw):
    return pool_target(MODEL, roles=["prefill", "decode"], mode=mode, threshold_tokens=threshold,
                       num_blocks=4096, kv_bytes_per_token=KV, kv_link_gbs=25.0, **kw)


def go(target, w, qps=2.0):
    return run_once(target, w, qps, policy="sarathi", token_budget=512, progress=False)


def test_a_simulated_pd_run_is_deterministic():
    w = Workload(load_trace(max_total_len=8192), 80, drain_s=30, seed=1)
    a, b = go(pd("auto", 300), w), go(pd("auto", 300), w)
    assert a["summary"]["finished"] == 80
    assert 0 < a["summary"]["disaggregated_requests"] < 80
    assert a["requests"] == b["requests"] and a["summary"] == b["summary"]


def test_all_prefills_every_prompt_on_the_prefill_pool_and_decodes_on_the_decode_pool(tmp_path):
    w = Workload(fixed_trace(tmp_path, 300, 20), 30, drain_s=30)
    s = go(pd("all"), w)["summary"]
    prefill, decode = s["pools"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["requests_routed"] == 30 and decode["requests_routed"] == 0
    assert s["counters"]["num_handoffs"] == 30 == s["disaggregated_requests"] == len(s["transfers"])
    assert s["finished"] == 30 and decode["busy_s"] > 0


def test_the_transfer_is_its_own_term_grows_with_the_prompt_and_lands_in_the_ttft(tmp_path):
    """bytes = prompt blocks x 16 tokens x KV bytes per token; seconds = bytes / 25 GB/s; a
    request's TTFT = queueing + prefill + transfer (the prefill worker's reply waits for the ack)."""
    per = {}
    for prompt in (256, 1024, 4096):
        w = Workload(fixed_trace(tmp_path, prompt, 8, rows=1), 1, drain_s=30)
        s = go(pd("all"), w)["summary"]
        (t,) = s["transfers"]
        assert t["kv_bytes"] == -(-prompt // 16) * 16 * KV
        assert t["kv_transfer_s"] == pytest.approx(t["kv_bytes"] / 25e9)
        assert t["ttft_s"] == pytest.approx(t["queue_s"] + t["prefill_s"] + t["kv_transfer_s"])
        assert s["pools"][0]["kv_send_s"] == pytest.approx(t["kv_transfer_s"], rel=1e-4)
        assert s["kv_transfer_share_of_ttft_p50"] == pytest.approx(t["kv_transfer_s"] / t["ttft_s"])
        per[prompt] = t["kv_transfer_s"]
    assert per[256] < per[1024] < per[4096] == pytest.approx(16 * per[256])


def test_a_slower_link_delays_the_first_token_by_exactly_the_extra_transfer(tmp_path):
    w = Workload(fixed_trace(tmp_path, 2048, 8, rows=1), 1, drain_s=30)
    fast = go(pd("all"), w)["summary"]["transfers"][0]
    slow_t = pool_target(MODEL, roles=["prefill", "decode"], mode="all", num_blocks=4096,
                         kv_bytes_per_token=KV, kv_link_gbs=2.5)
    slow = go(slow_t, w)["summary"]["transfers"][0]
    assert slow["kv_transfer_s"] == pytest.approx(10 * fast["kv_transfer_s"])
    assert slow["ttft_s"] - fast["ttft_s"] == pytest.approx(slow["kv_transfer_s"] - fast["kv_transfer_s"])


def test_auto_below_its_threshold_sends_no_prompt_to_the_prefill_pool(tmp_path):
    w = Workload(fixed_trace(tmp_path, 300, 20), 30, drain_s=30)
    s = go(pd("auto", threshold=301), w)["summary"]
    assert s["pools"][0]["requests_routed"] == 0 and s["pools"][0]["busy_s"] == 0
    assert s["disaggregated_requests"] == 0 and s["finished"] == 30
    s = go(pd("auto", threshold=300), w)["summary"]
    assert s["pools"][0]["requests_routed"] > 0 and s["disaggregated_requests"] > 0


def test_colocated_pools_share_the_load_and_transfer_nothing():
    w = Workload(load_trace(max_total_len=8192), 60, drain_s=30, seed=2)
    t = pool_target(MODEL, roles=["mixed", "mixed"], num_blocks=4096, kv_bytes_per_token=KV)
    s = go(t, w, qps=4.0)["summary"]
    assert s["finished"] == 60 and s["disaggregated_requests"] == 0
    a, b = (p["requests_routed"] for p in s["pools"])
    assert a + b == 60 and min(a, b) >= 20


def test_simulate_cli_runs_pools_and_reports_the_transfer(tmp_path, capsys):
    out = tmp_path / "pd"
    assert main(["simulate", "--device", "a100", "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--disaggregation", "all", "--kv-link-gbs", "50", "--num-requests", "20", "--qps", "1",
                 "--tbt-slo", "0.1", "--token-budget", "512", "--no-progress", "--details",
                 "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["simulated"]["pools"] == ["prefill", "decode"] and res["simulated"]["kv_link_gbs"] == 50
    s = res["runs"][0]["summary"]
    assert s["disaggregated_requests"] == 20 and len(s["transfers"]) == 20
    assert 0 < s["kv_transfer_share_of_ttft_p50"] < 1
    assert main(["simulate", "--device", "a100", "--disaggregation", "all", "--num-requests", "5",
                 "--no-progress", "--out", str(tmp_path / "x")]) != 0
    assert "needs --prefill-replicas and --decode-replicas" in capsys.readouterr().err
