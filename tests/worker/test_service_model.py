"""The worker service over real ZeroMQ gives the same tokens as the in-process model runner, with
the real default model (SmolLM2): chunked prefills, decodes that carry only diffs, and a seeded
sampled request next to a greedy one in the same batches."""
from __future__ import annotations

import pytest

from scheduler_svc.remote_executor import RemoteExecutor
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams
from tests.support.worker_threads import serving
from worker_svc.service import WorkerServer

pytestmark = pytest.mark.slow

BLOCK = 16
REQUESTS = {  # req_id -> (prompt tokens, sampling, first block id)
    "greedy": (list(range(1000, 1037)), SamplingParams(temperature=0.0), 0),
    "seeded": (list(range(2000, 2021)), SamplingParams(temperature=0.8, top_p=0.9, seed=11), 8),
}


def generate(execute, steps: int = 10, chunk: int = 16) -> dict[str, list[int]]:
    """Drive both requests like a scheduler: prefill in chunks of `chunk` tokens, then decode."""
    state = {r: {"toks": list(p), "done": 0, "out": []} for r, (p, _, _) in REQUESTS.items()}
    for step in range(steps):
        seqs = []
        for r, (prompt, sp, first) in REQUESTS.items():
            st = state[r]
            n = min(chunk, len(st["toks"]) - st["done"])
            end = st["done"] + n
            table = list(range(first, first + -(-end // BLOCK)))
            seqs.append(SeqChunk(r, st["toks"][st["done"]:end], st["done"], table,
                                 end == len(st["toks"]), sp, len(st["out"])))
            st["done"] = end
        out = execute(Batch(step, seqs))
        for r, tok in out.sampled.items():
            state[r]["toks"].append(tok)
            state[r]["out"].append(tok)
    return {r: st["out"] for r, st in state.items()}


@pytest.fixture(scope="module")
def runner():
    from tests.support.engine_helpers import make_executor
    return make_executor(None, num_blocks=32, block_size=BLOCK)


def test_remote_worker_samples_the_same_tokens_as_the_in_process_model_runner(runner, tmp_path):
    local = generate(runner.execute)
    assert all(len(toks) >= 7 for toks in local.values())

    with serving() as run:
        remote = RemoteExecutor(run(WorkerServer(runner, f"ipc://{tmp_path}/worker.sock")), timeout_s=60)
        assert remote.model_info.name == runner.model_info.name
        assert generate(remote.execute) == local
        remote.close()


def _engine_run(executor, info, tag: str, async_scheduling: bool) -> dict[str, list]:
    """Six requests (greedy, seeded sampled, with logprobs; prompts longer than the budget, so
    prefills are chunked next to decodes) through the real scheduler; {name: (tokens, logprobs)}."""
    from scheduler_svc.engine_loop import EngineLoop
    from scheduler_svc.scheduler import Scheduler
    from shared.config import CacheConfig, SchedulerConfig
    sched = Scheduler(SchedulerConfig(token_budget=24, max_model_len=256,
                                      async_scheduling=async_scheduling),
                      CacheConfig(BLOCK, info.num_blocks), info)
    loop = EngineLoop(sched, executor, record=True)
    sps = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=7, logprobs=2, ignore_eos=True)] * 2
    reqs = [loop.add_request(f"{tag}-{i}", list(range(100 + 40 * i, 130 + 41 * i)), sp)
            for i, sp in enumerate(sps)]
    loop.run_until_done()
    planned_ahead = sum(1 for t in loop.trace if t["in_flight"])   # submitted behind another
    assert (planned_ahead > 0) == async_scheduling
    return {r.req_id.split("-")[1]: (r.output_token_ids, r.logprobs) for r in reqs}


def test_async_scheduling_gives_the_same_tokens_in_process_and_over_the_wire(runner, tmp_path):
    """Decodes planned ahead: the in-process runner fills their token from its last output, the
    worker service's mirror from the token it sampled; both give the tokens (and logprobs) of
    the synchronous loop."""
    info = runner.model_info
    want = _engine_run(runner, info, "sync", False)
    assert _engine_run(runner, info, "local", True) == want
    with serving() as run:
        remote = RemoteExecutor(run(WorkerServer(runner, f"ipc://{tmp_path}/worker.sock")), timeout_s=60)
        assert _engine_run(remote, remote.model_info, "remote", True) == want
        remote.close()


def test_async_scheduling_with_ngram_drafts_gives_the_same_greedy_tokens(runner):
    """SmolLM2 in process, both on: a long prompt chunked under a 24-token budget while others
    decode (no room for drafts: planned ahead), then decodes of prompts that repeat themselves
    with n-gram drafts verified (one batch at a time); the greedy tokens equal the run with
    neither, and both happened."""
    from scheduler_svc.engine_loop import EngineLoop
    from scheduler_svc.scheduler import Scheduler
    from shared.config import CacheConfig, SchedulerConfig

    info = runner.model_info
    prompts = [list(range(300 + 30 * i, 320 + 30 * i)) * 3 for i in range(3)] + [list(range(600, 700))]

    def run(tag, asy, spec):
        sched = Scheduler(SchedulerConfig(token_budget=24, max_model_len=256, async_scheduling=asy,
                                          speculative=spec), CacheConfig(BLOCK, info.num_blocks), info)
        loop = EngineLoop(sched, runner, record=True)
        reqs = [loop.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                for i, p in enumerate(prompts)]
        loop.run_until_done()
        ahead = sum(1 for t in loop.trace if t["in_flight"])
        return [r.output_token_ids for r in reqs], ahead, sched.stats().get("spec_proposed_tokens", 0)

    want, _, _ = run("plain", False, "off")
    got, ahead, proposed = run("both", True, "ngram")
    assert got == want and ahead > 0 and proposed > 0
