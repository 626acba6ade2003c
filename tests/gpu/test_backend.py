"""The CUDA backend on a GPU: FlashInfer attention, CUDA graphs, device sampling, KV sizing.

Marked `gpu` and skipped without CUDA (CI has no GPU); `python -m bench.gpu_check` runs them on
a GPU machine. Tiny random checkpoints with head_dim 128 (the size FlashInfer compiles for the
8B benchmark too, so one JIT build serves both), bf16 (FlashInfer has no fp32 kernels).
"""
from __future__ import annotations

import sys

import pytest
import torch

from shared.config import CacheConfig, WorkerConfig
from shared.messages import Batch
from shared.sampling import SamplingParams
from tests.support.engine_helpers import BlockPool, LaunchAhead, blocks_for, chunk, scheduled_run
from worker_svc.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BS = 16
NUM_BLOCKS = 256
VOCAB = 1024
REL_TOL = 0.03       # bf16: ||a - b|| / ||b|| of a logits row between two kernels (unmeasured guess)


def make_checkpoint(root, model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=128, max_position_embeddings=1024, rms_norm_eps=1e-5,
                               initializer_range=0.1, eos_token_id=1, bos_token_id=0,
                               tie_word_embeddings=model_type == "qwen2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if model_type == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = root / model_type
    model.save_pretrained(path, safe_serialization=True)
    return path


def model_runner(path, attention="auto", graphs=True, num_blocks=NUM_BLOCKS, **kw) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), dtype="bfloat16", device="cuda", attention=attention,
                                    cuda_graphs=graphs, max_num_seqs=16,
                                    cache=CacheConfig(BS, num_blocks), **kw))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpu"), request.param)


def with_ops(ops: str, **kw) -> ModelRunner:
    """A model runner whose layers' glue runs on `ops` (SARATHI_CUDA_OPS while it is built)."""
    import os

    before = os.environ.get("SARATHI_CUDA_OPS")
    os.environ["SARATHI_CUDA_OPS"] = ops
    try:
        return model_runner(**kw)
    finally:
        if before is None:
            del os.environ["SARATHI_CUDA_OPS"]
        else:
            os.environ["SARATHI_CUDA_OPS"] = before


@pytest.fixture(scope="module")
def flash(ckpt):
    """FlashInfer attention + graphs with the reference elementwise ops (torch, Hugging Face's
    roundings): what the tests against Hugging Face's bf16 results hold."""
    ex = with_ops("torch", path=ckpt, attention="flashinfer")
    assert ex.backend.attention.name == "flashinfer" and ex.backend.ops.name == "torch"
    assert ex.graphs is not None
    return ex


@pytest.fixture(scope="module")
def torch_path(ckpt):
    return model_runner(ckpt, attention="torch", graphs=False)


@pytest.fixture(scope="module")
def fused(ckpt):
    """The default CUDA configuration: FlashInfer attention + graphs + FlashInfer's fused
    elementwise kernels (no SARATHI_CUDA_OPS given)."""
    import os

    assert "SARATHI_CUDA_OPS" not in os.environ
    ex = model_runner(ckpt, attention="flashinfer")
    assert ex.backend.ops.name == "flashinfer" and ex.graphs is not None
    return ex


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hybrid_batches():
    """Batch 1: prefixes (three prompts whole, one long prompt's first 40 tokens) on shuffled
    blocks; batch 2 (hybrid): their decodes + the long prompt's next chunk with its cached prefix
    + a new prompt's first chunk."""
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=7)
    prompts = {f"d{i}": prompt(17 + 23 * i, i) for i in range(3)}
    tables = {r: pool.take(blocks_for(len(p) + 2, BS)) for r, p in prompts.items()}
    long_p, long_t = prompt(90, 10), pool.take(blocks_for(90, BS))
    new_p, new_t = prompt(33, 11), pool.take(blocks_for(33, BS))
    first = Batch(0, [chunk(r, p, 0, tables[r], True) for r, p in prompts.items()]
                  + [chunk("p", long_p[:40], 0, long_t, False)])
    second = Batch(1, [chunk(r, [5 + i], len(p), tables[r], True) for i, (r, p) in enumerate(prompts.items())]
                   + [chunk("p", long_p[40:], 40, long_t, True), chunk("n", new_p[:20], 0, new_t, False)])
    return first, second


def test_hybrid_batch_logits_equal_the_torch_path(flash, torch_path):
    for batch in hybrid_batches():
        got, want = flash.compute_logits(batch), torch_path.compute_logits(batch)
        assert got.keys() == want.keys()
        for r in want:
            assert rel_err(got[r], want[r]) < REL_TOL, r


def test_greedy_32_tokens_equal_transformers(ckpt, flash):
    from transformers import AutoModelForCausalLM

    from tests.support.engine_helpers import greedy_generate

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    p = prompt(50, 3)
    with torch.no_grad():
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    assert greedy_generate(flash, p, 32, list(range(blocks_for(82, BS))), chunk_size=16) == ref


def test_graph_replay_equals_eager(flash):
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=3)
    for n in (1, 3, 5, 16):          # exact sizes and padded ones
        specs = [(prompt(10 + 7 * i, 20 + i), pool.take(blocks_for(10 + 7 * i + 1, BS))) for i in range(n)]
        flash.compute_logits(Batch(0, [chunk(f"r{i}", p, 0, t, False) for i, (p, t) in enumerate(specs)]))
        decode = Batch(1, [chunk(f"r{i}", [3], len(p), t, True) for i, (p, t) in enumerate(specs)])
        graphs = flash.graphs
        replayed = flash.compute_logits(decode)
        flash.graphs = None
        try:
            eager = flash.compute_logits(decode)     # rewrites the same K/V to the same slots
        finally:
            flash.graphs = graphs
        for r in eager:
            assert rel_err(replayed[r], eager[r]) < 1e-2, (n, r)


def test_device_sampling_is_greedy_argmax_and_seed_stable_across_batches(flash):
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=4)
    ps = {f"s{i}": (prompt(12 + i, 40 + i), pool.take(2)) for i in range(4)}
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=123)
    flash.compute_logits(Batch(0, [chunk(r, p, 0, t, False) for r, (p, t) in ps.items()]))
    alone = flash.execute(Batch(1, [chunk("s0", [7], len(ps["s0"][0]), ps["s0"][1], True, seeded, 5)]))
    together = flash.execute(Batch(2, [chunk(r, [7], len(p), t, True, seeded if r == "s0" else
                                             SamplingParams(temperature=1.0, seed=9), 5)
                                       for r, (p, t) in ps.items()]))
    # same row values up to kernel differences between batch sizes: the draw is the same unless
    # two candidates are within bf16 noise of each other
    assert alone.sampled["s0"] == together.sampled["s0"]
    greedy = Batch(3, [chunk(r, [7], len(p), t, True) for r, (p, t) in ps.items()])
    logits = flash.compute_logits(greedy)
    out = flash.execute(greedy)
    assert out.sampled == {r: int(l.argmax()) for r, l in logits.items()}


def test_device_sampler_on_cuda_tensors_is_composition_independent():
    from worker_svc.sampling import DeviceSampler

    logits = torch.randn(6, 32000, device="cuda") * 3
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_k=50 * i, top_p=1.0 - 0.05 * i, seed=i) for i in range(6)]
    alone = [DeviceSampler().sample(logits[i:i + 1], [params[i]], [i])[0] for i in range(6)]
    assert DeviceSampler().sample(logits, params, list(range(6))) == alone
    assert DeviceSampler().sample(logits[[5, 3, 1]], [params[5], params[3], params[1]], [5, 3, 1]) == \
        [alone[5], alone[3], alone[1]]
    cpu = DeviceSampler().sample(logits.cpu(), params, list(range(6)))
    assert cpu == alone                  # the hash is exact integer arithmetic on both devices


def test_kv_cache_is_sized_from_free_memory(ckpt):
    ex = model_runner(ckpt, num_blocks=0, gpu_memory_utilization=0.3, max_num_batched_tokens=2048)
    n = ex.model_info.num_blocks
    assert n > 100 and ex.cache.num_blocks == n + ex.backend.scratch_blocks
    total = torch.cuda.get_device_properties(0).total_memory
    per_block = 2 * 2 * BS * 2 * 128 * 2           # layers x (k, v) x tokens x kv heads x dim x bytes
    assert n * per_block <= 0.3 * total
    del ex
    torch.cuda.empty_cache()


def test_weights_arrive_on_the_device_in_the_compute_dtype(flash):
    params = list(flash.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    assert "flashinfer" in sys.modules


def test_offline_api_on_cuda_generates_the_same_greedy_tokens(ckpt, fused):
    from sarathi.llm import LLM
    from tests.support.engine_helpers import greedy_generate

    p = prompt(30, 8)
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", num_blocks=64, max_num_seqs=8)
    got = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    assert got == greedy_generate(fused, p, 12, list(range(blocks_for(42, BS))))   # both the default


def test_fused_ops_on_cuda_compute_the_references_functions():
    """FlashInfer's fused norm / residual / rotary / silu kernels against the torch reference
    (Ops) on bf16 rows at Llama-3-8B widths, positions to 4095, llama3 rope scaling."""
    from worker_svc.backends.base import Ops
    from worker_svc.backends.cuda.ops import FlashInferOps, RopePositions
    from worker_svc.model.rope import RotaryEmbedding
    from worker_svc.model_config import ModelConfig

    ops, ref, bf, dev = FlashInferOps(), Ops(), torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x, res = (torch.randn(37, 4096, generator=g, device=dev).to(bf) for _ in range(2))
    w = (1 + 0.1 * torch.randn(4096, generator=g, device=dev)).to(bf)
    assert rel_err(ops.rms_norm(x, w, 1e-5).float(), ref.rms_norm(x, w, 1e-5).float()) < 1e-2
    want_h, want_r = ref.add_rms_norm(x, res, w, 1e-5)
    h, r = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert rel_err(h.float(), want_h.float()) < 1e-2 and rel_err(r.float(), want_r.float()) < 1e-2
    gate_up = torch.randn(37, 2 * 14336, generator=g, device=dev).to(bf)
    assert rel_err(ops.silu_mul(gate_up).float(), ref.silu_mul(gate_up).float()) < 1e-2
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=4096, intermediate_size=14336, num_layers=1,
                      num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=4096,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    rope = RotaryEmbedding(cfg, 4096).to(dev)
    pos = torch.randint(0, 4096, (37,), generator=g, device=dev)
    qkv = torch.randn(37, 48, 128, generator=g, device=dev).to(bf)
    want_q, want_k = ref.rotary(qkv[:, :32], qkv[:, 32:40], ref.rope_inputs(rope, pos, bf))
    inputs = ops.rope_inputs(rope, pos, bf)
    assert isinstance(inputs, RopePositions)
    q, k = ops.rotary(qkv[:, :32], qkv[:, 32:40], inputs)
    assert q.data_ptr() == qkv.data_ptr()
    assert rel_err(q.float(), want_q.float()) < 1e-2 and rel_err(k.float(), want_k.float()) < 1e-2


def test_fused_ops_are_as_close_to_fp32_as_the_reference_ops(ckpt, flash, fused):
    """The fused kernels round differently from Hugging Face (once, in fp32), so their bf16
    logits are held to accuracy, not to HF's roundings: against the fp32 torch path, their error
    is at most 1.5x that of the default (reference ops) bf16 path, on every row of the hybrid
    batches; and their graph replay equals their eager run."""
    fp32 = ModelRunner(WorkerConfig(model=str(ckpt), dtype="float32", device="cuda", attention="torch",
                                    cuda_graphs=False, max_num_seqs=16, cache=CacheConfig(BS, NUM_BLOCKS)))
    for batch in hybrid_batches():
        truth = fp32.compute_logits(batch)
        ref, got = flash.compute_logits(batch), fused.compute_logits(batch)
        for r in truth:
            assert rel_err(got[r], truth[r]) <= 1.5 * rel_err(ref[r], truth[r]) + 1e-3, r
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=5)
    specs = [(prompt(12 + 5 * i, 60 + i), pool.take(blocks_for(12 + 5 * i + 1, BS))) for i in range(3)]
    fused.compute_logits(Batch(0, [chunk(f"g{i}", p, 0, t, False) for i, (p, t) in enumerate(specs)]))
    decode = Batch(1, [chunk(f"g{i}", [3], len(p), t, True) for i, (p, t) in enumerate(specs)])
    replayed = fused.compute_logits(decode)
    graphs, fused.graphs = fused.graphs, None
    try:
        eager = fused.compute_logits(decode)
    finally:
        fused.graphs = graphs
    for r in eager:
        assert rel_err(replayed[r], eager[r]) < 1e-2, r


def test_batches_launched_ahead_give_the_synchronous_tokens(ckpt, fused):
    """Async scheduling on the GPU: each batch launched before the one before it is read back
    (inputs, page lists and plans through pinned memory without waiting, the decodes' tokens
    copied in on the device, the tokens read back by a non-blocking copy and an event) gives the
    synchronous loop's tokens: greedy, seeded sampled and logit_bias, graphs and hybrid batches."""
    want = scheduled_run(fused, "s", False, same_length=True)
    ahead, trace = LaunchAhead(fused), []
    assert scheduled_run(ahead, "a", True, trace, same_length=True) == want
    assert ahead.launched_behind > 5 and sum(1 for t in trace if t["in_flight"]) > 5


def test_the_worker_service_holds_a_running_batch_and_launches_the_next_behind_it(ckpt, fused, tmp_path):
    """Over ZeroMQ on the GPU: with async scheduling the worker launches the next batch while one
    runs and answers in order; without it, each batch runs to its end and is answered. A
    tiny model's step is shorter than the scheduler's round trip, so each readback is held
    not-ready for 20 ms more (the real CUDA event and copy underneath)."""
    import time

    from scheduler_svc.remote_executor import RemoteExecutor
    from tests.support.worker_threads import serving
    from worker_svc.backends import Readback
    from worker_svc.service import WorkerServer

    want = scheduled_run(fused, "s", False, same_length=True)
    behind = []
    launch, read_back = fused.launch, fused.backend.read_back

    def counting(batch):
        behind.append(fused._unfinished is not None)
        return launch(batch)

    def slow_read_back(t):
        rb, until = read_back(t), time.monotonic() + 0.02
        return Readback(rb.wait, lambda: time.monotonic() > until and rb.ready())
    fused.launch, fused.backend.read_back = counting, slow_read_back
    try:
        with serving() as run:
            remote = RemoteExecutor(run(WorkerServer(fused, f"ipc://{tmp_path}/w.sock", keys=None)), timeout_s=60)
            assert scheduled_run(remote, "r", True, same_length=True) == want
            launched_behind = sum(behind)
            del behind[:]
            assert scheduled_run(remote, "q", False, same_length=True) == want
            assert behind and not any(behind)    # not planned ahead: each batch run to its end
            remote.close()
    finally:
        del fused.launch, fused.backend.read_back
    assert launched_behind > 5


def test_a_hybrid_batch_launches_while_the_batch_before_it_still_runs(ckpt, fused):
    """Async scheduling's point on a hybrid batch (decodes on the decode kernel, chunks on the
    prefill kernel: two FlashInfer plans): its launch returns while the GPU is still busy with
    the work queued before it (a 1 s sleep kernel stands in for the batch running), and its
    tokens are the synchronous run's. A launch that waits for the GPU serializes the host's
    preparation with the batch before it, and delays that batch's tokens by this launch."""
    first, second = hybrid_batches()
    fused.execute(first)
    want = fused.execute(second).sampled
    fused.execute(first)                     # the same K/V again for the run launched behind
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)         # ~1 s of the GPU at ~2 GHz
    busy = torch.cuda.Event()
    busy.record()
    launched = fused.launch(second)
    still_busy = not busy.query()
    assert fused.finish(launched).sampled == want
    assert still_busy, "the hybrid batch's launch waited for the GPU to finish the work before it"
