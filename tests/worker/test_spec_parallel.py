"""Speculative decoding on a tensor x pipeline parallel replica (`sarathi worker --tp 2 --pp 2`,
one process per rank, gloo): drafts are verified by the last stage's TP ranks (TP rank 0's
result kept), the earlier stage gets the chunks after accepted drafts in full, and the greedy
tokens are the single-rank run's without drafts. A random tiny model never repeats itself, so
the drafts come from a test proposer that knows the answer and spoils its last guess: drafts
are both accepted and rejected."""
from __future__ import annotations

import pytest
import torch

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.support.engine_helpers import make_executor, make_tiny_checkpoint, use_threads
from tests.support.parallel_helpers import BS, Replica

pytestmark = pytest.mark.slow
NUM_BLOCKS = 64


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (30, 20)]


class Oracle:
    """Proposes the reference continuation, the last of its k drafts wrong."""

    name = "oracle"

    def __init__(self, answers: dict[str, list[int]]):
        self.answers = answers

    def propose(self, req, k: int) -> list[int]:
        drafts = list(self.answers[req.req_id][req.num_output_tokens:req.num_output_tokens + k])
        if len(drafts) > 1:
            drafts[-1] = 2 + (drafts[-1] + 1) % 250
        return drafts


def run(executor, info, speculative: str, depth: int, answers=None):
    cfg = SchedulerConfig(token_budget=64, max_num_seqs=8, max_model_len=info.max_model_len,
                          speculative=speculative, num_speculative_tokens=4)
    sched = Scheduler(cfg, CacheConfig(BS, NUM_BLOCKS), info)
    if sched.speculator is not None:     # timings of 4 gloo ranks on a loaded machine: fixed cost
        sched.speculator.cost, sched.speculator.observe_batch = 0.05, lambda *args: None
        sched.speculator.proposer = Oracle(answers)
    for i, p in enumerate(prompts()):
        sched.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    reqs = [sched.requests[f"r{i}"] for i in range(len(prompts()))]
    EngineLoop(sched, executor, depth).run_until_done()
    return [r.output_token_ids for r in reqs], sched.stats()


def test_tp2_pp2_replica_with_drafts_gives_the_single_rank_tokens(tmp_path):
    tiny = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    ex = make_executor(tiny, num_blocks=NUM_BLOCKS, block_size=BS)
    want, _ = run(ex, ex.model_info, "off", 2)
    answers = {f"r{i}": w for i, w in enumerate(want)}
    local, st_local = run(ex, ex.model_info, "ngram", 2, answers)     # the same, in process
    assert local == want and st_local["spec_accepted_tokens"] > 0
    rep = Replica(tmp_path, str(tiny), 2, 2, NUM_BLOCKS)
    try:
        got, st = run(rep.remote, rep.remote.model_info, "ngram", 2, answers)
    finally:
        rep.close()
    assert got == want
    assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
