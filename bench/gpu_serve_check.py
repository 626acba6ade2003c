"""End to end on a GPU: `sarathi serve --device cuda` answering the `openai` client.

    python -m bench.gpu_serve_check --model-files .gpu_bundle/model [--out bench/results/gpu/gpu_serve_check]
        [--async-scheduling]

The model: the default model's tokenizer, vocabulary, layer count and widths (the files
bench.gpu_bundle writes from its GGUF) with random bf16 weights made here, at attention head_dim
128 (6 query / 2 KV heads) instead of SmolLM2's 64, so the FlashInfer kernels compiled for the GPU
tests and the 8B benchmark serve it too (each head size is its own ~2 min JIT build). Random
weights make random text: the checks are about the serving path, not the words.

Checks, each recorded in <out>.json with pass/fail:
- /v1/models lists the model; the worker's backend line names FlashInfer and CUDA graphs;
- a greedy chat completion, not streamed, and the same request streamed: the streamed deltas
  join to the same text (one engine, two delivery paths);
- 32 concurrent streamed completions all finish with their max_tokens (ignore_eos): the hybrid
  batches under load; TTFT and inter-token gaps as the client sees them;
- structured outputs: guided_choice, a regex, and a JSON schema with an enum answer valid.
Exit status 1 if any check fails. --async-scheduling serves with it (bench.gpu_check runs both).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIM, HEADS, KV_HEADS = 128, 6, 2


def make_model(files: Path, dest: Path, seed: int = 0) -> Path:
    """files' config + tokenizer, attention resized (module docstring), random bf16 weights."""
    import torch
    from safetensors.torch import save_file

    from worker_svc.loader import expected_shapes
    from worker_svc.model_config import ModelConfig

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(files / name, dest / name)
    hf = json.loads((files / "config.json").read_text())
    hf.update(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    (dest / "config.json").write_text(json.dumps(hf, indent=1))
    cfg = ModelConfig.from_hf(hf)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sarathi serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"sarathi serve not ready after {timeout_s:.0f} s")


async def concurrent_streams(base: str, model: str, n: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> dict:
        t0 = time.perf_counter()
        times, text, finish = [], [], None
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: tell a long story about the number {i}.", max_tokens=max_tokens,
            temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
        async for ev in stream:
            if ev.choices and ev.choices[0].text:
                times.append(time.perf_counter())
                text.append(ev.choices[0].text)
            if ev.choices and ev.choices[0].finish_reason:
                finish = ev.choices[0].finish_reason
        return {"ttft_s": times[0] - t0 if times else None,
                "gaps_s": [b - a for a, b in zip(times, times[1:])], "finish": finish, "events": len(times)}

    t0 = time.perf_counter()
    rs = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    gaps = sorted(g for r in rs for g in r["gaps_s"])
    ttfts = sorted(r["ttft_s"] for r in rs if r["ttft_s"] is not None)
    def q(xs, p):
        return (xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None)
    return {"requests": n, "max_tokens": max_tokens, "wall_s": wall,
            "finished_length": sum(r["finish"] == "length" for r in rs),
            "ttft_p50_s": q(ttfts, 0.5), "ttft_max_s": ttfts[-1] if ttfts else None,
            "gap_p50_s": q(gaps, 0.5), "gap_p99_s": q(gaps, 0.99), "gap_max_s": gaps[-1] if gaps else None,
            "stream_events": sum(r["events"] for r in rs)}


def run_checks(base: str, log_text) -> dict:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    checks: dict[str, dict] = {}

    def check(name: str, ok: bool, **detail) -> None:
        checks[name] = {"ok": bool(ok), **detail}
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {json.dumps(detail)[:300]}", flush=True)

    models = [m.id for m in client.models.list().data]
    check("models_listed", len(models) == 1, models=models)
    model = models[0]
    backend = [ln for ln in log_text().splitlines() if "worker backend" in ln]
    check("backend_is_flashinfer_with_graphs",
          any("attention flashinfer" in ln and "CUDA graphs on" in ln for ln in backend), lines=backend[-2:])

    msgs = [{"role": "user", "content": "Name three colors."}]
    t0 = time.perf_counter()
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    latency = time.perf_counter() - t0
    text = full.choices[0].message.content
    check("chat_greedy", full.usage.completion_tokens > 0 and text is not None,
          completion_tokens=full.usage.completion_tokens, finish=full.choices[0].finish_reason,
          latency_s=round(latency, 3), text=text)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=24, temperature=0, stream=True) if c.choices]
    check("stream_equals_non_stream", "".join(parts) == text, streamed_chunks=len(parts))

    load = asyncio.run(concurrent_streams(base, model, 32, 64))
    check("concurrent_streams_finish", load["finished_length"] == 32, **load)

    r = client.completions.create(model=model, prompt="Is the sky green? Answer:", max_tokens=8,
                                  extra_body={"guided_choice": ["yes", "no"]})
    check("guided_choice", r.choices[0].text in ("yes", "no"), text=r.choices[0].text)
    r = client.completions.create(model=model, prompt="A year:", max_tokens=8, temperature=1.0,
                                  extra_body={"guided_regex": r"(19|20)[0-9][0-9]"})
    year = r.choices[0].text or ""
    check("guided_regex", re.fullmatch(r"(19|20)[0-9][0-9]", year) is not None, text=year)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick a color as JSON."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    try:
        parsed = json.loads(content)
        valid = parsed.get("answer") in ("red", "green", "blue") and set(parsed) == {"answer"}
    except (TypeError, ValueError, AttributeError):
        valid = False
    check("json_schema", finish == "stop" and valid, content=content, finish=finish)
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-files", type=Path, default=ROOT / ".gpu_bundle" / "model")
    ap.add_argument("--out", default="bench/results/gpu/gpu_serve_check")
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="serve with --async-scheduling (the worker launches each batch behind the running one)")
    args = ap.parse_args(argv)
    from bench.gpu_engine_iteration import gpu_info

    tmp = Path(tempfile.mkdtemp(prefix="gpu-serve-"))
    t0 = time.perf_counter()
    model_dir = make_model(args.model_files, tmp / "smollm2-shape-hd128")
    made_s = time.perf_counter() - t0
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp / "serve.log"
    cmd = [sys.executable, "-m", "sarathi.cli", "serve", "--model", str(model_dir), "--device", args.device,
           "--port", str(port), "--gpu-memory-utilization", "0.4", "--max-num-seqs", "64"]
    if args.async_scheduling:
        cmd.append("--async-scheduling")
    print("$ " + " ".join(cmd), flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ,
                                start_new_session=True)
    result = {"command": "python -m bench.gpu_serve_check " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": gpu_info(), "serve_command": " ".join(cmd[1:]),
              "model": f"SmolLM2-135M-Instruct's tokenizer and config, head_dim {HEAD_DIM} ({HEADS} q / "
                       f"{KV_HEADS} kv heads), random bf16 weights", "model_made_s": round(made_s, 2)}
    rc = 1
    try:
        t1 = time.perf_counter()
        wait_ready(base, proc, args.ready_timeout)
        result["ready_s"] = round(time.perf_counter() - t1, 2)
        checks = run_checks(base, log_path.read_text)
        result["checks"] = checks
        result["passed"] = all(c["ok"] for c in checks.values())
        rc = 0 if result["passed"] else 1
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        print("gpu_serve_check:", result["error"], file=sys.stderr)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
        tail = log_path.read_text().splitlines()[-60:]
        result["serve_log_tail"] = tail
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        # temporary folders (the model's, the workers' sockets) named as <tmp>: the record names no
        # path of the machine it ran on
        temp = re.escape(tempfile.gettempdir()) + r"/[\w.-]+"
        out.with_suffix(".json").write_text(re.sub(temp, "<tmp>", json.dumps(result, indent=1)))
        shutil.copy2(log_path, f"{out}_server.log")
        shutil.rmtree(tmp, ignore_errors=True)
    if "checks" in result:
        gaps = result["checks"].get("concurrent_streams_finish", {})
        if gaps.get("gap_p50_s") is not None:
            print(f"32 streams: TTFT P50 {gaps['ttft_p50_s']:.3f} s, gap P50 {gaps['gap_p50_s'] * 1e3:.1f} ms, "
                  f"P99 {gaps['gap_p99_s'] * 1e3:.1f} ms", flush=True)
    print("gpu_serve_check:", "passed" if rc == 0 else "FAILED", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
