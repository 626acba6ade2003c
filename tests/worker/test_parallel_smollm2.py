"""The real default model (SmolLM2-135M: 30 layers, 9 heads, 3 kv heads) split over ranks: PP=2
(an uneven 20 + 10 layer split, two micro-batches in flight) and TP=3 (3 heads and 1 kv head per
rank) give the single-rank greedy tokens on the same batches, with chunked prefills and a
preemption; TP=2 does not divide the heads and is refused before any weight is read."""
from __future__ import annotations

import pytest

from shared.model_source import resolve_model
from tests.support.engine_helpers import make_executor, use_threads
from tests.support.parallel_helpers import Replica, cli, run

pytestmark = pytest.mark.slow

NUM_BLOCKS = 9         # 144 token slots for 4 x (35-43 prompt + 12 generated) = 199: preempts once
TOKEN_BUDGET = 16      # every prompt is prefilled in chunks
MAX_TOKENS = 12
TEXTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
         "Once upon a time, in a small village by the mountains,"]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


@pytest.fixture(scope="module")
def prompts():
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]),
                       add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(prompts):
    ex = make_executor(None, num_blocks=NUM_BLOCKS)
    out = {}
    for depth in (1, 2):
        outs, sched, _ = run(ex, depth, prompts, MAX_TOKENS, NUM_BLOCKS, TOKEN_BUDGET,
                             ex.model_info)
        out[depth] = outs, sched.stats()["num_preemptions"]
    return out


# PP=2 runs once, on an uneven split (20 + 10 layers): two stages in flight and a user-given split
@pytest.mark.parametrize("tp,pp,extra", [(3, 1, {}), (1, 2, {"pp_layers": "20,10"})])
def test_smollm2_split_over_ranks_gives_the_single_rank_tokens(tmp_path, prompts, reference, tp, pp, extra):
    rep = Replica(tmp_path, None, tp, pp, NUM_BLOCKS, timeout_s=120, **extra)
    try:
        if extra:
            assert rep.remote.parallel["layers"] == [0, 20]
        outs, sched, _ = run(rep.remote, pp, prompts, MAX_TOKENS, NUM_BLOCKS, TOKEN_BUDGET,
                             rep.remote.model_info)
    finally:
        rep.close()
    ref_outs, ref_preempted = reference[pp]
    assert sched.stats()["num_preemptions"] == ref_preempted >= 1
    assert outs == ref_outs


def test_smollm2_tp2_is_refused_because_9_heads_do_not_split_in_2(tmp_path):
    r = cli("--tp", "2", "--bind", f"ipc://{tmp_path}/x.sock")
    assert r.returncode == 2
    assert "attention heads (9) are not divisible by tp=2" in r.stderr.splitlines()[-1]
