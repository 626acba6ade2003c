"""EngineLoop: schedule -> submit (up to depth in flight) -> collect -> update, offline generate(),
abort at any moment."""
from __future__ import annotations

import threading

import pytest

from scheduler_svc.engine_loop import EngineLoop, StalledError
from scheduler_svc.sim_executor import SimExecutor, sim_engine
from shared.sampling import InvalidRequestError, SamplingParams


def test_generate_returns_one_output_per_prompt_in_order():
    loop = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=64)
    outs = loop.generate([[1, 2, 3], [4, 5]], [SamplingParams(temperature=0.0, max_tokens=2,
                                                              ignore_eos=True),
                                               SamplingParams(temperature=0.0, max_tokens=5,
                                                              ignore_eos=True)])
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5]]
    assert [len(o.output_token_ids) for o in outs] == [2, 5]
    assert all(o.finish_reason == "length" and o.first_token_time is not None for o in outs)


def test_generate_validates_every_prompt_before_running_any():
    loop = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=64)
    with pytest.raises(InvalidRequestError):
        loop.generate([[1, 2], []])
    assert not loop.has_unfinished()


def test_step_streams_events_to_a_callback():
    loop = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=64)
    seen = []
    loop.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                  on_event=seen.append)
    assert [e.index for e in seen] == [0, 1, 2]


def test_abort_from_another_thread_ends_the_request():
    loop = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=64)
    loop.add_request("r", [1, 2], SamplingParams(temperature=0.0, max_tokens=50,
                                                 ignore_eos=True))
    loop.step()
    t = threading.Thread(target=loop.abort, args=("r",))
    t.start()
    t.join()
    events = []
    loop.run_until_done(on_event=events.append)
    assert events[-1].finish_reason == "abort"
    assert loop.scheduler.stats()["num_aborted"] == 1


def test_the_executor_is_any_object_with_execute():
    class Recording(SimExecutor):
        def __init__(self):
            super().__init__(block_size=4)
            self.batch_ids = []

        def execute(self, batch):
            self.batch_ids.append(batch.batch_id)
            return super().execute(batch)

    sim = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=64)
    ex = Recording()
    loop = EngineLoop(sim.scheduler, ex)
    loop.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert ex.batch_ids == [0, 1, 2]


def test_a_stalled_scheduler_raises_instead_of_spinning():
    loop = sim_engine("sarathi", block_size=4, num_blocks=64, max_model_len=64)
    loop.add_request("r", [1, 2], SamplingParams(max_tokens=2))
    loop.scheduler.schedule()      # in flight, never updated: nothing else to run
    with pytest.raises(StalledError):
        loop.step()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_batches_in_flight_never_share_a_request_and_tokens_do_not_depend_on_depth(depth):
    prompts = [list(range(1 + i, 14 + 3 * i)) for i in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=16).generate(prompts, sp)
    sim = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=16)
    loop = EngineLoop(sim.scheduler, sim.executor, depth, record=True)
    outs = loop.generate(prompts, sp)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    assert max(len(e["in_flight"]) for e in loop.trace) == depth - 1
    by_id = {e["batch_id"]: e for e in loop.trace}
    for e in loop.trace:
        for other in e["in_flight"]:
            assert not set(e["req_ids"]) & set(by_id[other]["req_ids"])


@pytest.mark.parametrize("depth", [1, 2])
def test_on_batch_observes_every_collected_batch_once_in_submit_order(depth):
    sim = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=8)
    seen = []
    loop = EngineLoop(sim.scheduler, sim.executor, depth,
                      on_batch=lambda batch, out, seconds: seen.append((batch.batch_id, out.batch_id, seconds)))
    loop.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5]],
                  SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [b for b, _, _ in seen] == [o for _, o, _ in seen] == list(range(len(seen)))
    assert all(s >= 0 for _, _, s in seen)


def test_take_in_flight_hands_back_the_batches_oldest_first_and_the_executor_forgets_them():
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    prompts = [[1] * 6, [2] * 6]
    ref = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=4).generate(prompts, sp)
    sim = sim_engine("sarathi", block_size=4, num_blocks=64, token_budget=4)
    loop = EngineLoop(sim.scheduler, sim.executor, depth=2)
    reqs = [loop.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    loop.fill()
    lost = loop.take_in_flight()
    assert [b.batch_id for b in lost] == [0, 1] and not loop.in_flight
    sim.scheduler.on_workers_lost()        # what the service does then: recompute them
    loop.run_until_done()                  # nothing stale is collected from the executor
    assert [r.output_token_ids for r in reqs] == [o.output_token_ids for o in ref]


def test_depth_below_one_is_refused():
    sim = sim_engine("sarathi", block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        EngineLoop(sim.scheduler, sim.executor, depth=0)
