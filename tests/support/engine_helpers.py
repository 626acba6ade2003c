"""Helpers for the engine tests: tiny random Llama-family checkpoints in a temp dir, and a
minimal driver that runs prompts through a ModelRunner the way a scheduler would."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from bench.common import agreement, hf_greedy_reference, teacher_forced_logits  # noqa: F401 (moved there: bench uses them too)
from bench.common import hf_model_from_gguf as _hf_model_from_gguf
from shared.config import CacheConfig, WorkerConfig
from shared.messages import Batch, SeqChunk
from shared.sampling import SamplingParams
from worker_svc.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@functools.lru_cache(maxsize=2)
def hf_model_from_gguf(path: str):
    """Hugging Face's model of a GGUF, loaded once per test session (20-40 s for SmolLM2 on 2
    cores; the tests only run it under no_grad, never change it)."""
    return _hf_model_from_gguf(path)

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, initializer_range=0.2, eos_token_id=1, bos_token_id=0,
               tie_word_embeddings=False)

TINY_CONFIGS = {
    "llama": ("llama", {}),
    "qwen2_bias": ("qwen2", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64},
                              "rope_theta": 500000.0}),
}


def make_tiny_checkpoint(root: Path, name: str, seed: int = 0) -> Path:
    """Save a random-initialised tiny model of TINY_CONFIGS[name] (safetensors) under root."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = TINY_CONFIGS[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if model_type == "qwen2":    # init zeroes biases; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_executor(model: str | Path | None, dtype: str = "float32", num_blocks: int = 256,
                  block_size: int = 16, kv_cache_dtype: str | None = None,
                  weight_quant: str = "none") -> ModelRunner:
    """The exactness setting by default: float weights and a KV cache in the compute dtype
    (HF-equal greedy output); quantized modes are asked for explicitly."""
    return ModelRunner(WorkerConfig(model=None if model is None else str(model), dtype=dtype,
                                    cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                    kv_cache_dtype=kv_cache_dtype or dtype, weight_quant=weight_quant))


class BlockPool:
    """Hands out block ids like the scheduler would: contiguous by default, or shuffled."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        ids = list(range(num_blocks))
        if shuffle_seed is not None:
            ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        self.free = ids

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def paged_case(lens, hq, hkv, dim, kv_dtype, bs=16, seed=0, new=None):
    """A layer's cache with shuffled block tables and one step's q/k/v for len(lens) sequences:
    sequence i has lens[i] tokens once the step is written, new[i] of them this step (default 1:
    decodes; more: a chunk after a cached prefix of lens[i] - new[i]). -> (cache, seqs as
    (start_pos, num_new_tokens, block_table), q [T, hq, dim], k, v [T, hkv, dim])."""
    from worker_svc.kv_cache import PagedKVCache

    new = new or [1] * len(lens)
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(blocks_for(n, bs) for n in lens) + 2
    cache = PagedKVCache(1, num_blocks, bs, hkv, dim, kv_dtype)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, used = [], 0
    for n, m in zip(lens, new):
        k = blocks_for(n, bs)
        seqs.append((n - m, m, perm[used:used + k]))
        used += k
    T = sum(new)
    q = torch.randn(T, hq, dim, generator=g)
    k, v = torch.randn(T, hkv, dim, generator=g), torch.randn(T, hkv, dim, generator=g)
    return cache, seqs, q, k, v


def chunk(req_id: str, tokens: list[int], start: int, table: list[int], sample: bool,
          params: SamplingParams = GREEDY, output_index: int = 0) -> SeqChunk:
    return SeqChunk(req_id, list(tokens), start, table, sample, params, output_index)


def prefill_logits(ex: ModelRunner, prompt: list[int], table: list[int], chunk_size: int,
                   req_id: str = "r") -> torch.Tensor:
    """Prefill `prompt` in chunks of chunk_size; the logits [V] after its last token."""
    logits = None
    for start in range(0, len(prompt), chunk_size):
        piece = prompt[start:start + chunk_size]
        last = start + len(piece) == len(prompt)
        out = ex.compute_logits(Batch(0, [chunk(req_id, piece, start, table, last)]))
        logits = out.get(req_id, logits)
    return logits


def greedy_generate(ex: ModelRunner, prompt: list[int], max_new: int, table: list[int],
                    chunk_size: int | None = None) -> list[int]:
    """Greedy continuation through execute(): chunked prefill, then one decode per step."""
    chunk_size = chunk_size or len(prompt)
    out: list[int] = []
    for start in range(0, len(prompt), chunk_size):
        piece = prompt[start:start + chunk_size]
        res = ex.execute(Batch(0, [chunk("g", piece, start, table, start + len(piece) == len(prompt))]))
    out.append(res.sampled["g"])
    while len(out) < max_new:
        pos = len(prompt) + len(out) - 1
        res = ex.execute(Batch(0, [chunk("g", [out[-1]], pos, table, True, output_index=len(out))]))
        out.append(res.sampled["g"])
    return out


def use_threads(n: int):
    """A module fixture body: run with n torch threads, restore afterwards. The tests use 1:
    on a shared 2-core machine, 2 threads stall badly whenever anything else runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(before)


# the real default model against transformers (worker/test_engine_smollm2.py, worker/test_cpu_backend.py)
PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]




def scheduled_run(executor, tag: str, asy: bool, record: list | None = None, info=None,
                  same_length: bool = False) -> dict:
    """Six requests (greedy, seeded sampled, with logit_bias; prompts over the budget of 24, so
    chunks ride beside decodes) through the real scheduler over `executor` (its model_info, or
    `info`), with or without async scheduling; {index: output tokens}. record: gets the loop's
    trace (which batches were submitted behind another). same_length: every request makes 12
    tokens, so none ends before the others and the batches are those of the synchronous loop
    row for row (the decode planned past a request's end would otherwise take a budget token
    from a chunk: other shapes, which bf16 GPU kernels may round differently)."""
    from scheduler_svc.engine_loop import EngineLoop
    from scheduler_svc.scheduler import Scheduler
    from shared.config import SchedulerConfig

    info = info or executor.model_info
    sched = Scheduler(SchedulerConfig(token_budget=24, max_num_seqs=8, max_model_len=256,
                                      async_scheduling=asy),
                      CacheConfig(info.block_size, info.num_blocks), info)
    loop = EngineLoop(sched, executor, record=True)
    sps = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
           SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=14, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=((7, 5.0),))] * 2
    if same_length:
        sps = [dataclasses.replace(sp, max_tokens=12) for sp in sps]
    gen = torch.Generator().manual_seed(40)
    reqs = [loop.add_request(f"{tag}{i}", torch.randint(2, 256, (9 + 13 * i,), generator=gen).tolist(), sp)
            for i, sp in enumerate(sps)]
    loop.run_until_done()
    if record is not None:
        record.extend(loop.trace)
    return {i: r.output_token_ids for i, r in enumerate(reqs)}


class LaunchAhead:
    """An executor that launches each batch when it is submitted and reads its tokens back when
    it is collected, as the worker service does on a GPU: batch n + 1 is launched before batch
    n is finished, so its decodes planned ahead take batch n's tokens on the device."""

    def __init__(self, runner: ModelRunner):
        from collections import deque
        self.runner, self.runs = runner, deque()
        self.launched_behind = 0      # launches while the batch before was not finished

    @property
    def model_info(self):
        return self.runner.model_info

    def submit(self, batch: Batch) -> None:
        self.launched_behind += bool(self.runs)
        self.runs.append((batch, self.runner.launch(batch)))

    def collect(self):
        batch, run = self.runs.popleft()
        return batch, self.runner.finish(run)
