"""The schedules of the Sarathi-Serve paper's Figure 7, one test per policy.

A and B are decoding when C and D arrive (longer prompts). The policies differ exactly in what
happens to A's and B's decodes while C and D are prefilled.
"""
from __future__ import annotations

from scheduler_svc.sim_executor import sim_engine
from shared.sampling import SamplingParams

AB_TOKENS = 6   # A and B generate this many tokens in all
CD_PROMPT = 12  # tokens in C's and D's prompts


def _sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_figure7(policy: str, **kw) -> list[dict[str, int]]:
    """Batches (req_id -> tokens) from the iteration in which C and D have arrived, to the end."""
    loop = sim_engine(policy, block_size=4, num_blocks=256, max_model_len=256, **kw)
    loop.add_request("A", [1, 2, 3, 4], _sp(AB_TOKENS))
    loop.add_request("B", [5, 6, 7, 8], _sp(AB_TOKENS))
    loop.step()  # A and B prefilled: both are decoding now
    assert {r.req_id for r in loop.scheduler.running if r.is_decode} == {"A", "B"}
    loop.add_request("C", list(range(10, 10 + CD_PROMPT)), _sp(3))
    loop.add_request("D", list(range(30, 30 + CD_PROMPT)), _sp(3))
    batches = []
    while loop.has_unfinished():
        batch = loop.scheduler.schedule()
        batches.append({s.req_id: len(s.token_ids) for s in batch.seqs})
        loop.scheduler.update(batch, loop.executor.execute(batch))
    return batches


def test_sarathi_keeps_a_and_b_decoding_in_every_iteration_while_c_and_d_are_chunked():
    batches = run_figure7("sarathi", token_budget=8)
    ab_iterations = AB_TOKENS - 1  # A and B each have this many decodes left
    for batch in batches[:ab_iterations]:
        assert batch["A"] == 1 and batch["B"] == 1  # no generation stall
        assert sum(batch.values()) <= 8
    assert batches[0] == {"A": 1, "B": 1, "C": 6}  # C's prefill cut to the budget left
    assert batches[1] == {"A": 1, "B": 1, "C": 6}
    assert batches[2] == {"A": 1, "B": 1, "C": 1, "D": 5}


def test_vllm_stalls_a_and_b_while_c_and_d_are_prefilled_whole():
    batches = run_figure7("vllm")
    assert batches[0] == {"C": CD_PROMPT, "D": CD_PROMPT}  # prefill-only: A and B wait
    assert batches[1] == {"A": 1, "B": 1, "C": 1, "D": 1}  # then decode-only


def test_faster_transformer_starts_c_and_d_only_after_a_and_b_finish():
    batches = run_figure7("faster_transformer")
    ab_iterations = AB_TOKENS - 1
    for batch in batches[:ab_iterations]:
        assert batch == {"A": 1, "B": 1}
    assert batches[ab_iterations] == {"C": CD_PROMPT, "D": CD_PROMPT}
    assert batches[ab_iterations + 1] == {"C": 1, "D": 1}


def test_orca_runs_c_and_d_whole_in_one_iteration_with_a_and_b():
    batches = run_figure7("orca")
    assert batches[0] == {"A": 1, "B": 1, "C": CD_PROMPT, "D": CD_PROMPT}
    assert batches[1] == {"A": 1, "B": 1, "C": 1, "D": 1}


def test_hybrid_only_piggybacks_a_and_b_on_whole_prefills():
    batches = run_figure7("hybrid_only", token_budget=8)  # tau is ignored: max_model_len
    assert batches[0] == {"A": 1, "B": 1, "C": CD_PROMPT, "D": CD_PROMPT}


def test_chunked_only_alternates_prefill_chunks_with_decode_only_iterations():
    batches = run_figure7("chunked_only", token_budget=8)
    # A's and B's prefill was the last turn, so a decode-only turn comes first.
    assert batches[0] == {"A": 1, "B": 1}
    assert batches[1] == {"C": 8}                  # prefill-only, chunked to tau
    assert batches[2] == {"A": 1, "B": 1}
    assert batches[3] == {"C": 4, "D": 4}          # C's last chunk, then D's first
    assert batches[4] == {"A": 1, "B": 1, "C": 1}  # C decodes from now on
