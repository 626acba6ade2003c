"""A request's life in the Scheduler: validation, token events, finishing, abort, metrics."""
from __future__ import annotations

import pytest

from scheduler_svc.sim_executor import SimClock, linear_cost_model, sim_engine
from shared.sampling import InvalidRequestError, SamplingParams

EOS = 0


def greedy(max_tokens=4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def engine(**kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("vocab_size", 1000)
    return sim_engine("sarathi", eos_token_ids=(EOS,), **kw)


# -- bad input: rejected at once with a clear reason, never left waiting -------------------------
def test_out_of_range_sampling_params_are_rejected():
    sp = greedy()
    sp.top_p = 0.0  # mutated after construction: validated again at add_request
    with pytest.raises(InvalidRequestError) as e:
        engine().add_request("r", [1, 2], sp)
    assert e.value.param == "top_p"


def test_max_tokens_of_zero_is_rejected():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"


def test_an_empty_prompt_is_rejected():
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine().add_request("r", [], greedy())


def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(InvalidRequestError) as e:
        engine().add_request("r", [1, 5000], greedy())
    assert e.value.code == "invalid_token_id"


def test_prompt_plus_max_tokens_beyond_the_context_window_is_rejected():
    with pytest.raises(InvalidRequestError) as e:
        engine(max_model_len=16).add_request("r", list(range(1, 14)), greedy(max_tokens=4))
    assert e.value.code == "context_length_exceeded" and "16" in e.value.message


def test_a_request_that_could_never_fit_in_the_kv_cache_is_rejected_not_queued():
    loop = engine(num_blocks=4)  # 16 tokens of KV cache
    with pytest.raises(InvalidRequestError) as e:
        loop.add_request("r", list(range(1, 15)), greedy(max_tokens=4))
    assert e.value.code == "kv_cache_too_small"
    assert not loop.has_unfinished()


def test_a_non_integer_token_id_is_rejected_not_crashed_on():
    with pytest.raises(InvalidRequestError) as e:
        engine().add_request("r", [1, "two"], greedy())
    assert e.value.code == "invalid_token_id"


def test_a_duplicate_request_id_is_rejected():
    loop = engine()
    loop.add_request("r", [1, 2], greedy())
    with pytest.raises(InvalidRequestError) as e:
        loop.add_request("r", [3], greedy())
    assert e.value.code == "duplicate_request_id"


# -- token events -----------------------------------------------------------------------------
def test_events_carry_the_output_index_and_the_finish_reason_on_the_last():
    loop = engine()
    loop.add_request("r", [1, 2, 3], greedy(max_tokens=3, ignore_eos=True))
    events = []
    loop.run_until_done(on_event=events.append)
    assert [e.index for e in events] == [0, 1, 2]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert all(e.num_prompt_tokens == 3 for e in events)


def test_eos_finishes_with_stop_and_is_the_last_token():
    loop = engine(scripts={"r": [5, EOS, 6]})
    req = loop.add_request("r", [1, 2], greedy(max_tokens=8))
    loop.run_until_done()
    assert req.output_token_ids == [5, EOS] and req.finish_reason == "stop"


def test_ignore_eos_generates_past_eos():
    loop = engine(scripts={"r": [5, EOS, 6]})
    req = loop.add_request("r", [1, 2], greedy(max_tokens=3, ignore_eos=True))
    loop.run_until_done()
    assert req.output_token_ids == [5, EOS, 6] and req.finish_reason == "length"


def test_a_stop_token_id_finishes_with_stop_even_with_ignore_eos():
    loop = engine(scripts={"r": [5, 42, 6]})
    req = loop.add_request("r", [1, 2], greedy(max_tokens=8, ignore_eos=True,
                                               stop_token_ids=[42]))
    loop.run_until_done()
    assert req.output_token_ids == [5, 42] and req.finish_reason == "stop"


# -- abort --------------------------------------------------------------------------------------
def test_abort_takes_effect_at_the_next_step_and_frees_the_blocks():
    loop = engine()
    loop.add_request("r", list(range(1, 10)), greedy(max_tokens=20))
    loop.step()
    assert loop.scheduler.stats()["num_free_blocks"] < 64
    loop.abort("r")
    assert loop.has_unfinished()          # nothing happens before the step boundary
    events = loop.step()
    assert [(e.req_id, e.token_id, e.finish_reason) for e in events] == [("r", None, "abort")]
    assert loop.scheduler.stats()["num_free_blocks"] == 64 and not loop.has_unfinished()


def test_aborting_a_request_in_flight_waits_for_its_batch():
    loop = engine()
    loop.add_request("r", [1, 2, 3], greedy(max_tokens=20))
    sched = loop.scheduler
    batch = sched.schedule()
    sched.abort("r")
    assert sched.schedule() is None       # still in flight: blocks stay until the output is back
    events = sched.update(batch, loop.executor.execute(batch))
    assert events[-1].finish_reason == "abort" and not sched.has_unfinished()
    assert sched.stats()["num_free_blocks"] == 64


def test_a_finished_request_is_announced_in_the_next_batch_freed_ids():
    loop = engine()
    loop.add_request("short", [1], greedy(max_tokens=1, ignore_eos=True))
    loop.add_request("long", [2], greedy(max_tokens=5, ignore_eos=True))
    loop.step()                           # "short" finishes on its first token
    batch = loop.scheduler.schedule()
    assert batch.freed_req_ids == ["short"]


def test_aborting_an_unknown_request_is_ignored():
    loop = engine()
    loop.abort("nope")
    assert loop.step() == []


# -- metrics ---------------------------------------------------------------------------------
def test_timestamps_come_from_the_injected_clock():
    clock = SimClock(100.0)
    loop = engine(clock=clock, cost_model=linear_cost_model(0.01, 0.0, 0.0))
    req = loop.add_request("r", [1, 2], greedy(max_tokens=3, ignore_eos=True))
    clock.advance(0.5)
    loop.run_until_done()
    assert req.arrival_time == 100.0
    assert req.scheduling_delay == pytest.approx(0.5)
    assert req.ttft == pytest.approx(0.51)
    assert req.tbts == pytest.approx([0.01, 0.01])


def test_stats_report_queue_lengths_memory_and_the_last_batch():
    loop = engine(token_budget=8)
    loop.add_request("a", [1, 2, 3], greedy(ignore_eos=True))
    loop.add_request("b", list(range(1, 12)), greedy(ignore_eos=True))
    loop.step()
    s = loop.scheduler.stats()
    assert (s["running"], s["waiting"]) == (2, 0)
    assert s["last_prefill_tokens"] == 8 and s["last_decode_tokens"] == 0
    assert s["num_free_blocks"] == 64 - 1 - 3 and s["kv_usage"] == pytest.approx(4 / 64)
    loop.step()
    s = loop.scheduler.stats()
    assert s["last_decode_tokens"] == 1 and s["last_prefill_tokens"] == 6
