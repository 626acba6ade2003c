"""The CPU decode stack (worker_svc/backends/cpu/stack.py, csrc/decode_stack.c): a decode-only
batch through all decoder layers in one native call. It calls the per-layer path's kernels with
the same arguments, so its logits must be bit-identical to the model run layer by layer; batches
it does not take (a prefill chunk among them, more rows than the block kernel's range) must take
the layer path."""
from __future__ import annotations

import gguf
import pytest
import torch

from shared.messages import Batch
from tests.support.engine_helpers import BlockPool, blocks_for, chunk, make_executor, use_threads
from tests.worker.test_gguf_engine import write_tiny_gguf
from worker_svc.backends.cpu import native
from worker_svc.backends.cpu.gguf import EVERY_T, GGUF_MAX_TOKENS

pytestmark = pytest.mark.skipif(not native.available() or native.gguf_isa() == "scalar",
                                reason="the decode stack needs the native library with SIMD")


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(2)      # the kernels' thread splits are part of what must agree


class Spy:
    """Wraps model.stack: records what each call returned (None: the layer path ran)."""

    def __init__(self, stack):
        self.stack, self.results = stack, []

    def __call__(self, *a):
        out = self.stack(*a)
        self.results.append(out is not None)
        return out


def prefilled(ex, lens: list[int], seed: int = 0):
    """Sequences of these prompt lengths prefilled (layer path: chunks); -> their (ids, tables)."""
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(ex.model_info.num_blocks, shuffle_seed=seed)
    seqs = []
    for i, n in enumerate(lens):
        prompt = torch.randint(2, ex.model_info.vocab_size, (n,), generator=g).tolist()
        table = pool.take(blocks_for(n + 4, ex.model_info.block_size))
        ex.execute(Batch(0, [chunk(f"s{i}", prompt, 0, table, True)]))
        seqs.append((f"s{i}", n, table))
    return seqs


def decode_logits(ex, seqs, stack, step: int = 0, extra=()):
    """One decode of every sequence (token 5 + i at its next position), plus `extra` chunks,
    with model.stack set to `stack`; the logits of every sampled row."""
    ex.model.stack = stack
    batch = Batch(0, [chunk(r, [5 + i], n + step, t, True) for i, (r, n, t) in enumerate(seqs)] + list(extra))
    return ex.compute_logits(batch)


def assert_stack_equals_layers(ex, seqs, steps: int = 3):
    stack = ex.model.stack
    assert stack is not None
    spy = Spy(stack)
    for step in range(steps):       # each step writes the same K/V slots on both paths
        ref = decode_logits(ex, seqs, None, step)
        got = decode_logits(ex, seqs, spy, step)
        assert ref.keys() == got.keys()
        for r in ref:
            assert torch.equal(ref[r], got[r]), (r, (ref[r] - got[r]).abs().max())
    assert spy.results == [True] * steps
    ex.model.stack = stack


@pytest.mark.parametrize("qtype,kv,dot", [(gguf.GGMLQuantizationType.Q4_1, "bfloat16", "int8x2"),
                                          (gguf.GGMLQuantizationType.Q6_K, "float32", "int8x2"),
                                          (gguf.GGMLQuantizationType.Q4_K, "bfloat16", "int8")],
                         ids=["Q4_1-bf16kv", "Q6_K-fp32kv", "Q4_K-int8dot"])
def test_stack_logits_equal_the_layer_path(tmp_path, monkeypatch, qtype, kv, dot):
    monkeypatch.setenv("SARATHI_GGUF_DOT", dot)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype)
    ex = make_executor(path, num_blocks=64, weight_quant="auto", kv_cache_dtype=kv)
    assert ex.backend.linear.dot == dot
    # contexts inside one block, across blocks, and long enough for the attention's thread split
    assert_stack_equals_layers(ex, prefilled(ex, [3, 40, 200, 17]))


def test_stack_with_attention_biases(tmp_path):
    """Llama with attention_bias (q, k, v and o biases) on --weight-quant int8 (Q8_0 groups)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, attention_bias=True, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    ex = make_executor(tmp_path / "m", num_blocks=64, weight_quant="int8", kv_cache_dtype="bfloat16")
    assert ex.model.layers[0].o_proj.bias is not None
    assert_stack_equals_layers(ex, prefilled(ex, [5, 33, 70]))


def test_batches_the_stack_does_not_take_run_the_layers(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    ex = make_executor(path, num_blocks=320, weight_quant="auto", kv_cache_dtype="bfloat16")
    seqs = prefilled(ex, [9, 21])
    spy = Spy(ex.model.stack)
    # a hybrid batch: two decodes and a new prompt's chunk
    used = {b for _, _, table in seqs for b in table}
    extra = [chunk("p", list(range(2, 14)), 0, [min(set(range(320)) - used)], True)]
    ref = decode_logits(ex, seqs, None, extra=extra)
    got = decode_logits(ex, seqs, spy, extra=extra)
    assert spy.results == [False]
    assert all(torch.equal(ref[r], got[r]) for r in ref)
    # more decodes than the block kernel's range: the float GEMM path, layer by layer; where the
    # kernels take every call (no range: gguf.py EVERY_T) the stack takes them too
    limit = ex.backend.linear.max_tokens
    many = prefilled(ex, [4] * ((limit if limit != EVERY_T else GGUF_MAX_TOKENS["avx2"]) + 1), seed=1)
    spy.results.clear()
    decode_logits(ex, many, spy)
    assert spy.results == [limit == EVERY_T]


def test_built_only_where_every_layer_runs_the_native_kernels(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, gguf.GGMLQuantizationType.Q4_0)
    assert make_executor(path, num_blocks=8, weight_quant="auto").model.stack is not None
    assert make_executor(path, num_blocks=8, weight_quant="none").model.stack is None     # float weights
    monkeypatch.setenv("SARATHI_GGUF_DOT", "fp32")            # the exact kernel: not in the stack
    assert make_executor(path, num_blocks=8, weight_quant="auto").model.stack is None
    monkeypatch.setenv("SARATHI_GGUF_DOT", "int8x2")
    monkeypatch.setenv("SARATHI_NATIVE_STACK", "0")
    assert make_executor(path, num_blocks=8, weight_quant="auto").model.stack is None


def test_a_kernel_error_names_the_layer_and_the_kernel(tmp_path):
    """A slot outside the cache (the model runner refuses such batches before; called here directly):
    the KV write refuses it before anything is written, and the error says where."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    ex = make_executor(path, num_blocks=8, weight_quant="auto", kv_cache_dtype="bfloat16")
    meta = ex.backend.attention.build_metadata([(5, 1, [ex.model_info.num_blocks + 3])], ex.model_info.block_size)
    x = torch.nn.functional.embedding(torch.tensor([7]), ex.model.embed)
    cos_sin = ex.model.rope.tables(torch.tensor([5]), torch.float32)
    before = [k.clone() for k in ex.cache.k]
    with pytest.raises(ValueError, match=r"layer 0: the KV write kernel rejected the step \(a slot is outside"):
        ex.model.stack(x, cos_sin, ex.cache, meta)
    assert all(torch.equal(a, b) for a, b in zip(before, ex.cache.k))
