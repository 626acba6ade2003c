"""KV blocks out of a worker's paged cache into bytes, and back into (other) block ids.

This is the seam for prefill/decode disaggregation (a prefill worker exports a request's blocks,
a decode worker imports them under its own block table) and for prefix offload. The payload is
self-describing (header: dtype, shape) and exact: bf16 and fp32 are copied bit for bit.

Two forms of the same content: `export_frames` / `import_frames` keep the header (a dict) and
the raw bytes apart, so the bytes can go on the wire without a copy (kvstore.link sends them as
one ZeroMQ frame); `export_blocks` / `import_blocks` pack both into one msgpack payload (a store).

The cache is duck-typed: any object with `k` and `v`, lists (one per layer) of tensors shaped
[num_blocks, block_size, num_kv_heads, head_dim] (worker_svc.kv_cache.PagedKVCache).
"""
from __future__ import annotations

import msgpack
import torch

_MAGIC = "sarathi-kv-1"


def export_frames(cache, block_ids: list[int]) -> tuple[dict, memoryview]:
    """(header, raw bytes) of the K and V of `block_ids` (in that order) of every layer: the
    bytes are a [layers, 2, n, block_size, heads, dim] tensor in row-major order."""
    if not block_ids:
        raise ValueError("export_blocks needs at least one block id")
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.k[0].device)
    data = torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)])
                        for k, v in zip(cache.k, cache.v)]).cpu().contiguous()
    header = {"magic": _MAGIC, "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape)}
    return header, memoryview(data.view(torch.uint8).numpy()).cast("B")


def import_frames(cache, block_ids: list[int], header: dict, raw) -> None:
    """Write (header, raw bytes) from export_frames into `block_ids` of `cache` (same model and
    dtype). Raises ValueError, writing nothing, when the payload does not fit this cache."""
    if header.get("magic") != _MAGIC:
        raise ValueError("not a KV block payload (bad magic)")
    dtype = getattr(torch, header["dtype"])
    layers, two, n, *block_shape = header["shape"]
    expect = [len(cache.k), 2, len(block_ids), *cache.k[0].shape[1:]]
    if dtype != cache.k[0].dtype or [layers, two, n, *block_shape] != expect:
        raise ValueError(f"payload {header['dtype']} {header['shape']} does not fit this cache "
                         f"({str(cache.k[0].dtype).removeprefix('torch.')} {expect})")
    buf = raw if isinstance(raw, bytearray) else bytearray(raw)
    data = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(header["shape"])
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.k[0].device)
    for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
        k.index_copy_(0, idx, data[layer, 0].to(k.device))
        v.index_copy_(0, idx, data[layer, 1].to(v.device))


def export_blocks(cache, block_ids: list[int]) -> bytes:
    """The K and V of `block_ids` (in that order) of every layer, as one payload."""
    header, raw = export_frames(cache, block_ids)
    return msgpack.packb({"header": header, "data": raw.tobytes()}, use_bin_type=True)


def import_blocks(cache, block_ids: list[int], payload: bytes) -> None:
    """Write a payload from export_blocks into `block_ids` of `cache` (same model and dtype).

    Raises ValueError, writing nothing, when the payload does not fit this cache."""
    msg = msgpack.unpackb(payload, raw=False)
    import_frames(cache, block_ids, msg.get("header", {}), msg.get("data", b""))
