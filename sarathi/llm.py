"""The offline Python API: `LLM(model).generate(prompts, params)`.

It joins the three in-process parts the services run apart: the tokenizer (shared), the
scheduler with its batching policy (scheduler_svc) and the model runner (worker_svc), which is the
engine loop's executor.

    >>> from sarathi import LLM, SamplingParams
    >>> llm = LLM()                                   # SmolLM2-135M-Instruct, CPU
    >>> out = llm.chat([[{"role": "user", "content": "Hi!"}]], SamplingParams(temperature=0, max_tokens=16))
    >>> print(out[0].text)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from scheduler_svc.engine_loop import EngineLoop, GenerationOutput
from scheduler_svc.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig, WorkerConfig
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer, load_tokenizer


@dataclass
class Completion:
    """One finished prompt: its text and the raw engine output (ids, finish reason, timings)."""

    prompt: str | list[int]
    text: str
    output: GenerationOutput

    @property
    def token_ids(self) -> list[int]:
        return self.output.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason


class LLM:
    """A model loaded in this process, served by the real scheduler and model runner.

    model: a GGUF file or HF-style directory; None = the shipped SmolLM2-135M-Instruct.
    policy / token_budget: the batching policy and tau (tokens per iteration).
    num_blocks / block_size: the paged KV cache (blocks per layer, tokens per block; num_blocks
    0 = auto: 2048 on CPU, sized from free memory on CUDA).
    device: "cpu" or "cuda[:n]"; gpu_memory_utilization, cuda_graphs: see WorkerConfig.
    kv_cache_dtype / weight_quant: see shared.config.WorkerConfig ("auto": the device's choice).
    async_scheduling: plan each batch while the one before runs (SchedulerConfig; on a GPU the
    next batch is launched before the previous one's tokens are read back).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", threads: int = 0,
                 num_blocks: int = 0, block_size: int = 16, policy: str = "sarathi",
                 token_budget: int = 512, max_num_seqs: int = 128,
                 max_num_batched_tokens: int = 4096, enable_prefix_caching: bool = False,
                 device: str = "cpu", gpu_memory_utilization: float = 0.9, cuda_graphs: bool = True,
                 kv_cache_dtype: str = "auto", weight_quant: str = "auto",
                 async_scheduling: bool = False):
        self._start(
            WorkerConfig(model=model, dtype=dtype, num_threads=threads, device=device,
                         cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                         gpu_memory_utilization=gpu_memory_utilization, cuda_graphs=cuda_graphs,
                         kv_cache_dtype=kv_cache_dtype, weight_quant=weight_quant),
            SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            enable_prefix_caching=enable_prefix_caching,
                            async_scheduling=async_scheduling))

    @classmethod
    def from_config(cls, worker: WorkerConfig, scheduler: SchedulerConfig) -> "LLM":
        """The same from the config objects the services take (`sarathi generate` / `bench`).
        scheduler.max_model_len is replaced by the model's context length."""
        llm = cls.__new__(cls)
        llm._start(worker, scheduler)
        return llm

    def _start(self, worker: WorkerConfig, scheduler: SchedulerConfig) -> None:
        from worker_svc.model_runner import ModelRunner  # torch lives only behind this import

        source = resolve_model(worker.model)
        self._source, self._tokenizer = source, None
        # the worker's profiling pass (CUDA) covers the largest iteration the policy can make
        self.model_runner = ModelRunner(dataclasses.replace(
            worker, model=str(source.path), max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_tokens_per_iteration))
        info = self.model_info = self.model_runner.model_info
        self.scheduler_config = dataclasses.replace(scheduler, max_model_len=info.max_model_len)
        # the worker decides the block count (num_blocks 0 = auto): the scheduler uses its figure
        self.engine = self.make_engine(self.scheduler_config)

    @property
    def executor(self):
        """The model runner (worker_svc.model_runner.ModelRunner) in its role as the engine loop's
        executor: the public name of `model_runner`."""
        return self.model_runner

    def make_engine(self, scheduler: SchedulerConfig) -> EngineLoop:
        """A fresh scheduler with `scheduler`'s policy and limits on this model's runner (its KV
        cache is reused: the previous engine must have finished its requests)."""
        info = self.model_info
        return EngineLoop(Scheduler(scheduler, CacheConfig(info.block_size, info.num_blocks), info),
                          self.model_runner)

    @property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: a checkpoint without tokenizer files still serves token ids."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._source)
        return self._tokenizer

    def generate(self, prompts: Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Complete each prompt (text, or token ids); results in the order of the prompts.
        An invalid request raises InvalidRequestError before anything runs."""
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        outputs = self.engine.generate(ids, params)
        return [Completion(p, self._decode(o), o) for p, o in zip(prompts, outputs)]

    def chat(self, conversations: Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Like generate(), each conversation rendered with the model's chat template."""
        ids = [self.tokenizer.encode_chat(c) for c in conversations]
        outputs = self.engine.generate(ids, params)
        return [Completion(i, self._decode(o), o) for i, o in zip(ids, outputs)]

    def _decode(self, out: GenerationOutput) -> str:
        if self._tokenizer is None and not self._has_tokenizer_files():
            return ""  # ids in, ids out: see Completion.token_ids
        return self.tokenizer.decode(out.output_token_ids)

    def _has_tokenizer_files(self) -> bool:
        return self._source.kind == "gguf" or (self._source.path / "tokenizer.json").is_file()
