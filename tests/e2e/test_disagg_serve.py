"""`sarathi serve` with worker pools, as real processes on the real SmolLM2: two colocated mixed
workers (--workers 2) and prefill/decode disaggregation (--prefill-workers 1 --decode-workers 1
--disaggregation all). Greedy output is the same in both (the KV bytes moved are the bytes
computed); a killed decode worker costs a recompute, not a request; every pool's blocks come back."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import openai
import pytest

from shared.model_source import resolve_model
from tests.support.e2e_stack import EmbeddedStack, get
from tests.support.redis_fixture import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = resolve_model(None).name
PROMPTS = [f"Story {i}: once upon a time, in a land far away, there lived a" for i in range(4)] + [
    "The capital of France is", "List three colors: red,"]
TOKENS = 12


async def _complete(base_url: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    c = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    outs = await asyncio.gather(*[c.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                                       temperature=0.0) for p in prompts])
    await c.close()
    return {p: o.choices[0].text for p, o in zip(prompts, outs)}


def _stats(port: int) -> dict:
    return json.loads(get(f"http://127.0.0.1:{port}/stats")[1])


def _pools_free(port: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pools = _stats(port)["pools"]
        if all(p["num_free_blocks"] == p["num_total_blocks"] and p["reserved"] == 0 for p in pools):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    port = free_port()
    s = EmbeddedStack(tmp_path_factory.mktemp("coloc"), workers=2, threads=1, scheduler_port=port)
    try:
        out = asyncio.run(_complete(s.base_url, PROMPTS, TOKENS))
        pools = _stats(port)["pools"]
        assert [p["role"] for p in pools] == ["mixed", "mixed"]
        assert all(p["num_finished"] > 0 for p in pools)      # the router used both workers
        yield out
    finally:
        s.close()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    port = free_port()
    s = EmbeddedStack(tmp_path_factory.mktemp("pd"), prefill_workers=1, decode_workers=1,
                      disaggregation="all", threads=1, scheduler_port=port, worker_restart_timeout=60)
    s.stats_port = port
    try:
        yield s
    finally:
        s.close()


def test_greedy_output_with_disaggregation_all_equals_two_colocated_workers(pd, colocated):
    before = len(_stats(pd.stats_port)["kv_transfers"])
    assert asyncio.run(_complete(pd.base_url, PROMPTS, TOKENS)) == colocated
    st = _stats(pd.stats_port)
    moved = st["kv_transfers"][before:]
    assert len(moved) == len(PROMPTS) and all(t["kv_bytes"] > 0 and t["kv_transfer_s"] > 0 for t in moved)
    assert _pools_free(pd.stats_port)


def test_a_killed_decode_worker_costs_a_recompute_and_leaks_no_block(pd, colocated):
    log = pd.logs[0].read_text()
    decode_pid = int(re.findall(r"worker process started \(pid (\d+)\) as decode", log)[-1])
    prompts = [f"Tale {i}: long ago, a traveller came to a quiet village and" for i in range(6)]

    async def run():
        task = asyncio.create_task(_complete(pd.base_url, prompts, 48))
        deadline = time.monotonic() + 120
        while _stats(pd.stats_port)["num_handoffs"] < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        os.kill(decode_pid, signal.SIGKILL)     # while it decodes handed-off requests
        return await task

    out = asyncio.run(run())
    assert all(len(t) > 0 for t in out.values())
    st = _stats(pd.stats_port)
    assert st["num_pools_lost"] >= 1
    assert _pools_free(pd.stats_port, timeout=60)
    # the restarted decode worker takes handoffs again
    assert asyncio.run(_complete(pd.base_url, PROMPTS[:2], TOKENS)) == {p: colocated[p] for p in PROMPTS[:2]}
