"""What the gateway's input controls cost: the same gateway before them (a git revision) and with
all of them on (this tree, an API key set), measured in the same run, interleaved.

Each gateway runs in a process of its own with a fake scheduler (tests.support.gateway_fakes) on
the in-process queue, so only the gateway's own work is measured. Per round, on each gateway in
turn: requests/s of tiny non-streamed chat completions (`--concurrency` clients, a 3-token
answer) for `--seconds`, then SSE events/s of streamed chat completions (`--streams` streams of
`--stream-tokens` tokens each). Beside each rate, the gateway process's CPU time per request or
per event (user + system, from /proc): on a shared machine the rates move with the neighbours'
load, the CPU cost much less. The controls on the "after" side: the API key check, bodies
parsed off the event loop after the comma/colon check, the field bounds, tokenization and chat
templates on the bounded pool, control tokens in message text read as text, the SSE send timeout.
Goal: at most 5% fewer requests/s and events/s.

    python -m bench.gateway_overhead [--before REV] [--rounds 3] [--seconds 4]
        [--out bench/results/security/gateway_overhead.json]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import machine_line

KEY = "bench-key"
REPO = Path(__file__).resolve().parent.parent
SERVER = """
import sys
from gateway.app import create_app
from shared.config import ModelInfo
from shared.queue import QueueConfig, make_queues
from tests.support.gateway_fakes import FakeScheduler, Plan, ServerThread, smollm2_tokenizer
tok = smollm2_tokenizer()
gq, sq = make_queues(None, config=QueueConfig(prefix="bench:"), consumer="fake-scheduler")
info = ModelInfo("smol", 4096, tok.vocab_size, tok.eos_token_ids)
long = " ".join(["word"] * 4000)
fake = FakeScheduler(sq, tok, plan=lambda req: Plan("Hi there!" if req.sampling.max_tokens < 16 else long))
kwargs = {"api_key": sys.argv[1]} if len(sys.argv) > 1 else {}
srv = ServerThread(create_app(tok, info, gq, **kwargs))
print(srv.url, flush=True)
sys.stdin.read()
"""
MSGS = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hi to the user, briefly, in English."}]


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k: fields.get(k, "").strip() for k in ("Model name", "CPU family", "Model", "CPU(s)")}


class Gateway:
    """A gateway process from the tree at `root`; api_key: the one it requires (None: none)."""

    def __init__(self, root: Path, api_key: str | None):
        args = [sys.executable, "-c", SERVER] + ([api_key] if api_key else [])
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(args, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            raise RuntimeError(f"the gateway at {root} did not start")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the gateway process has used."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(10)


async def completions_per_s(gw: Gateway, seconds: float, concurrency: int) -> tuple[float, int]:
    body = {"messages": MSGS, "max_tokens": 3}
    done = 0
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=30,
                                 limits=httpx.Limits(max_connections=concurrency)) as c:
        end = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                r = await c.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0), done


async def sse_events_per_s(gw: Gateway, streams: int, tokens: int) -> tuple[float, int]:
    body = {"messages": MSGS, "max_tokens": tokens, "stream": True}
    events = 0
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=60) as c:
        async def stream() -> None:
            nonlocal events
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    events += line.startswith("data:")

        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        return events / (time.perf_counter() - t0), events


def tree_at(rev: str, dest: Path) -> Path:
    """The repository's files at `rev`, extracted under dest."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="1ca070d", help="the revision without the controls")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="per completions measurement")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/security/gateway_overhead.json")
    a = ap.parse_args()
    after_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True).stdout.strip()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="gw-before-") as tmp:
        before = Gateway(tree_at(a.before, Path(tmp)), None)
        after = Gateway(REPO, KEY)
        try:
            for gw in (before, after):   # warm: first-call costs (grammar tokenizer, caches)
                asyncio.run(completions_per_s(gw, 0.5, 2))
            for k in range(a.rounds):
                row = {"round": k}
                order = (before, after) if k % 2 == 0 else (after, before)
                for gw in order:
                    side, cpu0 = "before" if gw is before else "after", gw.cpu_s()
                    rate, n = asyncio.run(completions_per_s(gw, a.seconds, a.concurrency))
                    row[f"{side}_completions_per_s"] = round(rate, 1)
                    row[f"{side}_cpu_ms_per_completion"] = round(1e3 * (gw.cpu_s() - cpu0) / n, 3)
                for gw in order:
                    side, cpu0 = "before" if gw is before else "after", gw.cpu_s()
                    rate, n = asyncio.run(sse_events_per_s(gw, a.streams, a.stream_tokens))
                    row[f"{side}_sse_events_per_s"] = round(rate, 1)
                    row[f"{side}_cpu_us_per_event"] = round(1e6 * (gw.cpu_s() - cpu0) / n, 1)
                print(json.dumps(row), flush=True)
                rounds.append(row)
        finally:
            before.close()
            after.close()

    def summary(metric: str, higher_is_better: bool = True) -> dict:
        """Medians over the rounds. overhead_pct: how much worse the median "after" is than the
        median "before" (negative: better); paired_overhead_pct: the median over rounds of the
        same within each round (neighbours' load moves both sides of a round alike)."""
        def worse(b: float, f: float) -> float:
            return 100 * ((b - f) if higher_is_better else (f - b)) / b

        b = statistics.median(r[f"before_{metric}"] for r in rounds)
        f = statistics.median(r[f"after_{metric}"] for r in rounds)
        paired = statistics.median(worse(r[f"before_{metric}"], r[f"after_{metric}"]) for r in rounds)
        return {"before_median": round(b, 3), "after_median": round(f, 3), "overhead_pct": round(worse(b, f), 1),
                "paired_overhead_pct": round(paired, 1)}

    report = {"command": shlex.join(["python", "-m", "bench.gateway_overhead", *sys.argv[1:]]),
              "machine": machine_line(), "lscpu": lscpu(), "python": platform.python_version(),
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "before_rev": a.before, "after_rev": after_rev,
              "settings": {"rounds": a.rounds, "seconds": a.seconds, "concurrency": a.concurrency,
                           "streams": a.streams, "stream_tokens": a.stream_tokens},
              "summary": {"completions_per_s": summary("completions_per_s"),
                          "cpu_ms_per_completion": summary("cpu_ms_per_completion", False),
                          "sse_events_per_s": summary("sse_events_per_s"),
                          "cpu_us_per_event": summary("cpu_us_per_event", False)},
              "rounds": rounds}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, a.out.with_suffix(".png"))
    print(json.dumps(report["summary"]))


def plot(report: dict, path: Path) -> None:
    """Per round, before vs after: the two rates and the two CPU costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("completions_per_s", "tiny completions / s"), ("cpu_ms_per_completion", "CPU ms / completion"),
               ("sse_events_per_s", "SSE events / s"), ("cpu_us_per_event", "CPU us / SSE event")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    rounds = report["rounds"]
    x = range(len(rounds))
    for ax, (metric, title) in zip(axes, metrics):
        ax.bar([i - 0.2 for i in x], [r[f"before_{metric}"] for r in rounds], 0.4, label="before")
        ax.bar([i + 0.2 for i in x], [r[f"after_{metric}"] for r in rounds], 0.4, label="controls on")
        s = report["summary"][metric]
        ax.set_title(f"{title}\nmedian {s['before_median']:g} -> {s['after_median']:g}", fontsize=9)
        ax.set_xlabel("round")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"gateway overhead, {report['before_rev']} vs {report['after_rev']}: {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
