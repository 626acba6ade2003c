"""The measurement tools (sarathi.measure, `sarathi bench|profile|capacity|plan`), on the simulated
executor with synthetic cost models: fast, deterministic, and with answers known in advance."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sarathi.cli import main
from sarathi.measure.capacity import search_capacity
from sarathi.measure.costmodel import CostModel, fit
from sarathi.measure.loadgen import arrival_times, make_workload, run_inprocess
from sarathi.measure.metrics import INF, RequestRecord, meets_slo, percentile, summarize
from sarathi.measure.plan import plan_token_budget
from sarathi.measure.tools import Target, Workload, capacity, run_once
from sarathi.measure.trace import DEFAULT_TRACE, Trace, load_trace
from scheduler_svc.sim_executor import sim_engine
from shared.config import resolve_token_budget
from tests.support.gateway_fakes import Plan


# -- metrics ------------------------------------------------------------------------------------
def test_percentiles_are_nearest_rank_on_known_inputs():
    xs = list(range(1, 101))                       # 1..100
    assert [percentile(xs, p) for p in (50, 90, 99, 100)] == [50, 90, 99, 100]
    assert percentile([3.0], 99) == 3.0
    assert percentile([4, 1, 3, 2], 50) == 2       # unsorted input; rank ceil(0.5 * 4) = 2
    assert percentile([1, 2, INF], 50) == 2 and percentile([1, 2, INF], 99) == INF
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 0)


def test_tbt_excludes_the_first_token_and_uses_individual_gaps():
    r = RequestRecord("a", arrival=1.0, prompt_tokens=4, expected_tokens=4,
                      token_times=[1.5, 1.6, 1.8, 2.2], first_scheduled=1.1, finished=True)
    s = summarize([r])
    assert s["ttft_p50_s"] == pytest.approx(0.5)
    assert sorted(r.tbts) == pytest.approx([0.1, 0.2, 0.4])
    assert s["tbt_samples"] == 3 and s["tbt_p99_s"] == pytest.approx(0.4)
    assert s["sched_delay_p50_s"] == pytest.approx(0.1)
    assert s["e2e_p50_s"] == pytest.approx(1.2)


def test_unfinished_requests_count_as_misses_not_as_absent():
    done = [RequestRecord(f"d{i}", 0.0, 4, 10, [0.1 * (k + 1) for k in range(10)], 0.0, True)
            for i in range(10)]                                 # 90 gaps of 0.1 s
    stuck = RequestRecord("s", 0.0, 4, 10, [0.5], 0.0, False)   # 9 gaps never closed
    never = RequestRecord("n", 0.0, 4, 10, [], None, False)     # never scheduled: 9 more
    s = summarize(done + [stuck, never])
    assert (s["requests"], s["finished"], s["unfinished"]) == (12, 10, 2)
    assert s["tbt_missing"] == 18 and s["tbt_samples"] == 90 + 18
    assert s["tbt_p99_s"] == INF and s["ttft_p99_s"] == INF and s["e2e_p99_s"] == INF
    assert not meets_slo(s, tbt_slo_s=10.0)
    assert meets_slo(summarize(done), tbt_slo_s=0.11)          # the same run without them passes


def test_a_too_short_run_leaves_its_unfinished_requests_in_the_results():
    trace = Trace([64] * 4, [50] * 4, "synthetic")
    engine = sim_engine("sarathi", token_budget=64, num_blocks=256, verify_kv=False,
                        cost_model=lambda b: 0.1)
    wl = make_workload(trace, 20, qps=10.0, seed=1)
    res = run_inprocess(engine, wl, drain_s=0.5)                # 50 tokens x 0.1 s do not fit
    assert len(res.records) == 20
    s = summarize(res.records, res.iterations, res.end_time)
    assert s["unfinished"] > 0 and s["tbt_p99_s"] == INF


# -- workload -------------------------------------------------------------------------------------
def test_arrival_processes_have_the_asked_rate_and_shape():
    rng = np.random.default_rng(0)
    t = np.array(arrival_times(20000, 4.0, "poisson", rng=rng))
    gaps = np.diff(t)
    assert t[0] == 0.0 and gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    g = np.diff(arrival_times(20000, 4.0, "gamma", cv=3.0, rng=rng))
    assert g.mean() == pytest.approx(0.25, rel=0.1) and g.std() / g.mean() == pytest.approx(3.0, rel=0.15)
    assert arrival_times(6, 2.0, "burst", burst_size=3) == [0, 0, 0, 1.5, 1.5, 1.5]
    with pytest.raises(ValueError, match="qps"):
        arrival_times(5, 0.0)


def test_workload_prompts_and_outputs_have_the_trace_lengths():
    trace = load_trace(length_scale=0.125)
    wl = make_workload(trace, 50, qps=1.0, seed=3, vocab_size=500)
    rows = set(zip(trace.prompt_lens, trace.output_lens))
    assert all((len(s.prompt_ids), s.max_tokens) in rows for s in wl)
    assert all(100 <= t < 500 for s in wl for t in s.prompt_ids)
    assert [s.prompt_ids for s in wl] == [s.prompt_ids for s in make_workload(trace, 50, 1.0, seed=3, vocab_size=500)]


def test_the_shipped_trace_loads_and_scales():
    full = load_trace()
    assert len(full) == 30731 and DEFAULT_TRACE.is_file()
    assert sorted(full.prompt_lens)[len(full) // 2] == 1730
    scaled = load_trace(length_scale=0.125, max_total_len=512)
    assert all(p + o <= 512 and p >= 1 and o >= 1 for p, o in zip(scaled.prompt_lens, scaled.output_lens))


# -- capacity -------------------------------------------------------------------------------------
def test_capacity_search_brackets_a_threshold_within_the_resolution():
    res = search_capacity(lambda q: q <= 3.7, qps_start=1.0, resolution=0.02)
    assert 3.7 * 0.98 <= res["capacity_qps"] <= 3.7
    assert all(p["ok"] == (p["qps"] <= 3.7) for p in res["probes"])
    assert search_capacity(lambda q: False, qps_start=1.0, qps_min=0.01)["capacity_qps"] == 0.0


def test_capacity_of_a_simulated_engine_matches_the_queueing_answer():
    """One 100-token prompt per iteration (max_num_batched_tokens=100), each iteration 0.1 s,
    one output token, arrivals every 1/q s (burst size 1), 201 requests. Above 10 QPS the
    queue grows: request i is scheduled at 0.1 i, its delay is i (0.1 - 1/q), and the P50
    (request 100) stays <= 2 s while 1/q >= 0.08: capacity = 12.5 QPS."""
    trace = Trace([100], [1], "synthetic")

    def make(policy, tau):
        return sim_engine(policy, token_budget=tau, num_blocks=4096, max_num_batched_tokens=100,
                          verify_kv=False, cost_model=lambda batch: 0.1)
    w = Workload(trace, 201, arrival="burst", burst_size=1, drain_s=100.0)
    res = capacity(Target("sim", make_engine=make), w, tbt_slo_s=1.0, policy="vllm",
                   qps_start=2.0, resolution=0.02, progress=False)
    assert 12.5 * 0.98 <= res["capacity_qps"] <= 12.5
    assert all(p["ok"] == (p["qps"] <= 12.5) for p in res["probes"])


def test_stall_free_batching_beats_prefill_priority_under_a_tight_tbt_slo():
    """The paper's claim on a synthetic cost model: the same workload, the same SLO."""
    model = CostModel([0.02, 1e-3, 0.0, 0.0, 0.0, 0.0], knee=64)   # 20 ms + 1 ms per token
    trace = Trace([400, 200, 800], [30, 40, 20], "synthetic")

    def make(policy, tau):
        return sim_engine(policy, token_budget=tau, num_blocks=8192, verify_kv=False,
                          cost_model=model, max_model_len=4096)
    w = Workload(trace, 0, drain_s=60.0, duration_s=60.0)
    cap = {p: capacity(Target("sim", make_engine=make), w, tbt_slo_s=0.3, policy=p,
                       token_budget=256, qps_start=1.0, resolution=0.1, progress=False)["capacity_qps"]
           for p in ("sarathi", "vllm")}
    assert cap["sarathi"] >= 2 * cap["vllm"] > 0


# -- cost model and plan ---------------------------------------------------------------------------
def test_cost_model_fit_recovers_a_known_model():
    truth = CostModel([0.03, 4e-4, 8e-4, 0.02, 0.05, 1e-3], knee=64)
    shapes = ([[(ctx, 1, True)] * b for b in (1, 8, 32, 64) for ctx in (128, 512)]
              + [[(p, n, False)] for n in (16, 64, 128, 256, 512, 1024) for p in (0, 512)]
              + [[(256, 1, True)] * 32 + [(0, n, False)] for n in (64, 256, 512)])
    model = fit([(s, truth.predict_shapes(s)) for s in shapes])
    assert model.knee == 64 and model.fit_error["max_rel"] < 1e-6
    assert model.predict_shapes([(300, 1, True)] * 16 + [(100, 200, False)]) == pytest.approx(
        truth.predict_shapes([(300, 1, True)] * 16 + [(100, 200, False)]))


def test_plan_picks_the_largest_tile_aligned_budget_within_the_slo():
    model = CostModel([0.01, 1e-3, 0.0, 0.0, 0.0, 0.0], knee=64)   # t = 10 ms + 1 ms per token
    res = plan_token_budget(model, 0.2, context=512, tile=32, decode_batch=32)
    assert res["token_budget"] == 160                  # 190 tokens fit; 160 is the last tile
    assert res["iteration_s"] == pytest.approx(0.17)
    with pytest.raises(ValueError, match="no token budget"):
        plan_token_budget(model, 0.02, context=512, tile=32)


def test_token_budget_accepts_a_number_a_plan_file_or_auto(tmp_path, monkeypatch):
    (tmp_path / "p.json").write_text(json.dumps({"token_budget": 384}))
    assert resolve_token_budget("256") == 256
    assert resolve_token_budget(str(tmp_path / "p.json")) == 384
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="sarathi plan"):
        resolve_token_budget("auto")
    (tmp_path / "sarathi-plan.json").write_text(json.dumps({"token_budget": 128}))
    assert resolve_token_budget("auto") == 128


# -- the CLI, quick mode (simulated executor) --------------------------------------------------------
def test_cli_profile_plan_capacity_bench_run_in_quick_mode(tmp_path, capsys):
    prof, plan = tmp_path / "prof", tmp_path / "plan.json"
    assert main(["profile", "--executor", "sim", "--quick", "--rounds", "1", "--length-scale",
                 "0.125", "--out", str(prof), "--no-progress"]) == 0
    p = json.loads(prof.with_suffix(".json").read_text())
    assert p["slo"]["context"] == 512 and p["slo"]["strict_s"] == pytest.approx(5 * p["slo"]["decode_b32_s"])
    assert prof.with_suffix(".png").stat().st_size > 0 and p["machine"]["cpu"]
    assert main(["plan", "--profile", str(prof) + ".json", "--slo", "strict", "--out", str(plan)]) == 0
    tau = json.loads(plan.read_text())["token_budget"]
    assert tau > 0 and tau % 32 == 0
    common = ["--executor", "sim", "--profile", str(prof) + ".json", "--length-scale", "0.125",
              "--token-budget", str(plan), "--no-progress"]
    assert main(["capacity", *common, "--slo", "strict", "--duration", "20", "--resolution", "0.2",
                 "--out", str(tmp_path / "cap")]) == 0
    cap = json.loads((tmp_path / "cap.json").read_text())
    assert cap["capacity_qps"] > 0 and cap["token_budget"] == tau and len(cap["probes"]) >= 2
    assert (tmp_path / "cap.png").is_file()
    assert main(["bench", *common, "--qps", "1,2", "--num-requests", "20",
                 "--out", str(tmp_path / "b")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert [r["qps"] for r in b["runs"]] == [1.0, 2.0]
    assert all(r["summary"]["finished"] == 20 and r["iterations"] for r in b["runs"])
    assert "2 QPS: TTFT P50" in capsys.readouterr().out
    # disaggregated pools on the profile: its model's KV size is not in it, so it must be given
    pools = ["simulate", "--profile", str(prof) + ".json", "--prefill-replicas", "1", "--decode-replicas", "1",
             "--disaggregation", "all", "--num-requests", "6", "--qps", "1", "--tbt-slo", "1", "--length-scale",
             "0.125", "--no-progress", "--details", "--out", str(tmp_path / "pd")]
    assert main(pools) == 2 and "give --kv-bytes-per-token" in capsys.readouterr().err
    assert main([*pools, "--kv-bytes-per-token", "1000"]) == 0
    sim = json.loads((tmp_path / "pd.json").read_text())
    assert sim["simulated"]["kv_bytes_per_token"] == 1000
    sent = sim["runs"][0]["summary"]["transfers"]
    assert sent and all(t["kv_bytes"] > 0 and t["kv_bytes"] % (16 * 1000) == 0 for t in sent)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--executor", "sim", "--trace", "/nonexistent.csv"], "trace file not found"),
    (["bench", "--executor", "sim", "--prompt-column", "nope"], "no column 'nope'"),
    (["bench", "--executor", "sim", "--qps", "0"], "--qps must be > 0"),
    (["bench", "--executor", "sim", "--qps=-1,2"], "--qps must be > 0"),
    (["capacity", "--executor", "sim"], "needs a TBT SLO"),
    (["bench", "--url", "http://127.0.0.1:9", "--num-requests", "1"], "cannot reach http://127.0.0.1:9"),
    (["plan", "--profile", "/nonexistent.json", "--tbt-slo", "1"], "profile file not found"),
])
def test_bad_input_gets_one_clear_error_line(argv, message, capsys):
    assert main(argv + ["--no-progress"] if argv[0] != "plan" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith(f"sarathi {argv[0]}: error:")


def test_bad_trace_rows_are_reported_with_their_line(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n10,5\nx,3\n")
    with pytest.raises(ValueError, match="line 3"):
        load_trace(f)


def test_http_target_rejects_a_server_without_models(tmp_path):
    """`--url` pointing at something that is not an OpenAI server fails before any load."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        w = Workload(Trace([4], [2], "s"), 1, drain_s=1.0)
        with pytest.raises(ValueError, match="answered HTTP 404"):
            run_once(Target("http", url=f"http://127.0.0.1:{srv.server_port}"), w, 1.0, progress=False)
    finally:
        srv.shutdown()


# -- HTTP target against the real gateway (fake scheduler behind it) ---------------------------------

@pytest.mark.slow
def test_http_target_times_sse_chunks_of_a_real_gateway(make_stack, tokenizer):
    """run_http against the real FastAPI gateway on uvicorn: token times are SSE chunk arrival
    times, gaps follow the scheduler's pace, and every request finishes."""
    text = "one two three four five six"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    stack = make_stack(plan=lambda req: Plan(text, interval_s=0.05))
    w = Workload(Trace([8], [n], "synthetic"), 4, arrival="burst", burst_size=2, drain_s=10.0)
    target = Target("http", url=stack.url, vocab_size=tokenizer.vocab_size)
    run = run_once(target, w, qps=4.0, progress=False)
    s = run["summary"]
    assert (s["requests"], s["finished"], s["errors"]) == (4, 4, 0)
    assert all(len(r["token_times"]) == n for r in run["requests"])
    assert 0.04 <= s["tbt_p50_s"] <= 0.5 and s["tbt_samples"] == 4 * (n - 1)
    assert s["sched_delay_p50_s"] is None          # not observable over HTTP
    assert len(stack.fake.received) == 4 and all(r.sampling.ignore_eos for r in stack.fake.received)


def test_http_target_sends_a_follow_up_after_the_answer_it_replies_to(make_stack, tokenizer):
    """A follow-up (RequestSpec.after) goes out its think time after its answer's last SSE chunk;
    one that would be due after the last scheduled arrival is not sent and has no record."""
    from sarathi.measure.loadgen import RequestSpec, run_http

    text = "one two three four five six"
    n = len(tokenizer.encode(text, add_special_tokens=False))
    stack = make_stack(plan=lambda req: Plan(text, interval_s=0.05))
    w = [RequestSpec("a0", 0.0, [5, 6, 7], n), RequestSpec("b0", 0.0, [5, 6, 8], n),
         RequestSpec("a1", 0.0, [5, 6, 7, 9], n, after="a0", think_s=0.3),
         RequestSpec("b1", 0.0, [5, 6, 8, 9], n, after="b0", think_s=30.0),   # due after z: not sent
         RequestSpec("z", 2.0, [5, 6, 10], n)]
    run = run_http(stack.url, w, drain_s=10.0)
    rec = {r.req_id: r for r in run.records}
    assert set(rec) == {"a0", "b0", "a1", "z"} and all(r.finished for r in rec.values())
    assert rec["a1"].arrival >= rec["a0"].token_times[-1] + 0.3
    assert rec["a1"].token_times[0] > rec["a1"].arrival
    assert len(stack.fake.received) == 4


# -- the P50 TTFT condition and the fixed-point capacity of the llama-server comparison -------
def test_ttft_bound_is_an_extra_condition_and_sched_delay_is_skipped_when_unobservable():
    # an HTTP run: no scheduling delay observable; TBT within the SLO, P50 TTFT 2.5 s
    http = {"tbt_p99_s": 1.0, "sched_delay_p50_s": None, "ttft_p50_s": 2.5}
    assert meets_slo(http, tbt_slo_s=2.0)                              # TBT only: passes
    assert not meets_slo(http, tbt_slo_s=2.0, max_ttft_p50_s=2.0)     # + TTFT <= 2 s: misses
    assert meets_slo(http, tbt_slo_s=2.0, max_ttft_p50_s=3.0)
    assert not meets_slo({**http, "sched_delay_p50_s": 2.5}, tbt_slo_s=2.0)   # observable: applies
    assert not meets_slo({**http, "ttft_p50_s": INF}, tbt_slo_s=2.0, max_ttft_p50_s=2.0)


def test_capacity_from_fixed_points_is_the_highest_pass_below_the_first_miss():
    from bench.peer_llama_server import capacity_from_points
    assert capacity_from_points([(0.7, True), (0.4, True), (1.0, False)]) == \
        {"capacity_qps": 0.7, "bracket": [0.7, 1.0]}
    # a pass above a miss (noise) does not raise the answer: the lower bound stays conservative
    assert capacity_from_points([(0.4, True), (0.55, False), (0.7, True)])["capacity_qps"] == 0.4
    assert capacity_from_points([(1.0, False), (2.0, False)]) == {"capacity_qps": 0.0, "bracket": [0.0, 1.0]}
    assert capacity_from_points([(1.0, True), (2.0, True)]) == {"capacity_qps": 2.0, "bracket": [2.0, None]}
    with pytest.raises(ValueError):
        capacity_from_points([])


def test_peer_analysis_counts_unfinished_runs_as_misses_under_every_condition():
    from bench.peer_llama_server import analyse

    def run(qps, tbt, ttft):
        return {"qps": qps, "summary": {"tbt_p99_s": tbt, "ttft_p50_s": ttft, "sched_delay_p50_s": None}}
    sar = {"runs": [run(0.4, 1.0, 0.5), run(0.7, 1.9, 2.5), run(1.0, "inf", "inf")]}
    lla = {"runs": [run(0.1, 1.5, 1.0), run(0.2, 5.0, 1.5), run(0.4, "inf", 30.0)]}
    r = analyse({"sarathi": {"strict": sar, "relaxed": sar}, "llama-server": {"strict": lla, "relaxed": lla}},
                {"strict": 2.0, "relaxed": 10.0})
    c = r["capacity"]
    assert c["sarathi"]["strict/tbt"]["capacity_qps"] == 0.7
    assert c["sarathi"]["strict/tbt+ttft"]["capacity_qps"] == 0.4
    assert c["llama-server"]["strict/tbt"]["capacity_qps"] == 0.1
    assert c["llama-server"]["relaxed/tbt"]["capacity_qps"] == 0.2
    assert r["sarathi_over_llama_server"]["strict/tbt"] == pytest.approx(7.0)


# ---- soak: capacity of the soak workload before soaking at a fraction of it -----------------

def test_soak_capacity_search_doubles_then_bisects(monkeypatch):
    """find_capacity against a fake server that sustains up to 1.3 QPS: 0.25, 0.5, 1 pass, 2
    fails, then two bisections (1.5 fails, 1.25 passes) -> 1.25, the highest passing probe."""
    import argparse

    import bench.soak as soak

    probed = []

    def fake_probe(base, model, args, qps):
        probed.append(qps)
        return {"qps": qps, "passed": qps <= 1.3}

    monkeypatch.setattr(soak, "probe", fake_probe)
    args = argparse.Namespace(probe_start=0.25, probe_bisect=2, probe_s=1.0, ttft_p50_bound=2.0)
    cap = soak.find_capacity("http://x", "m", args)
    assert probed == [0.25, 0.5, 1.0, 2.0, 1.5, 1.25]
    assert cap["capacity_qps"] == 1.25 and cap["first_failing_qps"] == 1.5
    # a first probe that fails bisects below it; nothing passing gives 0
    probed.clear()
    monkeypatch.setattr(soak, "probe", lambda b, m, a, q: probed.append(q) or {"qps": q, "passed": q <= 0.1})
    assert soak.find_capacity("http://x", "m", args)["capacity_qps"] == 0.062 and probed == [0.25, 0.125, 0.062]
    probed.clear()
    monkeypatch.setattr(soak, "probe", lambda b, m, a, q: probed.append(q) or {"qps": q, "passed": False})
    assert soak.find_capacity("http://x", "m", args)["capacity_qps"] == 0.0 and len(probed) == 3
