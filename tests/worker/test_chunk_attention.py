"""The native prefill-chunk attention kernel (csrc/chunk_attention.c, native.chunk_attention)
against a plain fp32 reference, on both SIMD widths this machine runs, and the CPU backend's use
of it for a hybrid batch's chunks."""
from __future__ import annotations

import math

import pytest
import torch

from worker_svc.backends.cpu import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel not built: {native.unavailable_reason()}")


def reference(q, kc, vc, table, start, scale):
    """Query i (position start + i) over keys 0 .. start + i of the sequence, fp32."""
    n, hq, dim = q.shape
    _, bs, hkv, _ = kc.shape
    ctx = start + n
    nb = -(-ctx // bs)
    keys = kc[table[:nb].long()].reshape(-1, hkv, dim)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
    vals = vc[table[:nb].long()].reshape(-1, hkv, dim)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    visible = torch.arange(ctx).unsqueeze(0) <= (start + torch.arange(n)).unsqueeze(1)    # [n, ctx]
    w = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", w, vals)


def make_case(n, start, hq, hkv, dim, kv_dtype, bs=16, seed=0, q_scale=1.0):
    """A cache with the sequence's blocks shuffled among others (out of order, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-(start + n) // bs)
    kc = torch.randn(nb + 5, bs, hkv, dim, generator=g).to(kv_dtype)
    vc = torch.randn(nb + 5, bs, hkv, dim, generator=g).to(kv_dtype)
    table = torch.randperm(nb + 5, generator=g)[:nb].to(torch.int32)
    q = torch.randn(n, hq, dim, generator=g) * q_scale
    return q, kc, vc, table


CASES = [   # n, start, hq, hkv, dim, bs
    (512, 0, 9, 3, 64, 16),      # SmolLM2's prefill: 4 queries x 3 heads a unit (AVX-512), 2 x 3 (AVX2)
    (7, 0, 9, 3, 64, 16),        # fewer queries than a unit: padding rows
    (33, 100, 9, 3, 64, 16),     # a chunk after a cached prefix, tiles straddling both
    (100, 37, 8, 8, 128, 16),    # MHA, head dim 128
    (50, 3, 32, 2, 64, 8),       # G = 16: a kv head's queries split over units
    (2, 0, 14, 2, 64, 32),       # G = 7 (above AVX2's 6 rows a unit), block size 32
    (300, 700, 4, 1, 96, 16),    # MQA, head dim 96
]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference(kv_dtype, threads):
    for i, (n, start, hq, hkv, dim, bs) in enumerate(CASES):
        q, kc, vc, table = make_case(n, start, hq, hkv, dim, kv_dtype, bs, seed=i)
        out = torch.full_like(q, float("nan"))
        assert native.chunk_attention(q, kc, vc, table, start, dim ** -0.5, out, num_threads=threads)
        err = (out - reference(q, kc, vc, table, start, dim ** -0.5)).abs().max().item()
        assert err <= 2e-5, (n, start, hq, hkv, dim, bs, err)


def test_bf16_queries_and_output_strided_rows():
    """bf16 q/out (rounded once at the end) and rows of a larger tensor (the batch's chunk rows)."""
    q, kc, vc, table = make_case(40, 20, 9, 3, 64, torch.bfloat16, seed=3)
    big = torch.zeros(50, 9, 64, dtype=torch.bfloat16)
    big[5:45] = q.bfloat16()
    out = torch.zeros(50, 9, 64, dtype=torch.bfloat16)
    assert native.chunk_attention(big[5:45], kc, vc, table, 20, 0.125, out[5:45])
    ref = reference(big[5:45], kc, vc, table, 20, 0.125)
    assert (out[5:45].float() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()
    assert out[:5].abs().sum() == 0 and out[45:].abs().sum() == 0    # rows outside the chunk untouched


def test_large_scores_stay_finite_and_exact():
    """Scores in the hundreds (the running max grows tile after tile): no overflow, no NaN."""
    q, kc, vc, table = make_case(200, 10, 9, 3, 64, torch.float32, seed=4, q_scale=80.0)
    out = torch.empty_like(q)
    assert native.chunk_attention(q, kc, vc, table, 10, 0.125, out)
    ref = reference(q, kc, vc, table, 10, 0.125)
    assert torch.isfinite(out).all() and (out - ref).abs().max().item() <= 1e-4


def test_a_querys_result_does_not_depend_on_its_chunk():
    """The same positions as the tail of a longer chunk or as a chunk of their own (after the
    same cached prefix), grouped into other units: the same bits."""
    q, kc, vc, table = make_case(45, 0, 9, 3, 64, torch.bfloat16, seed=5)
    whole = torch.empty_like(q)
    assert native.chunk_attention(q, kc, vc, table, 0, 0.125, whole)
    for start in (13, 30, 44):
        tail = torch.empty_like(q[start:])
        assert native.chunk_attention(q[start:], kc, vc, table, start, 0.125, tail)
        assert torch.equal(tail, whole[start:]), start


def test_layouts_it_does_not_take_return_false_and_leave_out_untouched():
    q, kc, vc, table = make_case(20, 0, 4, 2, 20, torch.float32)    # D = 20: no SIMD tile fits
    out = torch.full_like(q, 7.0)
    assert native.chunk_attention(q, kc, vc, table, 0, 0.2, out) is False
    assert (out == 7.0).all()


def test_bad_arguments_are_refused():
    q, kc, vc, table = make_case(20, 4, 9, 3, 64, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        native.chunk_attention(q, kc, vc, table.long(), 4, 0.125, out)
    with pytest.raises(ValueError, match="cover"):
        native.chunk_attention(q, kc, vc, table[:1], 4, 0.125, out)
    with pytest.raises(ValueError, match="does not match"):
        native.chunk_attention(q, kc, vc, table, 4, 0.125, out[:10])
    with pytest.raises(ValueError, match="unsupported"):
        native.chunk_attention(q, kc, vc.bfloat16(), table, 4, 0.125, out)


@pytest.mark.skipif(native.isa() != "avx512", reason="the AVX2 build is the second SIMD path on an AVX-512 machine")
def test_avx2_build_on_an_avx512_machine(fresh_native, monkeypatch):
    monkeypatch.setenv("SARATHI_NATIVE_VARIANT", "avx2")
    assert native.available() and native.isa() == "avx2"
    test_matches_the_reference(torch.bfloat16, 2)
    test_large_scores_stay_finite_and_exact()
    test_a_querys_result_does_not_depend_on_its_chunk()


def test_portable_build_declines(fresh_native, monkeypatch):
    """The scalar build has no chunk kernel: it says so, and the backend keeps SDPA."""
    monkeypatch.setenv("SARATHI_NATIVE_VARIANT", "portable")
    assert native.available() and native.isa() == "scalar"
    q, kc, vc, table = make_case(20, 0, 9, 3, 64, torch.float32)
    assert native.chunk_attention(q, kc, vc, table, 0, 0.125, torch.empty_like(q)) is False


def _hybrid_case(seed=6):
    """A decode, a chunk from position 0, a decode, a chunk after a cached prefix of 37 (bf16 cache)."""
    from tests.support.engine_helpers import paged_case

    dim = 64
    return (*paged_case([41, 20, 16, 67], 9, 3, dim, torch.bfloat16, 16, seed=seed, new=[1, 20, 1, 30]), dim ** -0.5)


def test_backend_runs_chunks_on_the_kernel_and_agrees_with_the_torch_path(monkeypatch):
    from worker_svc.backends.cpu import NativeCpuAttention
    from worker_svc.backends.torch_attention import TorchAttention

    cache, seqs, q, k, v, scale = _hybrid_case()
    calls = []
    real = native.chunk_attention
    monkeypatch.setattr(native, "chunk_attention", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    nat, tor = NativeCpuAttention(), TorchAttention()
    out_native = nat.forward(q, k, v, cache, 0, nat.build_metadata(seqs, 16), scale)
    assert calls == [0, 37]                       # each chunk once, with its start position
    out_torch = tor.forward(q, k, v, cache, 0, tor.build_metadata(seqs, 16), scale)
    assert (out_native - out_torch).abs().max().item() <= 1e-5


def test_chunks_stay_on_sdpa_when_turned_off(monkeypatch):
    from worker_svc.backends.cpu import NativeCpuAttention

    monkeypatch.setenv("SARATHI_NATIVE_CHUNK", "0")
    cache, seqs, q, k, v, scale = _hybrid_case(seed=7)
    monkeypatch.setattr(native, "chunk_attention", lambda *a, **kw: pytest.fail("the kernel ran"))
    nat = NativeCpuAttention()
    assert nat.name.endswith("(chunks on torch SDPA)")
    out = nat.forward(q, k, v, cache, 0, nat.build_metadata(seqs, 16), scale)
    row = 0
    for start, n, table in seqs:
        if n > 1:   # the chunk rows: the reference over the cache the layer wrote
            ref = reference(q[row:row + n], cache.k[0], cache.v[0], torch.tensor(table, dtype=torch.int32),
                            start, scale)
            assert (out[row:row + n] - ref).abs().max().item() <= 1e-5
        row += n
    assert math.isfinite(out.abs().max().item())
