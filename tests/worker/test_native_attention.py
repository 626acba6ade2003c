"""The native paged decode kernel (worker_svc/backends/cpu/native.py) against a plain torch reference:
gather each sequence's K/V in position order, softmax in fp32, weight V."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from worker_svc.backends.cpu import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel not built: {native.unavailable_reason()}")


def reference(q, kc, vc, tables, lens, scale):
    """fp32 attention of each q row [Hq, D] over its first lens[b] cached tokens."""
    _, bs, hkv, dim = kc.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // hkv
    for b, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        keys = kc[tables[b, :nb].long()].reshape(-1, hkv, dim)[:n].float()     # [n, Hkv, D]
        vals = vc[tables[b, :nb].long()].reshape(-1, hkv, dim)[:n].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)            # [Hq, n, D]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        w = torch.softmax((keys @ q[b].float().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)
        out[b] = (w.unsqueeze(1) @ vals).squeeze(1)
    return out


def make_case(lens, hq, hkv, dim, dtype, bs=16, seed=0):
    """Random cache with shuffled (non-contiguous, out of order) block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lens]
    nb = max(max(per_seq), 1)
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), nb, dtype=torch.int32)
    used = 0
    for b, k in enumerate(per_seq):
        tables[b, :k] = perm[used:used + k]
        used += k
    kc = torch.randn(num_blocks, bs, hkv, dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, dim, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, dim, generator=g)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dim", [64, 128, 80, 20])   # 80: generic AVX-512 copy; 20: scalar loops
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_matches_reference(dim, hq, hkv, threads):
    lens = [1, 15, 16, 17, 1000, 33]
    q, kc, vc, tables, ctx = make_case(lens, hq, hkv, dim, torch.float32)
    scale = 1 / math.sqrt(dim)
    out = torch.full_like(q, float("nan"))
    native.paged_decode_attention(q, kc, vc, tables, ctx, scale, out, num_threads=threads)
    assert (out - reference(q, kc, vc, tables, ctx, scale)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
def test_bf16_cache_and_io(dim, hq, hkv):
    """bf16 cache read exactly (values are bf16); q/out bf16 round once, like any bf16 op."""
    lens = [1, 15, 16, 17, 1000]
    q, kc, vc, tables, ctx = make_case(lens, hq, hkv, dim, torch.bfloat16, seed=1)
    scale = 1 / math.sqrt(dim)
    ref = reference(q, kc, vc, tables, ctx, scale)
    out = torch.empty_like(q)                           # fp32 q/out, bf16 cache
    native.paged_decode_attention(q, kc, vc, tables, ctx, scale, out)
    assert (out - ref).abs().max().item() <= 1e-5       # exact inputs: only fp32 rounding differs
    qb = q.bfloat16()
    ref_b = reference(qb, kc, vc, tables, ctx, scale)
    outb = torch.empty_like(qb)
    native.paged_decode_attention(qb, kc, vc, tables, ctx, scale, outb)
    torch.testing.assert_close(outb.float(), ref_b, atol=1e-2, rtol=1e-2)
    assert (outb.float() - ref_b.bfloat16().float()).abs().max().item() <= 2 ** -7 * ref_b.abs().max().item()


def test_rows_index_and_strided_q():
    """Decode rows picked out of a larger batch by index; q/out with a row stride > Hq * D."""
    lens = [17, 5, 300]
    q, kc, vc, tables, ctx = make_case(lens, 9, 3, 64, torch.float32, seed=2)
    big_q = torch.zeros(7, 9, 64)
    rows = torch.tensor([5, 0, 3], dtype=torch.int32)
    big_q[rows.long()] = q
    wide = torch.zeros(7, 2, 9, 64)[:, 0]             # row stride 2 * 9 * 64
    native.paged_decode_attention(big_q, kc, vc, tables, ctx, 0.125, wide, rows=rows)
    ref = reference(q, kc, vc, tables, ctx, 0.125)
    assert (wide[rows.long()] - ref).abs().max().item() <= 1e-5
    untouched = [r for r in range(7) if r not in rows.tolist()]
    assert wide[untouched].abs().max().item() == 0


def test_mixed_lengths_large_batch_and_block_size_8():
    """~12 MB of K/V: enough work for the kernel to use both threads (it caps threads by work)."""
    lens = [int(x) for x in torch.randint(1, 400, (40,), generator=torch.Generator().manual_seed(3))]
    q, kc, vc, tables, ctx = make_case(lens, 9, 3, 64, torch.float32, bs=8, seed=4)
    out = torch.empty_like(q)
    native.paged_decode_attention(q, kc, vc, tables, ctx, 0.125, out, num_threads=2)
    assert (out - reference(q, kc, vc, tables, ctx, 0.125)).abs().max().item() <= 1e-5


def test_large_scores_are_stable():
    """Scores far from 0 (up to ~1e3) must not overflow the running exp sums."""
    q, kc, vc, tables, ctx = make_case([200], 9, 3, 64, torch.float32, seed=5)
    q *= 30
    out = torch.empty_like(q)
    native.paged_decode_attention(q, kc, vc, tables, ctx, 1.0, out)
    assert torch.isfinite(out).all()
    assert (out - reference(q, kc, vc, tables, ctx, 1.0)).abs().max().item() <= 1e-4


def test_rejects_unsupported_shapes():
    q, kc, vc, tables, ctx = make_case([3], 9, 3, 64, torch.float32)
    with pytest.raises(ValueError):
        native.paged_decode_attention(q, kc, vc, tables.long(), ctx, 0.1, torch.empty_like(q))
    with pytest.raises(ValueError):
        native.paged_decode_attention(q[:, :8], kc, vc, tables, ctx, 0.1, torch.empty_like(q[:, :8]))


def test_missing_compiler_falls_back(fresh_native, monkeypatch, caplog):
    """A build here that cannot compile (the prebuilt variants skipped): torch, one warning."""
    monkeypatch.setenv("SARATHI_NATIVE_BUILD", "jit")
    monkeypatch.setenv("SARATHI_CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="worker_svc.backends.cpu.native"):
        assert native.available() is False
        assert native.available() is False           # second call: no retry, no second log
    assert "nonexistent" in native.unavailable_reason()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    with pytest.raises(RuntimeError):
        q, kc, vc, tables, ctx = make_case([3], 9, 3, 64, torch.float32)
        native.paged_decode_attention(q, kc, vc, tables, ctx, 0.1, torch.empty_like(q))


def test_broken_compiler_falls_back(fresh_native, monkeypatch):
    monkeypatch.setenv("SARATHI_NATIVE_BUILD", "jit")
    monkeypatch.setenv("SARATHI_CC", "false")          # runs, exits 1, writes nothing
    assert native.available() is False
    assert "failed" in native.unavailable_reason()


def test_env_disables(fresh_native, monkeypatch):
    monkeypatch.setenv("SARATHI_NATIVE_ATTENTION", "0")
    assert native.available() is False
    assert "SARATHI_NATIVE_ATTENTION" in native.unavailable_reason()


def test_build_into_fresh_cache_dir(fresh_native, tmp_path, monkeypatch):
    """A build from nothing into an empty cache dir: one library, no temporary left. The portable
    (x86-64) build: the mechanics are the same and it compiles in a fraction of the -march=native
    build's time (the native build is what every other test loads)."""
    monkeypatch.setenv("SARATHI_NATIVE_MARCH", "x86-64")
    assert native.available()
    assert native.library_path().parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [native.library_path().name]   # no temp left


def test_paged_attention_native_matches_torch_path(monkeypatch):
    """The CPU backend's native attention runs the kernel for a hybrid batch's decode rows (here
    split by a chunk, so the rows are not contiguous); the result equals the torch backend's."""
    from tests.support.engine_helpers import paged_case
    from worker_svc.backends.cpu import NativeCpuAttention
    from worker_svc.backends.torch_attention import TorchAttention

    bs, dim = 16, 64
    # decodes at 41, 16 and 101 tokens around a 20-token chunk from position 0
    cache, seqs, q, k, v = paged_case([41, 20, 16, 101], 9, 3, dim, torch.float32, bs, seed=6, new=[1, 20, 1, 1])
    calls = []
    real = native.paged_decode_attention
    monkeypatch.setattr(native, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    nat, tor = NativeCpuAttention(), TorchAttention()
    out_native = nat.forward(q, k, v, cache, 0, nat.build_metadata(seqs, bs), dim ** -0.5)
    assert calls == [1]
    out_torch = tor.forward(q, k, v, cache, 0, tor.build_metadata(seqs, bs), dim ** -0.5)
    assert len(calls) == 1
    assert (out_native - out_torch).abs().max().item() <= 1e-5


def test_cpu_backend_picks_native_when_built_and_torch_otherwise(monkeypatch):
    from worker_svc.backends import select_backend
    from worker_svc.backends.cpu import NATIVE_FASTER

    b = select_backend("cpu", torch.float32)
    fast = native.available() and native.isa() in NATIVE_FASTER
    assert b.attention.name == (f"native {native.isa()}" if fast else "torch")
    assert "attention " + b.attention.name in b.describe()
    assert select_backend("cpu", torch.float32, attention="torch").attention.name == "torch"
    monkeypatch.setattr(native, "available", lambda: False)
    assert select_backend("cpu", torch.float32).attention.name == "torch"
    with pytest.raises(ValueError, match="native"):
        select_backend("cpu", torch.float32, attention="native")
    with pytest.raises(ValueError, match="no backend"):
        select_backend("meta", torch.float32)
