"""Soak: hours of traffic in minutes' clothing. Starts its own `sarathi serve` (Redis queue, a
private key prefix, a free port), drives it with Poisson arrivals at --qps for --minutes with the
real `openai` client, some clients disconnecting mid-stream and some giving up (aborting)
before the answer, and records every --sample-s seconds: the server's RSS (the serve process
and its worker child), the scheduler's KV blocks, running and waiting requests, and the Redis
keys under the prefix.

It passes when, after the run has drained: the free KV blocks are back to the total, RSS is
flat (mean of the last 5 minutes within --rss-tolerance of the first 5; for runs shorter than
15 minutes, the first and last fifth), no request that ran to its end got an error, and Redis
holds no request entries (stream empty, nothing pending).

    python -m bench.soak [--minutes 30] [--qps 1.0 | auto] [--redis-url URL] [--label NAME]

Writes bench/results/soak/soak[_LABEL].json and .png. Use about 80% of the capacity measured for the
same server options (an overloaded server's queue grows without bound, which is not a leak):
`--qps auto` measures it first on the same server (find_capacity) and soaks at --capacity-fraction.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from bench.common import free_port, machine, rss_mb

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone cloud lamp orange window garden silver engine paper music forest train "
         "coffee mountain letter candle bridge winter ocean").split()



def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for name in ("kv_free_blocks", "kv_total_blocks", "running_requests", "waiting_requests"):
        m = re.search(rf"^sarathi_scheduler_{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def redis_state(r, prefix: str) -> dict:
    keys = sorted(r.scan_iter(match=prefix + "*"))
    req = prefix + "requests"
    state = {"keys": len(keys), "requests_len": r.xlen(req) if r.exists(req) else 0, "pending": 0,
             "stream_entries": {}}
    if r.exists(req):
        try:
            state["pending"] = int(r.xpending(req, "schedulers")["pending"])
        except Exception:  # noqa: BLE001 - no group yet
            pass
    for k in keys:
        if r.type(k) == "stream":
            state["stream_entries"][k[len(prefix):]] = r.xlen(k)
    return state


class Load:
    """Poisson arrivals; each request is one of: complete (stream to the end, or a whole
    answer), disconnect (stream, close after a few tokens) or abort (whole answer, client gives
    up after a short timeout)."""

    def __init__(self, base_url: str, model: str, args):
        self.base_url, self.model, self.args = base_url, model, args
        self.rng = random.Random(args.seed)
        self.counts = {"sent": 0, "completed": 0, "disconnected": 0, "aborted": 0, "errors": 0,
                       "rejected_429": 0}
        self.errors: list[str] = []
        self.tokens = 0
        self.ttfts: list[float] = []      # seconds to the first token, streams that ran to the end

    def prompt(self) -> str:
        n = self.rng.randint(self.args.prompt_words[0], self.args.prompt_words[1])
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    async def one(self, client) -> None:
        import openai

        kind = self.rng.random()
        max_tokens = self.rng.randint(self.args.max_tokens[0], self.args.max_tokens[1])
        body = dict(model=self.model, prompt=self.prompt(), max_tokens=max_tokens, temperature=0.8,
                    extra_body={"ignore_eos": True})  # every completion runs to max_tokens
        self.counts["sent"] += 1
        try:
            if kind < self.args.disconnect_frac:
                stream = await client.completions.create(stream=True, **body)
                stop_after = self.rng.randint(1, max(1, max_tokens // 2))
                seen = 0
                async for ch in stream:
                    seen += 1
                    if seen >= stop_after:
                        break
                await stream.close()
                self.counts["disconnected"] += 1
            elif kind < self.args.disconnect_frac + self.args.abort_frac:
                try:
                    await client.with_options(timeout=self.rng.uniform(0.2, 2.0)).completions.create(**body)
                    self.counts["completed"] += 1
                except openai.APITimeoutError:
                    self.counts["aborted"] += 1
            else:
                t_sent = time.monotonic()
                stream = await client.completions.create(stream=True, **body)
                n, reason, ttft = 0, None, None
                async for ch in stream:
                    if ch.choices:
                        if ttft is None:
                            ttft = time.monotonic() - t_sent
                        n += 1
                        reason = ch.choices[0].finish_reason or reason
                if reason != "length":
                    raise RuntimeError(f"ended with finish_reason {reason!r}")
                self.tokens += n
                self.counts["completed"] += 1
                self.ttfts.append(ttft)
        except openai.RateLimitError:
            self.counts["rejected_429"] += 1
        except Exception as e:  # noqa: BLE001 - every other failure is an error of the server
            self.counts["errors"] += 1
            if len(self.errors) < 20:
                self.errors.append(f"{type(e).__name__}: {e}"[:300])

    async def run(self, seconds: float) -> None:
        import openai

        async with openai.AsyncOpenAI(base_url=self.base_url, api_key="soak", max_retries=0, timeout=300) as c:
            tasks: set[asyncio.Task] = set()
            t_end = time.monotonic() + seconds
            next_at = time.monotonic()
            while time.monotonic() < t_end:
                next_at += self.rng.expovariate(self.args.qps)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                t = asyncio.create_task(self.one(c))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=self.args.drain_timeout)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become ready (server exit code {proc.poll()})")
        time.sleep(0.5)


def window_mean(samples: list[dict], key: str, t0: float, t1: float) -> float:
    xs = [s[key] for s in samples if t0 <= s["t"] < t1]
    return sum(xs) / len(xs) if xs else float("nan")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(2, 2, figsize=(12, 7))
    ax[0, 0].plot(t, [x["rss_mb"] for x in s])
    ax[0, 0].set(title="server RSS (serve + worker), MiB", xlabel="minutes")
    ax[0, 1].plot(t, [x["kv_free_blocks"] for x in s], label="free")
    ax[0, 1].axhline(result["kv_total_blocks"], color="gray", ls="--", label="total")
    ax[0, 1].set(title="KV blocks", xlabel="minutes")
    ax[0, 1].legend()
    ax[1, 0].plot(t, [x["running_requests"] for x in s], label="running")
    ax[1, 0].plot(t, [x["waiting_requests"] for x in s], label="waiting")
    ax[1, 0].set(title="scheduler requests", xlabel="minutes")
    ax[1, 0].legend()
    ax[1, 1].plot(t, [x["redis_keys"] for x in s], label="keys under prefix")
    ax[1, 1].plot(t, [x["redis_requests_len"] for x in s], label="requests stream length")
    ax[1, 1].set(title="Redis", xlabel="minutes")
    ax[1, 1].legend()
    v = result["verdict"]
    cap = result.get("capacity")
    cap_txt = f" ({result['args']['capacity_fraction']:.0%} of a measured {cap['capacity_qps']} QPS)" if cap else ""
    fig.suptitle(f"soak {result['label']}: {result['minutes']:g} min at {result['qps']} QPS{cap_txt}; "
                 f"{result['counts']['completed']} completed, {result['counts']['disconnected']} disconnected, "
                 f"{result['counts']['aborted']} aborted, {result['counts']['errors']} errors; "
                 f"pass={v['pass']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def wait_idle(base: str, timeout: float) -> bool:
    """Until the scheduler runs and queues nothing and every KV block is free (True), or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(base + "/metrics")
        if m["running_requests"] == 0 and m["waiting_requests"] == 0 and m["kv_free_blocks"] == m["kv_total_blocks"]:
            return True
        time.sleep(0.5)
    return False


def probe(base: str, model: str, args, qps: float) -> dict:
    """--probe-s seconds of the soak's prompts at `qps`, every client staying to the end (no
    disconnects or aborts), then up to --probe-s more to finish. Passes when every request
    completed without error and the median TTFT is within --ttft-p50-bound: a server past its
    capacity queues, and its TTFT grows with the queue."""
    pa = argparse.Namespace(**{**vars(args), "qps": qps, "disconnect_frac": 0.0, "abort_frac": 0.0,
                               "drain_timeout": args.probe_s, "seed": args.seed + int(qps * 1000)})
    load = Load(base + "/v1", model, pa)
    t0 = time.monotonic()
    asyncio.run(load.run(args.probe_s))
    wall = time.monotonic() - t0
    ttfts = sorted(t for t in load.ttfts if t is not None)

    def pct(f: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(f * len(ttfts)))] if ttfts else float("inf")

    c = load.counts
    # errors here include streams still open when the probe stopped waiting (cancelled by the client)
    row = {"qps": qps, "sent": c["sent"], "completed": c["completed"], "errors_or_unfinished": c["errors"],
           "ttft_p50_s": round(pct(0.5), 3), "ttft_p90_s": round(pct(0.9), 3),
           "tokens_per_s": round(load.tokens / wall, 2), "wall_s": round(wall, 1),
           "passed": c["errors"] == 0 and c["completed"] == c["sent"] and pct(0.5) <= args.ttft_p50_bound}
    print(f"probe {qps:.3f} QPS: {row}", flush=True)
    if not wait_idle(base, 300):
        raise RuntimeError("the server did not go idle after a capacity probe")
    return row


def find_capacity(base: str, model: str, args) -> dict:
    """The highest QPS of this workload the server sustains (see probe): QPS doubles from
    --probe-start until a probe fails, then --probe-bisect bisection steps between the last
    pass and the first failure. Returns the probes and the capacity (0 if the first fails)."""
    rows, lo, hi, q = [], 0.0, None, args.probe_start
    while hi is None and q <= 64:
        rows.append(probe(base, model, args, q))
        if rows[-1]["passed"]:
            lo, q = q, 2 * q
        else:
            hi = q
    for _ in range(args.probe_bisect if hi is not None else 0):
        q = round((lo + hi) / 2, 3)
        rows.append(probe(base, model, args, q))
        lo, hi = (q, hi) if rows[-1]["passed"] else (lo, q)
    return {"capacity_qps": lo, "first_failing_qps": hi, "probe_s": args.probe_s,
            "criterion": f"every request completes, no error, median TTFT <= {args.ttft_p50_bound} s",
            "probes": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--qps", default="1.0",
                    help="Poisson arrival rate, or 'auto': first measure this server's capacity for this "
                         "workload (find_capacity), then soak at --capacity-fraction of it")
    ap.add_argument("--capacity-fraction", type=float, default=0.8)
    ap.add_argument("--probe-s", type=float, default=60.0, help="seconds of arrivals per capacity probe")
    ap.add_argument("--probe-start", type=float, default=0.25, help="first QPS probed (doubled until it fails)")
    ap.add_argument("--probe-bisect", type=int, default=2, help="bisection steps after the first failure")
    ap.add_argument("--ttft-p50-bound", type=float, default=2.0,
                    help="a probe passes when every request completes and the median TTFT is within this (s)")
    ap.add_argument("--prompt-words", type=int, nargs=2, default=[10, 100])
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--disconnect-frac", type=float, default=0.1, help="clients that leave mid-stream")
    ap.add_argument("--abort-frac", type=float, default=0.05, help="clients that give up before the answer")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--drain-timeout", type=float, default=300.0, help="seconds to wait for the last requests")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth, fraction")
    ap.add_argument("--redis-url", default=None, help="default: a private redis-server on a free port")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="suffix of the result files (e.g. short_validation)")
    ap.add_argument("--out-dir", default="bench/results/soak")
    args = ap.parse_args(argv)
    if args.qps != "auto":
        args.qps = float(args.qps)

    import redis

    started = datetime.datetime.now(datetime.timezone.utc)
    machine_info = machine()  # loadavg at the start
    redis_proc = None
    redis_url = args.redis_url
    if redis_url is None:
        if shutil.which("redis-server") is None:
            sys.exit("no --redis-url and no redis-server to start")
        rport = free_port()
        redis_proc = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{rport}/0"
        time.sleep(0.5)
    prefix = f"soak:{uuid.uuid4().hex[:8]}:"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARATHI_")}
    env.update(PYTHONUNBUFFERED="1", SARATHI_PORT=str(port), SARATHI_REDIS_URL=redis_url,
               SARATHI_QUEUE_PREFIX=prefix, SARATHI_NUM_BLOCKS=str(args.num_blocks),
               SARATHI_THREADS=str(args.threads))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "soak" + (f"_{args.label}" if args.label else "")
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sarathi-{stem}-{prefix.split(':')[1]}.server.log"
    server_cmd = [sys.executable, "-m", "sarathi.cli", "serve"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(server_cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        wait_http(base + "/ready", proc)
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        capacity = None
        if args.qps == "auto":
            capacity = find_capacity(base, model, args)
            args.qps = round(args.capacity_fraction * capacity["capacity_qps"], 3)
            print(f"capacity {capacity['capacity_qps']} QPS -> soak at {args.qps} QPS", flush=True)
        load = Load(base + "/v1", model, args)
        samples: list[dict] = []
        t0 = time.monotonic()
        seconds = args.minutes * 60

        async def sampler(stop: asyncio.Event):
            while not stop.is_set():
                m = await asyncio.to_thread(scrape, base + "/metrics")
                rs = await asyncio.to_thread(redis_state, r, prefix)
                samples.append({"t": time.monotonic() - t0, "rss_mb": rss_mb(proc.pid), **m,
                                "redis_keys": rs["keys"], "redis_requests_len": rs["requests_len"],
                                "redis_pending": rs["pending"], **{k: v for k, v in load.counts.items()}})
                last = samples[-1]
                print(f"[{last['t'] / 60:5.1f} min] rss {last['rss_mb']:.0f} MiB, kv free "
                      f"{last['kv_free_blocks']:.0f}/{last['kv_total_blocks']:.0f}, running "
                      f"{last['running_requests']:.0f}, waiting {last['waiting_requests']:.0f}, "
                      f"{load.counts}", flush=True)
                try:
                    await asyncio.wait_for(stop.wait(), args.sample_s)
                except TimeoutError:
                    pass

        async def run():
            stop = asyncio.Event()
            s = asyncio.create_task(sampler(stop))
            await load.run(seconds)
            # drained: nothing running or waiting (at most --drain-timeout seconds)
            deadline = time.monotonic() + args.drain_timeout
            while time.monotonic() < deadline:
                m = await asyncio.to_thread(scrape, base + "/metrics")
                if m["running_requests"] == 0 and m["waiting_requests"] == 0 and \
                        m["kv_free_blocks"] == m["kv_total_blocks"]:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(2 * args.sample_s)  # a few idle samples after the load
            stop.set()
            await s

        asyncio.run(run())
        final = scrape(base + "/metrics")
        final_redis = redis_state(r, prefix)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        try:
            for k in r.scan_iter(match=prefix + "*"):
                r.delete(k)
        except redis.RedisError as e:
            print(f"could not clean up the Redis keys under {prefix}: {e}", file=sys.stderr)
        if redis_proc is not None:
            redis_proc.kill()

    total_s = samples[-1]["t"] if samples else 0
    window = 300.0 if args.minutes >= 15 else args.minutes * 60 / 5
    load_end = args.minutes * 60
    rss_first = window_mean(samples, "rss_mb", 0, window)
    rss_last = window_mean(samples, "rss_mb", load_end - window, load_end)
    verdict = {
        "kv_blocks_back": final["kv_free_blocks"] == final["kv_total_blocks"],
        "rss_flat": rss_last <= rss_first * (1 + args.rss_tolerance),
        "no_errors": load.counts["errors"] == 0,
        "no_redis_leak": final_redis["requests_len"] == 0 and final_redis["pending"] == 0,
    }
    verdict["pass"] = all(verdict.values())
    result = {
        "label": args.label or "full", "command": " ".join(shlex.quote(a) for a in ["python", "-m", "bench.soak"]
                                                          + (argv if argv is not None else sys.argv[1:])),
        "server_command": "sarathi serve (env: " + ", ".join(f"{k}={env[k]}" for k in sorted(env)
                                                          if k.startswith("SARATHI_")) + ")",
        "date_utc": started.isoformat(timespec="seconds"), "machine": machine_info,
        "loadavg_end": os.getloadavg(), "server_log": log_path.name, "minutes": args.minutes, "qps": args.qps,
        "args": vars(args), "counts": load.counts, "error_samples": load.errors,
        "completion_tokens_completed": load.tokens,
        "kv_total_blocks": final["kv_total_blocks"], "kv_free_blocks_after": final["kv_free_blocks"],
        "rss_window_s": window, "rss_first_mb": rss_first, "rss_last_mb": rss_last,
        "redis_after": final_redis, "duration_s": total_s, "verdict": verdict,
        "capacity": capacity, "samples": samples,
    }
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result, indent=1))
    plot(result, png_path)
    print(json.dumps({k: result[k] for k in ("counts", "kv_total_blocks", "kv_free_blocks_after", "rss_first_mb",
                                             "rss_last_mb", "redis_after", "verdict")}, indent=1))
    print(f"wrote {json_path} and {png_path}")
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
