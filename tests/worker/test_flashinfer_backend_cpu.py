"""The CUDA backend's FlashInfer attention, graph runner and device sampling, driven on the CPU
through a stand-in `flashinfer` (tests/support/fake_flashinfer.py: FlashInfer's wrapper signatures, its
semantics computed by a plain-torch reference) and eager replay in place of CUDA graphs. This
checks the plumbing: which wrapper plans which batch, the order and types of plan() arguments,
the scratch block, padding to graph sizes, static buffers, sampling on the device. The kernels
and real graph capture are GPU tests (tests/gpu/test_backend.py), not run here."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import CacheConfig, WorkerConfig
from shared.messages import Batch
from tests.support import fake_flashinfer
from tests.support.engine_helpers import (
    BlockPool,
    LaunchAhead,
    blocks_for,
    chunk,
    greedy_generate,
    make_executor,
    make_tiny_checkpoint,
    scheduled_run,
    use_threads,
)
from worker_svc import model_runner as model_runner_mod
from worker_svc.backends.base import LinearMethod
from worker_svc.backends.cuda import cuda_graphs
from worker_svc.model_runner import BatchError, ModelRunner

BS = 16
NUM_BLOCKS = 128


@pytest.fixture(scope="module", autouse=True)
def _threads():
    yield from use_threads(1)


class EagerGraphRunner(cuda_graphs.CudaGraphRunner):
    """The real runner (static buffers, padding, per-size wrappers) with capture = remember the
    step and replay = run it again, writing into the same output tensor."""

    def _capture(self, step, device):
        out = step()

        def replay():
            with torch.inference_mode():     # the model's outputs are inference tensors
                out.copy_(step())
        return out, replay


@pytest.fixture
def fake_backend(monkeypatch):
    """The CUDA backend as cuda_backend builds it with FlashInfer, on the CPU device."""
    from worker_svc.backends.cuda import CudaBackend, FlashInferAttention
    from worker_svc.backends.cuda.ops import FlashInferOps

    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(FlashInferAttention, "workspace_bytes", 1024)

    def select(device, dtype, kv_cache_dtype=None, attention="auto", weight_quant="auto"):
        return CudaBackend(torch.device("cpu"), FlashInferAttention(torch.device("cpu"), dtype),
                           LinearMethod(), dtype, dtype, scratch_blocks=1, graph_runner_class=EagerGraphRunner,
                           ops=FlashInferOps())
    monkeypatch.setattr(model_runner_mod, "select_backend", select)


@pytest.fixture(scope="module", params=["llama", "qwen2_bias"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fi"), request.param)


def flash_runner(path, graphs=True, dtype="float32") -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(path), dtype=dtype, cuda_graphs=graphs, max_num_seqs=8,
                                    cache=CacheConfig(BS, NUM_BLOCKS)))


def prompt(n, seed):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hybrid_batches_give_the_torch_paths_logits(fake_backend, ckpt):
    flash, ref = flash_runner(ckpt), make_executor(ckpt, num_blocks=NUM_BLOCKS)
    assert flash.backend.attention.name == "flashinfer" and flash.graphs is not None
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=1)
    prompts = {f"d{i}": prompt(15 + 17 * i, i) for i in range(3)}
    tables = {r: pool.take(blocks_for(len(p) + 2, BS)) for r, p in prompts.items()}
    long_p, long_t = prompt(80, 9), pool.take(blocks_for(80, BS))
    batches = [Batch(0, [chunk(r, p, 0, tables[r], True) for r, p in prompts.items()]
                     + [chunk("p", long_p[:33], 0, long_t, False)]),
               Batch(1, [chunk(r, [4 + i], len(p), tables[r], True) for i, (r, p) in enumerate(prompts.items())]
                     + [chunk("p", long_p[33:], 33, long_t, True)]),
               Batch(2, [chunk(r, [9], len(p) + 1, tables[r], True) for r, p in prompts.items()])]  # graph
    att = flash.backend.attention
    runs = []
    for b in batches:
        got, want = flash.compute_logits(b), ref.compute_logits(b)
        assert got.keys() == want.keys()
        for r in want:
            assert (got[r] - want[r]).abs().max().item() < 1e-4, (b.batch_id, r)
        runs.append((att.decode.runs, att.prefill.runs))
    # batch 0: chunks only (prefill kernel); batch 1: 3 decodes, then a chunk: split, the decodes
    # on the decode kernel and the chunk on the prefill kernel; batch 2: decode-only, a graph
    assert runs[0][0] == 0 and runs[0][1] > 0
    assert runs[1][0] > runs[0][0] and runs[1][1] > runs[0][1]
    assert runs[2] == runs[1] and flash.graphs.wrappers[4].runs > 0   # 3 decodes -> graph of 4


def test_a_hybrid_batch_not_led_by_its_decodes_runs_on_the_prefill_kernel(fake_backend, ckpt):
    """A chunk before a decode: one prefill-kernel call for every row, same logits."""
    flash, ref = flash_runner(ckpt, graphs=False), make_executor(ckpt, num_blocks=NUM_BLOCKS)
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=5)
    a, ta = prompt(20, 1), pool.take(blocks_for(22, BS))
    c, tc = prompt(40, 2), pool.take(blocks_for(40, BS))
    for ex in (flash, ref):
        ex.compute_logits(Batch(0, [chunk("a", a, 0, ta, True), chunk("c", c[:17], 0, tc, False)]))
    mixed = Batch(1, [chunk("c", c[17:], 17, tc, True), chunk("a", [7], 20, ta, True)])
    att = flash.backend.attention
    decode_runs = att.decode.runs
    got, want = flash.compute_logits(mixed), ref.compute_logits(mixed)
    assert att.decode.runs == decode_runs
    for r in want:
        assert (got[r] - want[r]).abs().max().item() < 1e-4, r


def test_graph_sizes_padding_and_eager_fallback(fake_backend, ckpt):
    flash = flash_runner(ckpt)
    assert flash.graphs.sizes == [1, 2, 4, 8]
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=2)
    for n in (1, 3, 5, 8, 9):                  # 9 > max_num_seqs: eager decode wrapper
        specs = [(prompt(5 + 3 * i, 30 + i), pool.take(blocks_for(5 + 3 * i + 1, BS))) for i in range(n)]
        flash.compute_logits(Batch(0, [chunk(f"r{i}", p, 0, t, False) for i, (p, t) in enumerate(specs)]))
        decode = Batch(1, [chunk(f"r{i}", [3], len(p), t, i % 2 == 0) for i, (p, t) in enumerate(specs)])
        runs = flash.backend.attention.decode.runs
        graphed = flash.compute_logits(decode)
        assert (flash.backend.attention.decode.runs > runs) == (n > 8)
        graphs, flash.graphs = flash.graphs, None
        eager = flash.compute_logits(decode)
        flash.graphs = graphs
        assert graphed.keys() == eager.keys() == {f"r{i}" for i in range(0, n, 2)}
        for r in eager:
            assert torch.allclose(graphed[r], eager[r], atol=1e-5), (n, r)
        pool = BlockPool(NUM_BLOCKS, shuffle_seed=2 + n)


def test_scratch_block_is_the_backends_not_the_schedulers(fake_backend, ckpt):
    flash = flash_runner(ckpt)
    assert flash.model_info.num_blocks == NUM_BLOCKS and flash.cache.num_blocks == NUM_BLOCKS + 1
    with pytest.raises(BatchError, match="outside the cache"):
        flash.execute(Batch(0, [chunk("r", [1, 2], 0, [NUM_BLOCKS], True)]))


def test_greedy_through_flashinfer_graphs_and_device_sampling_equals_transformers(fake_backend, ckpt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    p = prompt(40, 5)
    with torch.no_grad():
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    flash = flash_runner(ckpt)
    assert flash.device_sampler is not None
    assert greedy_generate(flash, p, 32, BlockPool(NUM_BLOCKS, shuffle_seed=8).take(blocks_for(72, BS)),
                           chunk_size=15) == ref


def test_fused_ops_compute_the_references_functions_in_place(monkeypatch):
    """FlashInferOps on bf16 rows: the reference's results up to one rounding, written where the
    contract says (residual's and x's storage; q and k as views of the fused qkv output)."""
    from worker_svc.backends.base import Ops
    from worker_svc.backends.cuda.ops import FlashInferOps, RopePositions
    from worker_svc.model.rope import RotaryEmbedding
    from worker_svc.model_config import ModelConfig

    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake_flashinfer)
    ops, ref, bf = FlashInferOps(), Ops(), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 64, generator=g).to(bf) for _ in range(2))
    w = torch.randn(64, generator=g).to(bf)

    def close(a, b, tol=2e-2):
        assert a.dtype == b.dtype and (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()

    close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    want_h, want_r = ref.add_rms_norm(x, res, w, 1e-5)
    xs, rs = x.clone(), res.clone()
    h, r = ops.add_rms_norm(xs, rs, w, 1e-5)
    assert h.data_ptr() == xs.data_ptr() and r.data_ptr() == rs.data_ptr()
    close(h, want_h)
    close(r, want_r)
    gate_up = torch.randn(5, 128, generator=g).to(bf)
    close(ops.silu_mul(gate_up), ref.silu_mul(gate_up))
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, rope_scaling={"rope_type": "linear", "factor": 2.0})
    rope = RotaryEmbedding(cfg, 256)
    pos = torch.tensor([0, 7, 100, 101, 255])
    qkv = torch.randn(5, 8, 16, generator=g).to(bf)          # 4 q heads, 2 k heads, 2 v heads
    want_q, want_k = ref.rotary(qkv[:, :4], qkv[:, 4:6], ref.rope_inputs(rope, pos, bf))
    v = qkv[:, 6:].clone()
    inputs = ops.rope_inputs(rope, pos, bf)
    assert isinstance(inputs, RopePositions) and inputs.cos_sin_cache.dtype == torch.float32
    q, k = ops.rotary(qkv[:, :4], qkv[:, 4:6], inputs)
    assert q.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, 6:], v)     # in place; v untouched
    close(q, want_q)
    close(k, want_k)
    # no rows (a batch where no row is due a token reaches the final norm empty): the kernels
    # refuse zero-sized launches, so the empty result comes from the reference
    empty = x[:0]
    assert ops.rms_norm(empty, w, 1e-5).shape == (0, 64)
    assert [t.shape for t in ops.add_rms_norm(empty.clone(), res[:0].clone(), w, 1e-5)] == [(0, 64), (0, 64)]
    assert ops.silu_mul(gate_up[:0]).shape == (0, 64)
    assert ops.rotary(qkv[:0, :4], qkv[:0, 4:6], ops.rope_inputs(rope, pos[:0], bf))[0].shape == (0, 4, 16)
    # fp32 (the CPU reference dtype) keeps the reference path
    assert isinstance(ops.rope_inputs(rope, pos, torch.float32), tuple) and \
        not isinstance(ops.rope_inputs(rope, pos, torch.float32), RopePositions)


def test_bf16_model_on_the_fused_ops_gives_the_torch_paths_logits(fake_backend, ckpt):
    flash = flash_runner(ckpt, dtype="bfloat16")
    assert flash.backend.ops.name == "flashinfer"
    ref = make_executor(ckpt, dtype="bfloat16", num_blocks=NUM_BLOCKS)
    pool = BlockPool(NUM_BLOCKS, shuffle_seed=3)
    p, t = prompt(40, 7), pool.take(blocks_for(42, BS))
    flash.compute_logits(Batch(0, [chunk("r", p[:10], 0, t, False)]))   # a chunk with no row due a token
    ref.compute_logits(Batch(0, [chunk("r", p[:10], 0, t, False)]))
    for b in (Batch(1, [chunk("r", p[10:], 10, t, True)]), Batch(2, [chunk("r", [5], 40, t, True)])):
        got, want = flash.compute_logits(b), ref.compute_logits(b)
        assert (got["r"] - want["r"]).norm() / want["r"].norm() < 0.03, b.batch_id


def test_gpu_benchmark_splits_a_replayed_decode_step_into_host_and_graph(fake_backend, ckpt, tmp_path):
    """bench.gpu_engine_iteration's decode split on the graph runner (eager replay here): every
    captured decode size gets the step, the replay alone, the step without the replay and the
    step launched ahead of the previous one's readback; the step without its replay is the
    cheaper one, and the real replays are back in place. The host
    profile of such a step names the engine's functions without the machine's paths."""
    from bench import gpu_engine_iteration as g

    ex = flash_runner(ckpt)
    before = dict(ex.graphs.replays)
    split = g.decode_split(ex, tiny=True, rounds=3)
    assert set(split) == {"decode:1", "decode:2", "decode:4"}
    for v in split.values():
        assert v["graph_s"] > 0 and v["host_s"] < v["step_s"] and v["ahead_s"] > 0
    assert ex.graphs.replays == before
    assert g.decode_split(flash_runner(ckpt, graphs=False), tiny=True, rounds=1) == {}
    prof = tmp_path / "host.txt"
    g.host_profile(ex, tiny=True, path=prof, calls=3)
    text = prof.read_text()
    assert "build_paged_batch" in text and "execute" in text and str(Path.cwd()) not in text
    assert ex.graphs.replays == before


def test_batches_launched_before_the_previous_is_read_back_give_the_same_tokens(fake_backend, ckpt):
    """Async scheduling on the CUDA backend's path (device sampling, graphs, hybrid batches):
    a decode planned ahead is launched while the batch that samples its token is not read back,
    its token copied in on the device; every request's tokens equal the synchronous loop's."""
    flash = flash_runner(ckpt)
    want = scheduled_run(flash, "s", False)
    ahead = LaunchAhead(flash)
    trace = []
    assert scheduled_run(ahead, "a", True, trace) == want
    assert ahead.launched_behind > 10 and sum(1 for t in trace if t["in_flight"]) > 10
    assert flash.graphs.wrappers[8].runs + flash.graphs.wrappers[4].runs > 0   # graphs replayed


def test_a_pending_token_the_batch_before_did_not_sample_is_refused(fake_backend, ckpt):
    from shared.messages import PENDING_TOKEN
    flash = flash_runner(ckpt)
    table = BlockPool(NUM_BLOCKS, shuffle_seed=3).take(2)
    first = flash.launch(Batch(0, [chunk("a", prompt(5, 1), 0, table, True)]))
    with pytest.raises(BatchError, match="request b"):
        flash.launch(Batch(1, [chunk("b", [PENDING_TOKEN], 5, table, True, output_index=1)]))
    token = flash.finish(first).sampled["a"]
    # the same pending token once batch 0 is read back: filled in on the host; it computes the
    # position-5 token the real token would
    ahead = flash.compute_logits(Batch(2, [chunk("a", [PENDING_TOKEN], 5, table, True, output_index=1)]))
    real = flash.compute_logits(Batch(3, [chunk("a", [token], 5, table, True, output_index=1)]))
    assert torch.equal(ahead["a"], real["a"])


def test_the_worker_service_launches_the_next_batch_before_answering_the_one_running(fake_backend, ckpt, tmp_path):
    """Over ZeroMQ: the device takes 30 ms to hand a batch's tokens back (a stand-in readback),
    the scheduler plans ahead, so the next message arrives while a batch runs: the worker
    launches it, then answers (a waker thread answers a held batch whose successor does not
    come); the outputs are the synchronous loop's."""
    import time as _time

    from scheduler_svc.remote_executor import RemoteExecutor
    from tests.support.worker_threads import serving
    from worker_svc.backends.base import Readback
    from worker_svc.service import WorkerServer

    flash = flash_runner(ckpt)
    want = scheduled_run(flash, "s", False)
    read_back = flash.backend.read_back

    def slow_read_back(t):
        rb, until = read_back(t), _time.monotonic() + 0.03
        return Readback(rb.wait, lambda: _time.monotonic() > until)
    flash.backend.read_back = slow_read_back
    launched_behind = []
    launch = flash.launch

    def counting_launch(batch):
        launched_behind.append(flash._unfinished is not None)
        return launch(batch)
    flash.launch = counting_launch
    with serving() as run:
        remote = RemoteExecutor(run(WorkerServer(flash, f"ipc://{tmp_path}/w.sock", keys=None)), timeout_s=60)
        assert scheduled_run(remote, "r", True) == want
        assert sum(launched_behind) > 5
        # a scheduler that does not plan ahead (Batch.ahead False) gets each batch run to its
        # end and answered: none is launched while another is unfinished
        del launched_behind[:]
        assert scheduled_run(remote, "q", False) == want
        assert launched_behind and not any(launched_behind)
        remote.close()


def test_planning_the_next_hybrid_batch_waits_only_for_each_wrappers_own_last_plan(monkeypatch):
    """On CUDA a plan() overwrites its wrapper's pinned buffer, so it waits for the event after
    that wrapper's previous plan (queued before that batch's kernels: already passed when the next
    batch is planned). A hybrid batch plans two wrappers; its second plan must not wait for the
    event its first one just recorded, which sits behind the batch running on the GPU: with async
    scheduling that wait held every hybrid batch's launch until the batch before it had ended.
    The stream is modelled: an event is passed once the GPU has run what was queued before it."""
    from worker_svc.backends.cuda import FlashInferAttention

    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(FlashInferAttention, "workspace_bytes", 1024)
    stream = {"queued": 0, "done": 0}
    waits: list[tuple[str, bool]] = []     # (event's wrapper, whether it was behind running work)

    class Event:
        def record(self):
            self.position, self.wrapper = stream["queued"], planning[-1]

        def synchronize(self):
            waits.append((self.wrapper, self.position > stream["done"]))

    planning: list[str] = []
    att = FlashInferAttention(torch.device("cpu"), torch.float32)
    att.bind(4, 2, 16, torch.float32, 0.25, max_pages=64)
    plan = att.plan

    def named_plan(wrapper, pb):
        planning.append("decode" if wrapper is att.decode else "prefill")
        plan(wrapper, pb)
    monkeypatch.setattr(att, "plan", named_plan)
    monkeypatch.setattr(att, "_cuda", True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    hybrid = [(40, 1, [0, 1, 2]), (17, 1, [3, 4]), (0, 24, [5, 6])]   # two decodes, then a chunk

    att.build_metadata(hybrid, BS, "cpu")      # batch n - 1, planned on an idle GPU
    stream["done"] = stream["queued"]          # ... and run
    att.build_metadata(hybrid, BS, "cpu")      # batch n
    stream["queued"] += 1                      # batch n's kernels queued: the GPU is busy with it
    waits.clear()
    att.build_metadata(hybrid, BS, "cpu")      # batch n + 1, planned while batch n runs
    assert waits == [("decode", False), ("prefill", False)]   # each its own event, none behind n
