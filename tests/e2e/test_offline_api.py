"""The offline API joins the real scheduler and the real executor: the batching policy, the
token budget and preemption change how work is batched, never what is generated."""
import subprocess
import sys

import pytest

from sarathi.llm import LLM
from scheduler_svc.policies import POLICIES
from shared.sampling import InvalidRequestError, SamplingParams
from tests.support.engine_helpers import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Prompt lengths straddle the token budget (32) so sarathi cuts chunks and vllm/orca do not.
PROMPTS = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate([5, 40, 17, 90, 1, 33])]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")


def run(model, prompts=PROMPTS, params=GREEDY, **kw):
    llm = LLM(str(model), dtype="float32", num_blocks=kw.pop("num_blocks", 256), **kw)
    return [c.token_ids for c in llm.generate(prompts, params)], llm


@pytest.fixture(scope="module")
def reference(tiny_model):
    return run(tiny_model, policy="vllm", max_num_seqs=1)[0]  # one request at a time


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_generates_the_same_greedy_tokens(tiny_model, reference, policy):
    outs, _ = run(tiny_model, policy=policy, token_budget=32, max_num_batched_tokens=128)
    assert outs == reference


def test_preemption_under_memory_pressure_changes_nothing(tiny_model, reference):
    outs, llm = run(tiny_model, num_blocks=10, token_budget=32, max_num_batched_tokens=128)
    assert llm.engine.scheduler.stats()["num_preemptions"] > 0
    assert outs == reference


def test_seeded_sampling_is_reproducible_across_policies(tiny_model):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=1234, ignore_eos=True)
    a, _ = run(tiny_model, params=params, policy="sarathi", token_budget=16)
    b, _ = run(tiny_model, params=params, policy="orca")
    assert a == b
    c, _ = run(tiny_model, params=SamplingParams(**{**params.to_dict(), "seed": 99}), policy="orca")
    assert c != a


def test_invalid_request_is_rejected_before_anything_runs(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", num_blocks=64)
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], [1] * 600], GREEDY)  # max_position_embeddings is 512
    assert not llm.engine.has_unfinished()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sarathi.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_names_a_missing_model_path():
    r = _cli("generate", "--model", "/no/such/model", "--prompt", "hi")
    assert r.returncode == 2
    assert "/no/such/model" in r.stderr and "does not exist" in r.stderr


@pytest.mark.slow
def test_cli_generate_prints_the_offline_api_completion():
    r = _cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    expected = LLM().chat([[{"role": "user", "content": "What is the capital of France?"}]],
                          SamplingParams(temperature=0.0, max_tokens=12))[0].text
    assert r.stdout.strip() == expected.strip()
    assert "Paris" in r.stdout
