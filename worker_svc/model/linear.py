"""Linear layers written so tensor parallelism (Megatron style) can shard them later.

* ColumnParallelLinear splits the output features across ranks (q/k/v, gate/up): each rank
  computes its own heads / intermediate slice, no communication.
* RowParallelLinear splits the input features (o_proj, down_proj): each rank holds the
  matching column slice, and the partial outputs are summed with one all-reduce.

How the (sharded) weight is stored and multiplied is the device backend's LinearMethod
(worker_svc/backends/base.py): dense F.linear by default. Fused layers (qkv, gate_up) are
sharded part by part, so each rank keeps whole heads of q, k and v.

GGUF weights: when every part of a layer's weight carries the file's blocks (GgufBlocks, attached
by the loader), the layer's `gguf` is those blocks sharded and concatenated like the float weight
(None otherwise), for the LinearMethod's process(); the layer drops the attribute afterwards
(a method that computes on the blocks keeps its own reference).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.backends import LinearMethod
from worker_svc.gguf_blocks import GgufBlocks


@dataclass(frozen=True)
class TensorParallel:
    """The process-group hook: this rank's index, the group size, the torch.distributed group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/world_size slice of t along dim."""
        if self.world_size == 1:
            return t
        if t.shape[dim] % self.world_size:
            raise ValueError(f"cannot split size {t.shape[dim]} across {self.world_size} ranks")
        return t.chunk(self.world_size, dim=dim)[self.rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x


class ColumnParallelLinear(torch.nn.Module):
    """y = x @ W.T (+ b); W is the concatenation of `parts` (e.g. q, k, v), each sharded by rows."""

    def __init__(self, parts: list[torch.Tensor], biases: list[torch.Tensor] | None,
                 tp: TensorParallel, dtype: torch.dtype, method: LinearMethod = LinearMethod()):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.cat([tp.shard(w, 0) for w in parts]).to(dtype).contiguous(), requires_grad=False)
        self.bias = None if biases is None else torch.nn.Parameter(
            torch.cat([tp.shard(b, 0) for b in biases]).to(dtype), requires_grad=False)
        blocks = [GgufBlocks.of(w) for w in parts]
        self.gguf = GgufBlocks.concat_rows([b and b.shard_rows(tp.rank, tp.world_size) for b in blocks])
        self.method = method
        method.process(self)
        del self.gguf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_shard @ W_shard.T): x arrives already split by columns (heads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel,
                 dtype: torch.dtype, method: LinearMethod = LinearMethod()):
        super().__init__()
        self.tp = tp
        self.weight = torch.nn.Parameter(tp.shard(weight, 1).to(dtype).contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        blocks = GgufBlocks.of(weight)
        self.gguf = blocks and blocks.shard_cols(tp.rank, tp.world_size)
        self.method = method
        method.process(self)
        del self.gguf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias   # the bias is added once, after the sum


class ReplicatedLinear(torch.nn.Module):
    """y = x @ W.T with the whole weight on every rank (the LM head). `weight` is an existing
    Parameter, kept as is (shared with the embedding when the model ties them)."""

    # its outputs are logits (sampling, logprobs): a linear method must not round them below the
    # compute dtype (e.g. Int8LinearMethod's bf16 GEMM for large batches is not used here)
    full_precision_output = True

    def __init__(self, weight: torch.nn.Parameter, method: LinearMethod = LinearMethod()):
        super().__init__()
        self.weight = weight
        self.bias = None
        self.gguf = GgufBlocks.of(weight)
        self.method = method
        method.process(self)
        del self.gguf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)
