"""Speculative decoding across the real worker service (ZeroMQ, the wire's diffs) with the real
default model: the scheduler's drafts reach the worker, its accepted drafts come back, and the
greedy output equals the in-process run without drafts."""
from __future__ import annotations

import pytest

from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.remote_executor import RemoteExecutor
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.sampling import SamplingParams
from tests.support.worker_threads import serving
from worker_svc.service import WorkerServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner():
    from sarathi import LLM
    return LLM(num_blocks=64, threads=1).executor


def engine(executor, info, speculative):
    cfg = SchedulerConfig(speculative=speculative, num_speculative_tokens=5,
                          max_model_len=info.max_model_len)
    return EngineLoop(Scheduler(cfg, CacheConfig(info.block_size, info.num_blocks), info), executor)


def test_remote_drafts_give_the_output_of_a_local_run_without_them(runner, tmp_path):
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    from tests.worker.test_spec_smollm2 import CONVERSATIONS, fixed_cost
    prompts = [tok.encode_chat(CONVERSATIONS[0]),
               tok.encode_chat([{"role": "user", "content": "Name three colors."}])]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    local = [o.output_token_ids for o in engine(runner, runner.model_info, "off").generate(prompts, params)]

    with serving() as run:
        remote = RemoteExecutor(run(WorkerServer(runner, f"ipc://{tmp_path}/worker.sock")), timeout_s=60)
        loop = fixed_cost(engine(remote, remote.model_info, "ngram"))
        got = [o.output_token_ids for o in loop.generate(prompts, params)]
        st = loop.stats()
        remote.close()
    assert got == local
    assert st["spec_accepted_tokens"] >= 10
