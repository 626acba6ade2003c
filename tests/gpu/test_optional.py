"""The GPU extra stays optional: the CPU install and suite never import flashinfer; asking for
CUDA where there is none is a clear error; the CLI routes --device cuda and the GPU options to
the worker; the GPU runner and benchmark work up to where they need a GPU."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_cpu_worker_never_imports_flashinfer(tmp_path):
    """A fake `flashinfer` package first on the path records any import of it; a CPU model runner
    is built and runs a batch; then neither the marker nor the module may exist."""
    fake = tmp_path / "fake" / "flashinfer"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path / 'fake')!r})
        from pathlib import Path
        from shared.messages import Batch
        from tests.support.engine_helpers import chunk, make_executor, make_tiny_checkpoint
        import worker_svc.backends.cuda, worker_svc.backends.cuda.cuda_graphs, worker_svc.sampling.device_sampler
        ex = make_executor(make_tiny_checkpoint(Path({str(tmp_path)!r}), "llama"), num_blocks=8)
        out = ex.execute(Batch(0, [chunk("r", [5, 6, 7], 0, [0], True)]))
        assert list(out.sampled) == ["r"]
        print("flashinfer" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"
    assert not marker.exists()


@no_cuda
def test_cuda_device_without_cuda_is_a_clear_error():
    from worker_svc.backends import select_backend

    with pytest.raises(ValueError, match="no CUDA device"):
        select_backend("cuda", torch.bfloat16)


@no_cuda
def test_cli_generate_on_cuda_without_cuda_says_so():
    r = subprocess.run([sys.executable, "-m", "sarathi.cli", "generate", "--device", "cuda",
                        "--prompt", "hi"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr


def test_missing_flashinfer_is_named_with_the_install_command(monkeypatch):
    from worker_svc.backends.cuda import flashinfer_unavailable_reason

    monkeypatch.setitem(sys.modules, "flashinfer", None)      # makes `import flashinfer` fail
    reason = flashinfer_unavailable_reason()
    assert "flashinfer not importable" in reason and ".[gpu]" in reason


def test_serve_and_worker_pass_device_options_through(monkeypatch):
    """`sarathi serve --device cuda --model DIR` reaches the worker's CUDA backend options."""
    from sarathi import cli, serve
    from worker_svc import service

    seen = {}
    monkeypatch.setattr(serve, "run_embedded", lambda config: seen.setdefault("serve", config))
    monkeypatch.setattr(service, "run_worker", lambda config, **kw: seen.setdefault("worker", config))
    assert cli.main(["serve", "--device", "cuda", "--model", "/m", "--no-cuda-graphs",
                     "--gpu-memory-utilization", "0.8"]) == 0
    assert cli.main(["worker", "--device", "cuda:1", "--max-num-seqs", "64"]) == 0
    s, w = seen["serve"].worker, seen["worker"].engine
    assert (s.device, s.cuda_graphs, s.gpu_memory_utilization, s.model) == ("cuda", False, 0.8, "/m")
    assert s.cache.num_blocks == 0                             # auto: sized by the worker
    assert (w.device, w.cuda_graphs, w.max_num_seqs) == ("cuda:1", True, 64)


def test_cuda_graphs_flag_reads_the_environment(monkeypatch):
    from sarathi.cli import build_parser

    monkeypatch.setenv("SARATHI_CUDA_GRAPHS", "0")
    assert build_parser().parse_args(["worker"]).cuda_graphs is False


def test_auto_block_count_on_cpu_reaches_the_scheduler(tmp_path):
    """num_blocks 0 = auto: the worker decides (2048 on a CPU) and the offline API's scheduler
    uses the worker's figure."""
    from sarathi.llm import LLM
    from shared.config import DEFAULT_CPU_BLOCKS
    from tests.support.engine_helpers import make_tiny_checkpoint

    llm = LLM(str(make_tiny_checkpoint(tmp_path, "llama")), num_blocks=0, dtype="float32")
    assert llm.model_info.num_blocks == DEFAULT_CPU_BLOCKS
    assert llm.executor.cache.num_blocks == DEFAULT_CPU_BLOCKS
    assert llm.engine.scheduler.block_manager.num_blocks == DEFAULT_CPU_BLOCKS


def test_gpu_check_plans_every_step_from_the_bundle(tmp_path, capsys):
    from bench import gpu_check

    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "wheels" / "pyzmq-27-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    args = gpu_check.parse_args(["--bundle", str(bundle), "--rounds", "3"])
    plan = gpu_check.steps(args, python="py")
    assert [s.name for s in plan] == ["install", "environment", "imports", "flashinfer-jit", "baseline",
                                      "tests", "benchmark", "benchmark-torch-ops", "serve", "load", "serve-async"]
    serve_async = next(s for s in plan if s.name == "serve-async").argv({})
    assert "--async-scheduling" in serve_async and "--async-scheduling" not in next(
        s for s in plan if s.name == "serve").argv({})
    install = plan[0].argv({})
    assert {"--no-index", "--no-deps", "--target"} <= set(install) and install[-1].endswith(".whl")
    tests = next(s for s in plan if s.name == "tests").argv({})
    assert tests[tests.index("-m", 2) + 1] == "gpu"
    ctx = {"env": {"copy_tbs": 4.3, "bf16_gemm_tflops": 780.0}}
    bench = next(s for s in plan if s.name == "benchmark").argv(ctx)
    base = next(s for s in plan if s.name == "baseline").argv(ctx)
    assert bench[bench.index("--rounds") + 1] == "3" and bench[bench.index("--hbm-tbs") + 1] == "4.3"
    assert "torch" in base and "--no-cuda-graphs" in base and base[base.index("--dense-tflops") + 1] == "780.0"
    jit = next(s for s in plan if s.name == "flashinfer-jit")
    assert jit.background and jit.cpus == "back" and next(s for s in plan if s.name == "baseline").cpus == "fore"
    # no wheels in the bundle: nothing to install; --skip leaves steps out; unknown names refused
    quick = gpu_check.steps(gpu_check.parse_args(["--bundle", str(tmp_path), "--skip", "serve,load"]))
    assert [s.name for s in quick][:2] == ["environment", "imports"] and "serve" not in {s.name for s in quick}
    with pytest.raises(SystemExit, match="unknown step"):
        gpu_check.steps(gpu_check.parse_args(["--skip", "nope"]))
    assert gpu_check.main(["--dry-run", "--bundle", str(bundle)]) == 0
    assert "pip install -q --no-index" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget", "0"])


def test_gpu_check_keeps_its_budget_and_packs_what_it_reached(tmp_path, monkeypatch):
    """The runner with stand-in steps: a background step beside a foreground one, a step killed
    at its cap, a step skipped for want of time, and an archive after every step."""
    import tarfile

    from bench import gpu_check

    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    py = sys.executable

    def fake_steps(args, python=py):
        def say(text):
            return (lambda ctx: [py, "-c", f"print({text!r})"])
        return [
            gpu_check.Step("environment", say('{"copy_tbs": 4.0}'), "env.json", 30),
            gpu_check.Step("flashinfer-jit", lambda ctx: [py, "-c", "import time; time.sleep(1); print('built')"],
                           "jit.log", 30, background=True, cpus="back"),
            gpu_check.Step("baseline", lambda ctx: [py, "-c", f"print({ctx['env']['copy_tbs']})"], "base.log", 30,
                           cpus="fore"),
            gpu_check.Step("tests", lambda ctx: [py, "-c", "import time; print('started', flush=True); "
                                                          "time.sleep(60)"], "tests.txt", 2, need=1),
            gpu_check.Step("load", say("never"), "load.log", 30, need=1000),
        ]
    monkeypatch.setattr(gpu_check, "steps", fake_steps)
    out = tmp_path / "out"
    t0 = time.monotonic()
    assert gpu_check.main(["--copy-to", str(out), "--budget", "60"]) == 1
    assert time.monotonic() - t0 < 30                       # the 60 s sleep was cut at its 2 s cap
    record = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    status = {s["name"]: s for s in record["steps"]}
    assert status["environment"]["rc"] == 0 and status["baseline"]["rc"] == 0
    assert (tmp_path / "results" / "base.log").read_text().strip() == "4.0"     # the measured rate passed on
    assert status["flashinfer-jit"]["rc"] == 0 and "built" in (tmp_path / "results" / "jit.log").read_text()
    assert status["tests"]["rc"] == 124 and "timed out" in status["tests"]["status"]
    assert status["load"]["rc"] is None and "skipped" in status["load"]["status"]
    assert record["failed"] == ["tests"] and record["skipped"] == ["load"]
    with tarfile.open(out / "gpu_check_results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"gpu_check.json", "env.json", "base.log", "tests.txt"} <= names


@no_cuda
def test_gpu_check_refuses_to_run_without_cuda(capsys):
    from bench import gpu_check

    assert gpu_check.main(["--bundle", "/nonexistent"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_benchmark_runs_end_to_end_on_a_tiny_model(tmp_path):
    """The benchmark's own code (random-init model, cases, bounds, goals, plot, profile) at tiny
    size on the CPU; on a GPU the same code runs Llama-3-8B shapes."""
    from bench import gpu_engine_iteration as g

    out = tmp_path / "tiny"
    result = g.main(["--tiny", "--device", "cpu", "--rounds", "1", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["goals"] == json.loads(json.dumps(result["goals"]))
    assert out.with_suffix(".png").stat().st_size > 0 and Path(f"{out}_profile.txt").is_file()
    pts = {(p["series"], p["size"]) for p in saved["results"]["eager"]}
    assert ("decode", 1) in pts and ("hybrid", 64) in pts and ("prefill", 64) in pts
    assert all(p["median_s"] > 0 and p["bound_s"] > 0 for p in saved["results"]["eager"])


def test_llama3_8b_shapes_and_bounds_match_gpu_md():
    from bench import gpu_engine_iteration as g
    from worker_svc.loader import expected_shapes

    cfg = g.llama3_8b_config()
    params = sum(torch.Size(s).numel() for n, s in expected_shapes(cfg).items() if n != "model.embed_tokens.weight")
    assert abs(params * 2 / 1e9 - 14.4) < 0.1                      # GPU.md: 14.4 GB of weights
    kv_tok = 2 * 32 * 8 * 128 * 2
    assert abs(g.bound_s(cfg, "decode", 1, 1024, False, kv_tok) - 4.75e-3) < 0.1e-3
    assert abs(g.bound_s(cfg, "decode", 128, 1024, False, kv_tok) - 10.5e-3) < 0.3e-3
    assert abs(g.bound_s(cfg, "prefill", 2048, 0, False, kv_tok) - 45e-3) < 3e-3


def test_random_weights_are_deterministic_and_in_the_target_dtype():
    from bench import gpu_engine_iteration as g

    cfg = g.tiny_config()
    a, b = g.random_weights(cfg, torch.bfloat16, "cpu", seed=1), g.random_weights(cfg, torch.bfloat16, "cpu", seed=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert a[name].dtype == torch.bfloat16 and torch.equal(a[name], b[name])
    assert not torch.equal(a[name], a["model.layers.1.self_attn.q_proj.weight"])


def test_gpu_load_point_and_its_calibration_run_on_a_tiny_model(tmp_path):
    """The load point's own code (real engine per policy, the simulator beside it, every batch's
    shapes and seconds recorded) at tiny size on the CPU; then the calibration reads it back and
    recovers a host term it is given: iterations made 2 ms + 10 us a sequence slower than the
    model's GPU terms fit back to those figures."""
    from bench import gpu_load_point, gpu_sim_calibration
    from sarathi.measure.gpu_costmodel import GPUCostModel

    out = tmp_path / "lp"
    result = gpu_load_point.main(["--tiny", "--qps", "20", "--num-requests", "4", "--out", str(out),
                                  "--policies", "sarathi,vllm,sarathi+async"])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert set(saved["policies"]) == {"sarathi", "vllm", "sarathi+async"}
    assert out.with_suffix(".png").stat().st_size > 0
    for name, entry in saved["policies"].items():
        assert entry["real"]["summary"]["finished"] == 4 and entry["simulated"]["summary"]["finished"] == 4
        if name == "sarathi+async":   # launched and finished by the loop: no per-iteration record
            assert entry["real"]["batches"] == [] and entry["real"]["summary"]["iterations"] > 0
        else:
            assert len(entry["real"]["batches"]) == entry["real"]["summary"]["iterations"] > 0
    assert result["policies"]["sarathi"]["cost_model_per_iteration"]["iterations"] > 0
    assert [r["policy"] for r in gpu_sim_calibration.load_runs([out.with_suffix(".json")])] == ["sarathi", "vllm"]
    # a synthetic run whose times are the 8B model's GPU terms + a known host term
    model = GPUCostModel("llama-3-8b", "h200")
    shapes = [[[1000 + i, 1, True] for i in range(n)] + ([[0, 256, False]] if n % 2 else []) for n in range(1, 40)]
    gpu = [model.predict_shapes([tuple(s) for s in b]) - model.cpu_fixed_s - model.cpu_per_seq_s * len(b)
           for b in shapes]
    batches = [[b, g + 2e-3 + 10e-6 * len(b)] for b, g in zip(shapes, gpu)]
    run = tmp_path / "synthetic.json"
    run.write_text(json.dumps({"gpu": "synthetic", "backend": "-", "policies": {
        "sarathi": {"real": {"summary": {}, "batches": batches}}}}))
    cal = gpu_sim_calibration.main([str(run), "--out", str(tmp_path / "cal")])
    fit = cal["runs"]["synthetic:sarathi"]["fitted_host"]
    assert abs(fit["cpu_fixed_s"] - 2e-3) < 1e-5 and abs(fit["cpu_per_seq_s"] - 10e-6) < 1e-7
    assert abs(fit["pred_over_real_p50"] - 1) < 1e-6 and (tmp_path / "cal.png").stat().st_size > 0


def test_calibration_names_runs_apart_when_their_files_share_a_name(tmp_path):
    """Two load points both named gpu_load_point.json (one run's folder each) are two runs, not
    one overwriting the other; a file with a name of its own keeps just its name."""
    from bench.gpu_sim_calibration import load_runs

    run = {"gpu": "g", "backend": "b", "policies": {"sarathi": {"real": {"batches": [[[[1000, 1, True]], 0.01]]}}}}
    paths = []
    for folder, name in (("a", "gpu_load_point"), ("b", "gpu_load_point"), ("b", "other")):
        (tmp_path / folder).mkdir(exist_ok=True)
        paths.append(tmp_path / folder / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    assert [r["label"] for r in load_runs(paths)] == ["a/gpu_load_point:sarathi", "b/gpu_load_point:sarathi",
                                                      "other:sarathi"]
