"""The paged KV cache: the tensors a worker owns; the scheduler owns which blocks are whose.

Layout per layer: k and v are [num_blocks, block_size, num_kv_heads, head_dim]. Token position
p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
Gathering a sequence's blocks with index_select then yields [tokens, heads, dim] rows in
position order with no further copy, which is what the attention kernels read.
"""
from __future__ import annotations

import torch


class PagedKVCache:
    """num_layers x (k, v), each [num_blocks, block_size, num_kv_heads, head_dim] of `dtype`
    (the KV cache dtype, independent of the compute dtype; readers widen what they read).

    Zero-initialised on purpose: padded decode batches read blocks they do not own and mask
    them out; garbage NaNs there would survive a zero attention weight (0 * NaN = NaN).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of this step's tokens at `slots` [T] (int64), cast to the
        cache's dtype (which may be narrower than the compute dtype: a 16-bit cache rounds
        here, once per token)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(self.num_slots, *k.shape[1:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(self.num_slots, *v.shape[1:]).index_copy_(0, slots, v.to(vc.dtype))
