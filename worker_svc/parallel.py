"""Tensor and pipeline parallelism: every torch.distributed call of a worker lives here.

A replica is tp x pp ranks (one process each). Rank r is tensor-parallel rank r % tp of
pipeline stage r // tp; ranks of one stage form a TP group. Every rank receives every batch from
the scheduler (each rebuilds positions and attention metadata itself), so only activations
cross between ranks:

* TP (Megatron style, inside a stage): column-parallel q/k/v and gate/up, row-parallel o/down
  with one all-reduce each (worker_svc.model.linear); heads and the KV cache are split by kv
  head; the embedding and the LM head are split by vocabulary rows (a masked lookup + all-reduce,
  and an all-gather of the logit shards). After every all-reduce / all-gather each rank of the
  group holds the same values, so every rank would sample the same token; to be independent of
  per-process RNG state, TP rank 0 of the last stage samples and broadcasts the token ids.
* PP (between stages): stage s runs layers [start_s, end_s) and sends its hidden states
  [T, hidden] to the same TP rank of stage s + 1, preceded by a header (batch id, T) that the
  receiver checks, so a pipeline out of step is an error, not silently mixed activations.
  Sends are asynchronous: a stage replies to the scheduler and takes the next micro-batch while
  the next stage still computes (that is what lets pp micro-batches be in flight).

Bad configurations raise ParallelConfigError from check() before any weight is read. A failing
collective or send/recv (a peer died, or hung past the timeout) raises RankLostError, which the
worker service reports and then exits on: the replica's process group cannot recover.
"""
from __future__ import annotations

import datetime
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared.config import ParallelConfig, cdiv
from worker_svc.model.linear import TensorParallel
from worker_svc.model_config import ModelConfig

log = logging.getLogger("sarathi.worker")


class ParallelConfigError(ValueError):
    """tp / pp / rank settings that cannot run this model (raised before loading weights)."""


class RankLostError(RuntimeError):
    """A collective or a send/recv with another rank failed: that rank died or hangs. `fatal`:
    the process group is unusable, the worker must exit (its launcher restarts the replica)."""

    fatal = True


def parse_pp_layers(text: str | None) -> tuple[int, ...] | None:
    """"8,7" -> (8, 7); "" or None -> None (balanced)."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ParallelConfigError(f"--pp-layers must be comma-separated layer counts, got {text!r}") from None


def stage_layers(num_layers: int, pp: int, pp_layers: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) layer range of each stage."""
    if pp_layers is None:
        base, extra = divmod(num_layers, pp)
        pp_layers = tuple(base + (1 if s < extra else 0) for s in range(pp))
    bounds, start = [], 0
    for n in pp_layers:
        bounds.append((start, start + n))
        start += n
    return bounds


def check(cfg: ModelConfig, pc: ParallelConfig, world_size: int | None = None) -> None:
    """Raise ParallelConfigError naming the problem if `pc` cannot run `cfg`. world_size: the
    launcher's (WORLD_SIZE), which must equal tp x pp."""
    if pc.tp < 1 or pc.pp < 1:
        raise ParallelConfigError(f"--tp and --pp must be >= 1, got tp={pc.tp} pp={pc.pp}")
    if world_size is not None and world_size != pc.world_size:
        raise ParallelConfigError(f"tp x pp = {pc.tp} x {pc.pp} = {pc.world_size} ranks, but the "
                                  f"world size is {world_size}: start exactly tp x pp ranks")
    if not 0 <= pc.rank < pc.world_size:
        raise ParallelConfigError(f"rank {pc.rank} outside 0 .. {pc.world_size - 1} (tp x pp = {pc.world_size})")
    if pc.pp > cfg.num_layers:
        raise ParallelConfigError(f"{pc.pp} pipeline stages but the model has only {cfg.num_layers} "
                                  "layers: every stage needs at least one layer")
    if pc.pp_layers is not None:
        if len(pc.pp_layers) != pc.pp or sum(pc.pp_layers) != cfg.num_layers or min(pc.pp_layers) < 1:
            raise ParallelConfigError(
                f"--pp-layers {','.join(map(str, pc.pp_layers))} must give {pc.pp} stages of >= 1 "
                f"layer summing to the model's {cfg.num_layers} layers")
    for what, n in (("attention heads", cfg.num_heads), ("kv heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % pc.tp:
            raise ParallelConfigError(f"the model's {what} ({n}) are not divisible by tp={pc.tp}; "
                                      f"choose a tp that divides {n}")


@dataclass(frozen=True)
class _GuardedTP(TensorParallel):
    """The linear layers' TP hook, with a failed all-reduce reported as RankLostError."""

    who: str = ""
    timeout_s: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return super().all_reduce(x)
        except Exception as e:
            raise RankLostError(f"{self.who}: all_reduce failed (a rank died or hung past "
                                f"{self.timeout_s:.0f}s): {type(e).__name__}: {e}") from e


class Parallel:
    """This rank's communication (see module docstring); built after dist is initialised."""

    def __init__(self, pc: ParallelConfig, num_layers: int, device: torch.device):
        self.config = pc
        self.device = device
        self.rank, self.stage, self.tp_rank = pc.rank, pc.stage, pc.tp_rank
        self.num_stages = pc.pp
        self.layers = stage_layers(num_layers, pc.pp, pc.pp_layers)[pc.stage]
        self.is_first = pc.stage == 0
        self.is_last = pc.stage == pc.pp - 1
        self.timeout_s = pc.timeout_s
        group, self.tp_ranks = None, [pc.stage * pc.tp + i for i in range(pc.tp)]
        if pc.tp > 1:
            # every rank creates every group, in the same order (a collective call)
            for s in range(pc.pp):
                g = dist.new_group([s * pc.tp + i for i in range(pc.tp)])
                if s == pc.stage:
                    group = g
        self.tp = _GuardedTP(pc.tp_rank, pc.tp, group, pc.describe(), pc.timeout_s)
        self._pending: deque = deque()   # (work, tensors) of isends not known complete

    # -- TP: vocabulary-parallel embedding and LM head ------------------------------------------
    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this TP rank's vocabulary rows (ceil-divided; the last may be short)."""
        per = cdiv(vocab_size, self.tp.world_size)
        start = min(vocab_size, self.tp.rank * per)
        return start, min(vocab_size, start + per)

    def shard_vocab(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an embedding / LM head [V, H], zero-padded to ceil(V / tp)."""
        if self.tp.world_size == 1:
            return w
        start, end = self.vocab_shard(w.shape[0])
        per = cdiv(w.shape[0], self.tp.world_size)
        out = w.new_zeros(per, w.shape[1])
        out[:end - start] = w[start:end]
        return out

    def embed(self, ids: torch.Tensor, shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rows of the full embedding for ids [T]: each rank looks up the ids in its slice (zero
        elsewhere), the sum over ranks is exact (one non-zero term per element)."""
        if self.tp.world_size == 1:
            return F.embedding(ids, shard)
        start, end = self.vocab_shard(vocab_size)
        outside = (ids < start) | (ids >= end)
        x = F.embedding((ids - start).masked_fill(outside, 0), shard)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def lm_head(self, x: torch.Tensor, head, vocab_size: int) -> torch.Tensor:
        """Logits [S, V] float32 of x [S, H]: head (this rank's vocabulary shard as a linear
        layer of the backend's method) applied, then all-gathered over the TP group."""
        part = head(x).float()
        if self.tp.world_size == 1:
            return part
        parts = [torch.empty_like(part) for _ in range(self.tp.world_size)]
        self._guard("all_gather of logits", lambda: dist.all_gather(parts, part, group=self.tp.group))
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(x)

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """TP rank 0's sampled token ids, on every rank of this (last) stage."""
        if self.tp.world_size == 1 or not tokens:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        self._guard("broadcast of sampled tokens",
                    lambda: dist.broadcast(t, src=self.tp_ranks[0], group=self.tp.group))
        return t.tolist()

    # -- PP: hidden states between stages --------------------------------------------------------
    def send_hidden(self, x: torch.Tensor, batch_id: int) -> None:
        """Start sending x [T, H] (batch batch_id) to this TP rank of the next stage; returns
        at once (the tensors are kept alive until the send completes)."""
        dst = self.rank + self.config.tp
        header = torch.tensor([batch_id, x.shape[0]], dtype=torch.int64, device=x.device)
        x = x.contiguous()
        self._reap()
        works = self._guard(f"send to rank {dst}",
                            lambda: [dist.isend(header, dst), dist.isend(x, dst)])
        self._pending.append((works, (header, x)))

    def recv_hidden(self, batch_id: int, num_tokens: int, hidden: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        """(hidden states [T, H] of batch batch_id from the previous stage, seconds waited).
        Activations of an older batch (one this stage was never sent, e.g. after an error) are
        received and dropped; anything else out of order is a RankLostError."""
        src = self.rank - self.config.tp
        t0 = time.perf_counter()
        while True:
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            self._guard(f"recv from rank {src}", lambda: dist.recv(header, src))
            got, n = header.tolist()
            x = torch.empty(n, hidden, dtype=dtype, device=self.device)
            self._guard(f"recv from rank {src}", lambda: dist.recv(x, src))
            if got == batch_id and n == num_tokens:
                return x, time.perf_counter() - t0
            if got >= batch_id:
                raise RankLostError(f"{self.config.describe()}: pipeline out of step: expected "
                                    f"batch {batch_id} ({num_tokens} tokens) from rank {src}, "
                                    f"got batch {got} ({n} tokens)")
            log.warning("dropping activations of stale batch %d (waiting for %d)", got, batch_id)

    def _reap(self) -> None:
        while self._pending and all(w.is_completed() for w in self._pending[0][0]):
            self._pending.popleft()

    def flush(self) -> None:
        """Wait for every outstanding send (shutdown)."""
        while self._pending:
            works, _ = self._pending.popleft()
            for w in works:
                self._guard("send", w.wait)

    def _guard(self, what: str, fn):
        try:
            return fn()
        except RankLostError:
            raise
        except Exception as e:  # gloo/nccl raise RuntimeError / DistBackendError subclasses
            raise RankLostError(f"{self.config.describe()}: {what} failed (a rank died or hung "
                                f"past {self.timeout_s:.0f}s): {type(e).__name__}: {e}") from e


def init_distributed(pc: ParallelConfig, backend: str) -> None:
    """Join the replica's process group (TCP rendezvous at master_addr:master_port) over the
    torch.distributed `backend` (the device backend's dist_backend: gloo on CPU, nccl on CUDA).
    Rank 0 hosts the rendezvous store (on every interface: torch.distributed's TCPStore binds no
    address of its own), unless the local launcher already hosts it (pc.store_hosted)."""
    if pc.world_size == 1 or dist.is_initialized():
        return
    log.info("%s: joining process group (%s) at %s:%d", pc.describe(), backend, pc.master_addr,
             pc.master_port)
    timeout = datetime.timedelta(seconds=pc.timeout_s)
    if pc.store_hosted:     # the launcher listens: every rank is a client of its store
        store = dist.TCPStore(pc.master_addr, pc.master_port, pc.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=pc.rank, world_size=pc.world_size, timeout=timeout)
        return
    dist.init_process_group(backend, init_method=f"tcp://{pc.master_addr}:{pc.master_port}",
                            rank=pc.rank, world_size=pc.world_size, timeout=timeout)
