"""A weight as the GGUF file stores it: rows of quantized blocks, carried beside its float form.

The loader attaches a GgufBlocks to each float weight it dequantized from a block format that a
backend may compute on directly (attribute `gguf_blocks` of the tensor); the linear layers
(worker_svc.model.linear) shard and concatenate the blocks exactly as they do the float weight,
and hand them to the backend's LinearMethod as `layer.gguf`. Rows of a GGUF matrix are
independent runs of blocks, so row slices, row concatenation and row permutations of the bytes
are exact; a column shard is exact when it falls on block boundaries. Device-neutral: bytes and
a type code. A leaf module below the loader, the model and the backends, which all read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml type code -> (elements per block, bytes per block) of the formats the CPU backend has
# block kernels for (worker_svc/backends/cpu/csrc/gguf_*.c); gguf.GGML_QUANT_SIZES agrees
BLOCK_FORMATS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
FORMAT_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@dataclass(frozen=True)
class GgufBlocks:
    """ggml_type: the ggml type code; data: uint8 [N, row_bytes] contiguous (N output rows);
    cols: K, the elements per row. Invariant: row_bytes == K / block elems * block bytes."""

    ggml_type: int
    data: torch.Tensor
    cols: int

    @property
    def name(self) -> str:
        return FORMAT_NAMES.get(self.ggml_type, str(self.ggml_type))

    @staticmethod
    def of(t: torch.Tensor) -> GgufBlocks | None:
        """The blocks the loader attached to t (None for a plain tensor)."""
        return getattr(t, "gguf_blocks", None)

    def shard_rows(self, rank: int, world_size: int) -> GgufBlocks:
        if world_size == 1:
            return self
        return GgufBlocks(self.ggml_type, self.data.chunk(world_size, dim=0)[rank].contiguous(), self.cols)

    def shard_cols(self, rank: int, world_size: int) -> GgufBlocks | None:
        """The column shard, or None when the shard boundary is not a block boundary."""
        if world_size == 1:
            return self
        elems, nbytes = BLOCK_FORMATS[self.ggml_type]
        if self.cols % (world_size * elems):
            return None
        per = self.cols // world_size // elems * nbytes
        return GgufBlocks(self.ggml_type, self.data[:, rank * per:(rank + 1) * per].contiguous(),
                          self.cols // world_size)

    @staticmethod
    def concat_rows(parts: list[GgufBlocks | None]) -> GgufBlocks | None:
        """The row concatenation, or None unless every part has blocks of one type and width."""
        if not parts or any(p is None for p in parts):
            return None
        if len({(p.ggml_type, p.cols) for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]
        return GgufBlocks(parts[0].ggml_type, torch.cat([p.data for p in parts]).contiguous(), parts[0].cols)
