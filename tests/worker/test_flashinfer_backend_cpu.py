"""The CUDA backend's FlashInfer attention, graph runner and device sampling, driven on the CPU
through a stand-in `flashinfer` (tests/support/fake_flashinfer.py: FlashInfer's wrapper signatures, its
semantics computed by a plain-torch reference) and eager replay in place of CUDA graphs. This
checks the plumbing: which wrapper plans which batch, the order and types of plan() arguments,
the scratch block, padding to graph sizes, static buffers, sampling on the device. The kernels
and real graph capture are GPU tests (tests/gpu/test_backend.py), not run here."""
from __future__ import annotations

import pytest
import torch

from shared.config import CacheConfig, WorkerConfig
from shared.messages import Batch
from tests.support import fake_flashinfer
from tests.support.engine_helpers import (
    BlockPool,
    blocks_for,
    chunk,
    greedy_generate,
    make_executor,
    make_tiny_checkpoint,
    use_threads,
)
from worker_svc import executor as executor_mod
from worker_svc.backends.base import LinearMethod
from worker_svc.backends.cuda import cuda_graphs
from worker_svc.executor import BatchError, Executor

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

    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(FlashInferAttention, "workspace_bytes", 1024)

    def select(device, dtype, kv_cache_dtype=None, attention="auto", weight_quant="auto"):
        return CudaBackend(torch.device("cpu"), FlashInferAttention(torch.device("cpu"), dtype),
                           LinearMethod(), dtype, dtype, scratch_blocks=1, graph_runner_class=EagerGraphRunner)
    monkeypatch.setattr(executor_mod, "select_backend", select)


@pytest.fixture(scope="module", params=["llama", "qwen2_bias"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fi"), request.param)


def flash_executor(path, graphs=True) -> Executor:
    return Executor(WorkerConfig(model=str(path), dtype="float32", cuda_graphs=graphs, max_num_seqs=8,
                                 cache=CacheConfig(BS, NUM_BLOCKS)))


def prompt(n, seed):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hybrid_batches_give_the_torch_paths_logits(fake_backend, ckpt):
    flash, ref = flash_executor(ckpt), make_executor(ckpt, num_blocks=NUM_BLOCKS)
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
    for b in batches:
        got, want = flash.compute_logits(b), ref.compute_logits(b)
        assert got.keys() == want.keys()
        for r in want:
            assert (got[r] - want[r]).abs().max().item() < 1e-4, (b.batch_id, r)
    att = flash.backend.attention
    assert att.prefill.runs > 0 and flash.graphs.wrappers[4].runs > 0   # 3 decodes -> graph of 4


def test_graph_sizes_padding_and_eager_fallback(fake_backend, ckpt):
    flash = flash_executor(ckpt)
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
    flash = flash_executor(ckpt)
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
    flash = flash_executor(ckpt)
    assert flash.device_sampler is not None
    assert greedy_generate(flash, p, 32, BlockPool(NUM_BLOCKS, shuffle_seed=8).take(blocks_for(72, BS)),
                           chunk_size=15) == ref
