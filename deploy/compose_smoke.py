"""What a user does first against a running stack, through the real `openai` client: list the
models, one chat completion, one streamed, and read the scheduler's metrics. Prints one JSON
object; exits non-zero on the first failure.

    python deploy/compose_smoke.py [--url http://127.0.0.1:8000] [--metrics http://127.0.0.1:9100]
        [--wait 600]

The gateway's API key comes from SARATHI_API_KEY (as the stack was started with); a request
without it must be refused (401).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from openai import OpenAI


def wait_ready(url: str, timeout_s: float) -> float:
    """Seconds until GET url answers 200 (the gateway's /ready: a scheduler with its worker answers)."""
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")
        time.sleep(2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics", default="http://127.0.0.1:9100")
    ap.add_argument("--wait", type=float, default=600.0)
    ap.add_argument("--expect-handoffs", action="store_true",
                    help="a prefill/decode stack with --disaggregation all: both requests moved their KV")
    a = ap.parse_args()
    out: dict = {"url": a.url}
    out["ready_s"] = round(wait_ready(f"{a.url}/ready", a.wait), 1)
    key = os.environ.get("SARATHI_API_KEY") or "none"
    try:
        urllib.request.urlopen(f"{a.url}/v1/models", timeout=10)
        out["without_key"] = 200
    except urllib.error.HTTPError as e:
        out["without_key"] = e.code
    assert out["without_key"] == 401, f"a request without the API key got {out['without_key']}"
    client = OpenAI(base_url=f"{a.url}/v1", api_key=key, timeout=300)
    out["models"] = [m.id for m in client.models.list().data]
    model = out["models"][0]
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    t0 = time.monotonic()
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    out["chat"] = {"text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason,
                   "usage": r.usage.model_dump(), "seconds": round(time.monotonic() - t0, 2)}
    assert r.choices[0].message.content and r.usage.completion_tokens > 0, out["chat"]
    t0, chunks, ttft = time.monotonic(), [], None
    for ev in client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0,
                                             stream=True):
        if ev.choices and ev.choices[0].delta.content:
            ttft = ttft or time.monotonic() - t0
            chunks.append(ev.choices[0].delta.content)
    out["stream"] = {"text": "".join(chunks), "chunks": len(chunks), "ttft_s": round(ttft or -1, 2),
                     "seconds": round(time.monotonic() - t0, 2)}
    # greedy: the streamed answer is the same text as the whole one
    assert out["stream"]["text"] == out["chat"]["text"], (out["stream"], out["chat"])
    with urllib.request.urlopen(f"{a.metrics}/metrics", timeout=10) as m:
        text = m.read().decode()
    out["scheduler_metrics_lines"] = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    assert out["scheduler_metrics_lines"] > 0
    # a prefill/decode stack: how many requests were handed off, and the pools' roles
    handoffs = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("sarathi_scheduler_kv_transfer_seconds_count")]
    roles = sorted({line.split('role="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                    if line.startswith("sarathi_scheduler_pool_up{") and 'role="' in line})
    if handoffs or roles:
        out["kv_handoffs"], out["pool_roles"] = sum(handoffs), roles
    if a.expect_handoffs:
        assert out.get("kv_handoffs", 0) >= 2, f"expected the two requests handed off: {out}"
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
