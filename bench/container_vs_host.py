"""The container image against `sarathi serve` from the checkout, on the same machine, in turn.

Both serve the default model with the same threads; they are measured one after the other
(ABBA rounds), the other idle:
* the decode step: a greedy completion of 128 tokens and one of 1 token, timed from the client;
  (t_128 - t_1) / 127 is the time a generated token costs at batch 1;
* a short `sarathi bench --url` run (ShareGPT-like lengths at a low rate): TTFT and TBT P50/P99.
The container runs as the image says (non-root, no compiler) under a read-only root filesystem
with a tmpfs on /tmp; its backend line (the kernel variant) is recorded from its log.

    python -m bench.container_vs_host [--image sarathi-serve:0.1.0] [--rounds 4] [--threads 2]
                                      [--requests 12] [--qps 0.5] [--out bench/results/deploy/container_vs_host]
Needs dockerd and the image (deploy/compose_check.sh builds it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.gguf_kernels import cpu_id

KEY = "bench-key"
MODEL = "SmolLM2-135M-Instruct"   # the served name of the default model
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def wait_ready(url: str, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                               headers={"authorization": f"Bearer {KEY}"}, timeout=60)
                if r.status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def completion_s(url: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=120, headers={"authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == max_tokens, r.json()["usage"]
    return time.perf_counter() - t0


def bench_run(url: str, requests: int, qps: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        subprocess.run([sys.executable, "-m", "sarathi.cli", "bench", "--url", url, "--api-key", KEY,
                        "--num-requests", str(requests), "--qps", str(qps), "--out", str(out), "--no-progress",
                        "--seed", "1"], check=True, capture_output=True, text=True, timeout=900)
        return json.loads(out.read_text())["runs"][0]["summary"]


def backend_lines(text: str) -> list[str]:
    """The workers' backend lines (which kernels run) in a log."""
    return sorted({ln[ln.index("device cpu"):] for ln in text.splitlines() if "device cpu" in ln})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="sarathi-serve:0.1.0")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--out", default="bench/results/deploy/container_vs_host")
    a = ap.parse_args(argv)
    ports = {"container": 8101, "host": 8102}
    name = f"sarathi-cvh-{os.getpid()}"
    env = {**os.environ, "SARATHI_API_KEY": KEY}
    subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--read-only", "--tmpfs", "/tmp",
                    "-e", f"SARATHI_API_KEY={KEY}", "-p", f"127.0.0.1:{ports['container']}:8000", a.image,
                    "serve", "--host", "0.0.0.0", "--port", "8000", "--threads", str(a.threads)], check=True)
    log = open(tempfile.mktemp(suffix=".log"), "w+")
    host = subprocess.Popen([sys.executable, "-m", "sarathi.cli", "serve", "--port", str(ports["host"]),
                             "--threads", str(a.threads)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
        for u in urls.values():
            wait_ready(u)
        res: dict = {k: {"step_ms": [], "t128_s": [], "bench": []} for k in urls}
        for r in range(a.rounds):
            order = list(urls) if r % 2 == 0 else list(urls)[::-1]
            for k in order:
                t1 = min(completion_s(urls[k], 1) for _ in range(3))
                t128 = completion_s(urls[k], 128)
                res[k]["t128_s"].append(t128)
                res[k]["step_ms"].append(1e3 * (t128 - t1) / 127)
                res[k]["bench"].append(bench_run(urls[k], a.requests, a.qps))
                print(f"round {r + 1} {k}: step {res[k]['step_ms'][-1]:.2f} ms, TBT P50 "
                      f"{1e3 * res[k]['bench'][-1]['tbt_p50_s']:.2f} ms", file=sys.stderr, flush=True)
        c = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
        log.seek(0)
        backends = {"container": backend_lines(c.stdout + c.stderr), "host": backend_lines(log.read())}
    finally:
        host.terminate()
        host.wait(30)
        subprocess.run(["docker", "stop", name], capture_output=True)
    summary = {}
    for k, d in res.items():
        summary[k] = {"step_ms_median": round(statistics.median(d["step_ms"]), 3),
                      "t128_s_median": round(statistics.median(d["t128_s"]), 3),
                      **{f"{m}_median_ms": round(1e3 * statistics.median(b[m] for b in d["bench"]), 2)
                         for m in ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s")}}
    ratios = {m: round(summary["container"][m] / summary["host"][m], 3) for m in summary["host"]}
    size = subprocess.run(["docker", "image", "inspect", a.image, "--format", "{{.Size}}"], capture_output=True,
                          text=True).stdout.strip()
    out = {"command": "python -m bench.container_vs_host " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": cpu_id(),
           "image": a.image, "image_mb": int(size) // 2**20 if size.isdigit() else None,
           "container_flags": "--read-only --tmpfs /tmp (user 10001, no compiler)", "backends": backends,
           "summary": summary, "container_over_host": ratios, "raw": res}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"summary": summary, "container_over_host": ratios, "backends": backends}, indent=2))


if __name__ == "__main__":
    main()
